"""The one interface every proposer implements; the engine never branches on which proposer it has.

A proposer is asked, once per step, for up to k_i draft tokens for each running sequence. It keeps its own
state (an n-gram index, a draft model's KV cache) and keeps it in step with what the target actually
committed by comparing against `SequenceView.token_ids` on the next call: whatever it cached beyond the
longest common prefix with the committed tokens is rolled back. So no explicit accept/rollback callback is
needed and stop truncation is handled the same way as rejection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from specd.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class SequenceView:
    """What a proposer may read about one running sequence (read-only).

    token_ids: prompt + every committed output token, in order. The last one has not been scored by the
    target yet; drafts continue after it.
    """

    seq_id: int
    token_ids: Sequence[int]
    params: SamplingParams
    generator: torch.Generator | None


class Proposal(NamedTuple):
    """Ragged draft tokens for one step.

    draft_token_ids[i] has at most the k_i asked for sequence i (fewer is allowed, zero too), each an id in
    [0, vocab_size): the engine refuses anything else with an error naming the proposer (no placeholders).
    draft_probs: [sum(len(d) for d in draft_token_ids), vocab_size] float32, the processed distribution
    each draft token was sampled from, flattened in sequence order; None for deterministic proposers
    (the rejection sampler then treats q as one-hot at the draft token).
    draft_buckets: optional per-sequence confidence class of the draft, from the proposer's own signal (ngram:
    the length of the matched suffix). The goodput k policy learns acceptance per bucket; None = one class.
    """

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None
    draft_buckets: list[int] | None = None


class Proposer(Protocol):
    """Implemented by ngram, draft-model and layer-skip proposers."""

    def propose(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> Proposal:
        """Return at most num_draft_tokens[i] drafts for seqs[i]; k_i == 0 must return [] for it.

        Changes the proposer's own per-sequence state (caches, indices) only.
        """
        ...

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence and free whatever it held."""
        ...
