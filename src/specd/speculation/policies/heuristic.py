"""The `heuristic` k policy: grow k after fully accepted drafts, shrink it after rejections, per sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specd.speculation.k_policy import EngineLoad, KPolicy, StepReport

if TYPE_CHECKING:
    from specd.config import SpeculationConfig
    from specd.speculation.proposer import ProposerTraits


@dataclass(frozen=True, slots=True)
class KState:
    """One sequence's state. k is the number asked next step; idle_steps counts steps spent at k = 0."""

    k: int
    k_max: int
    idle_steps: int = 0


class HeuristicK(KPolicy):
    """+2 after a fully accepted draft, -1 after a partly rejected one, within [0, k_max]; at 0 the sequence waits
    `probe_interval` steps, then probes with k = 1 (otherwise a sequence at 0 would never produce the evidence to
    grow again). A step where the proposer found nothing (no draft although k > 0, e.g. no n-gram match) says
    nothing about acceptance, so k is kept."""

    def __init__(self, probe_interval: int) -> None:
        self.probe_interval = probe_interval
        self._states: dict[int, KState] = {}

    @classmethod
    def from_config(cls, spec: SpeculationConfig, traits: ProposerTraits) -> HeuristicK:
        return cls(spec.heuristic_probe_interval)

    def add(self, seq_id: int, k_max: int) -> None:
        self._states[seq_id] = KState(k=k_max, k_max=k_max)

    def plan(self, seq_ids: Sequence[int], load: EngineLoad) -> list[int]:
        return [self._states[seq_id].k for seq_id in seq_ids]

    def observe(self, report: StepReport) -> None:
        for outcome in report.outcomes:
            state = self._states.get(outcome.seq_id)
            if state is not None:
                self._states[outcome.seq_id] = self.next_state(state, outcome.num_drafted, outcome.num_accepted)

    def next_state(self, state: KState, num_drafted: int, num_accepted: int) -> KState:
        """State after one step where `num_drafted` tokens were proposed and `num_accepted` accepted."""
        if state.k == 0:
            if state.idle_steps + 1 >= self.probe_interval:
                return KState(k=min(1, state.k_max), k_max=state.k_max)
            return KState(k=0, k_max=state.k_max, idle_steps=state.idle_steps + 1)
        if num_drafted == 0:
            return state
        if num_accepted == num_drafted:
            return KState(k=min(state.k_max, state.k + 2), k_max=state.k_max)
        return KState(k=max(0, state.k - 1), k_max=state.k_max)

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
