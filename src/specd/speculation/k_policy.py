"""How many draft tokens each sequence gets each step (k_i), decided per sequence from its own history.

The policy state is one small record per sequence (`KState`) that travels with the sequence; the policy
functions are pure: they read the state and return the next one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KState:
    """Per-sequence policy state. k is the number asked next step; idle_steps counts steps spent at k = 0."""

    k: int
    idle_steps: int = 0


@dataclass(frozen=True, slots=True)
class KPolicy:
    """fixed: k_i = k_max always. heuristic: +2 after a fully accepted draft, -1 after a partly rejected one,
    within [0, k_max]; at 0 the sequence waits `probe_interval` steps, then probes with k = 1 (otherwise a
    sequence at 0 would never produce the evidence to grow again). confidence: k_i = k_max; the model-based
    proposer stops each draft early by the draft's own probability (see the draft proposer)."""

    name: str
    probe_interval: int = 8

    def initial(self, k_max: int) -> KState:
        return KState(k=k_max)

    def update(self, state: KState, k_max: int, num_drafted: int, num_accepted: int) -> KState:
        """State after one step where `num_drafted` tokens were proposed and `num_accepted` accepted.

        A step where the proposer found nothing (num_drafted == 0 while k > 0, e.g. no n-gram match) says
        nothing about acceptance, so k is kept.
        """
        if self.name != "heuristic":
            return KState(k=k_max)
        if state.k == 0:
            if state.idle_steps + 1 >= self.probe_interval:
                return KState(k=min(1, k_max))
            return KState(k=0, idle_steps=state.idle_steps + 1)
        if num_drafted == 0:
            return state
        if num_accepted == num_drafted:
            return KState(k=min(k_max, state.k + 2))
        return KState(k=max(0, state.k - 1))
