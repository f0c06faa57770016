"""The `confidence` k policy: ask for k_max, and let a model-based proposer stop each draft where the draft model
itself is unsure (EAGLE-2's signal: the draft distribution's top probability)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specd.speculation.policies.fixed import FixedK
from specd.speculation.proposer import DraftStop, ProposerTraits

if TYPE_CHECKING:
    from specd.config import SpeculationConfig


@dataclass(frozen=True, slots=True)
class TopProbabilityStop:
    """Stop before a position whose raw top draft probability is below `threshold` (lossless: see DraftStop)."""

    threshold: float

    def stop(self, position: int, top_prob: float) -> bool:
        return top_prob < self.threshold


class ConfidenceK(FixedK):
    """k_i = k_max; the draft stops before the first position whose top probability is below the threshold."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self._stop = TopProbabilityStop(threshold)

    @classmethod
    def from_config(cls, spec: SpeculationConfig, traits: ProposerTraits) -> ConfidenceK:
        return cls(spec.confidence_threshold)

    @classmethod
    def unsupported(cls, traits: ProposerTraits) -> str | None:
        if traits.stops_while_drafting:
            return None
        return "it needs a model-based proposer, which drafts one position at a time and can stop while drafting"

    def draft_stop(self, seq_id: int) -> DraftStop | None:
        return self._stop
