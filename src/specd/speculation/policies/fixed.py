"""The `fixed` k policy: every sequence asks for its k_max at every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specd.speculation.k_policy import EngineLoad, KPolicy

if TYPE_CHECKING:
    from specd.config import SpeculationConfig
    from specd.speculation.proposer import ProposerTraits


class FixedK(KPolicy):
    """k_i = k_max for every sequence and step (the request's cap, else the engine's)."""

    def __init__(self) -> None:
        self._k_max: dict[int, int] = {}

    @classmethod
    def from_config(cls, spec: SpeculationConfig, traits: ProposerTraits) -> FixedK:
        return cls()

    def add(self, seq_id: int, k_max: int) -> None:
        self._k_max[seq_id] = k_max

    def plan(self, seq_ids: Sequence[int], load: EngineLoad) -> list[int]:
        return [self._k_max[seq_id] for seq_id in seq_ids]

    def release(self, seq_id: int) -> None:
        self._k_max.pop(seq_id, None)
