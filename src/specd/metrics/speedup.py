"""The time-weighted speed-up estimate: how much faster decoding runs now than plain decoding would.

A *plain decode step* is a step whose sequences all verified no draft token (k_i = 0 for every i) and that
prefilled nothing; its cost, verify_s + sample_s (the proposer's time is left out: plain decoding would not
propose), is measured by batch size B = num_seqs. `PlainStepCost.estimate(B)` is the mean of those costs at B;
for a B never measured it is read off the least-squares line through the per-B means (two or more sizes
measured) or the one measured mean (one size), and it is None before any plain step.

Every decode step (one that sampled sequences) with an estimate available adds
  decode_s       += propose_s + verify_s + sample_s   (what the step cost; the prefill share is not in it)
  plain_decode_s += estimate(B) * (sum_i e_i) / B     (plain steps at B needed to emit the same tokens)
and `speedup_estimate` = plain_decode_s / decode_s: the tokens/s of the window over the plain decode
tokens/s at the same batch sizes, weighted by step time. Steps recorded before any plain step was measured
are counted in `unestimated_decode_steps` and are in neither sum, so the sums only grow (Prometheus counters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specd.metrics.records import ratio


class PlainStepCost:
    """Measured seconds of plain decode steps by batch size (not thread-safe: the recorder holds its lock)."""

    __slots__ = ("_count", "_seconds")

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # batch size -> summed cost
        self._count: dict[int, int] = {}

    def observe(self, num_seqs: int, seconds: float) -> None:
        self._seconds[num_seqs] = self._seconds.get(num_seqs, 0.0) + seconds
        self._count[num_seqs] = self._count.get(num_seqs, 0) + 1

    def estimate(self, num_seqs: int) -> float | None:
        """Seconds of one plain decode step at this batch size (see module docstring); None if none measured."""
        if num_seqs in self._count:
            return self._seconds[num_seqs] / self._count[num_seqs]
        means = [(size, self._seconds[size] / count) for size, count in self._count.items()]
        if not means:
            return None
        if len(means) == 1:
            return means[0][1]
        mean_size = sum(size for size, _ in means) / len(means)
        mean_cost = sum(cost for _, cost in means) / len(means)
        spread = sum((size - mean_size) ** 2 for size, _ in means)
        slope = sum((size - mean_size) * (cost - mean_cost) for size, cost in means) / spread
        fitted = mean_cost + slope * (num_seqs - mean_size)
        # A line fitted to noisy means can reach 0 far from them: never estimate below the cheapest measured step.
        return max(fitted, min(cost for _, cost in means))


@dataclass(frozen=True, slots=True)
class SpeedupTotals:
    """The speed-up sums of a window; they add across windows."""

    decode_s: float = 0.0  # actual seconds of decode steps that had a plain-cost estimate
    plain_decode_s: float = 0.0  # estimated seconds plain decoding would have spent on their tokens
    unestimated_decode_steps: int = 0  # decode steps recorded before any plain step was measured

    def __add__(self, other: SpeedupTotals) -> SpeedupTotals:
        if not isinstance(other, SpeedupTotals):
            return NotImplemented
        return SpeedupTotals(
            self.decode_s + other.decode_s,
            self.plain_decode_s + other.plain_decode_s,
            self.unestimated_decode_steps + other.unestimated_decode_steps,
        )

    @property
    def speedup_estimate(self) -> float | None:
        """plain_decode_s / decode_s; None when no estimated decode step took time."""
        return ratio(self.plain_decode_s, self.decode_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "decode_s": self.decode_s,
            "plain_decode_s": self.plain_decode_s,
            "unestimated_decode_steps": self.unestimated_decode_steps,
            "speedup_estimate": self.speedup_estimate,
        }
