"""Per-request random generators, so a seeded request reproduces regardless of what it is batched with."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None (torch's default RNG) for unseeded requests.

    Accepts the full signed 64-bit range SamplingParams allows; torch maps negative seeds to unsigned.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def generators_per_row(
    generators: Sequence[torch.Generator | None], rows_per_seq: Sequence[int]
) -> list[torch.Generator | None]:
    """Repeat each sequence's generator for its rows, matching `build_sampling_batch`'s row layout."""
    if len(generators) != len(rows_per_seq):
        raise ValueError(f"got {len(generators)} generators for {len(rows_per_seq)} sequences")
    return [generator for generator, num_rows in zip(generators, rows_per_seq) for _ in range(num_rows)]
