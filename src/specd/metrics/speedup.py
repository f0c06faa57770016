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
tokens/s at the same batch sizes, weighted by step time.

Before any plain step was measured (a run where every step speculates), a decode step is priced by a cost model
of the verification steps themselves instead (`VerifyStepCost`): the least-squares line of a decode step's cost
(verify_s + sample_s, steps without prefill) against the rows its forward verified (R = B + sum_i k_i), read at
R = B, the rows a plain step at B has. Such steps count in `modelled_decode_steps`. The line needs two or more
distinct row counts and a positive value at R = B; until then a decode step has no price and counts in
`unestimated_decode_steps`, in neither sum, so the sums only grow (Prometheus counters).
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


class VerifyStepCost:
    """Least-squares line of decode-step cost against verified rows, from running sums (O(1) per step; not
    thread-safe: the recorder holds its lock)."""

    __slots__ = ("_count", "_sum_cost", "_sum_rows", "_sum_rows_cost", "_sum_rows_sq")

    def __init__(self) -> None:
        self._count = 0
        self._sum_rows = self._sum_rows_sq = 0
        self._sum_cost = self._sum_rows_cost = 0.0

    def observe(self, num_rows: int, seconds: float) -> None:
        self._count += 1
        self._sum_rows += num_rows
        self._sum_rows_sq += num_rows * num_rows
        self._sum_cost += seconds
        self._sum_rows_cost += num_rows * seconds

    def estimate(self, num_rows: int) -> float | None:
        """The line's cost at num_rows; None with fewer than two distinct row counts or a value <= 0 there."""
        spread = self._count * self._sum_rows_sq - self._sum_rows * self._sum_rows  # 0 iff all rows equal
        if spread <= 0:
            return None
        slope = (self._count * self._sum_rows_cost - self._sum_rows * self._sum_cost) / spread
        intercept = (self._sum_cost - slope * self._sum_rows) / self._count
        cost = intercept + slope * num_rows
        return cost if cost > 0.0 else None


@dataclass(frozen=True, slots=True)
class SpeedupTotals:
    """The speed-up sums of a window; they add across windows."""

    decode_s: float = 0.0  # actual seconds of decode steps that had a plain-cost estimate
    plain_decode_s: float = 0.0  # estimated seconds plain decoding would have spent on their tokens
    unestimated_decode_steps: int = 0  # decode steps with no price: no plain step measured and no cost model yet
    modelled_decode_steps: int = 0  # decode steps priced by VerifyStepCost (no plain step measured yet)

    def __add__(self, other: SpeedupTotals) -> SpeedupTotals:
        if not isinstance(other, SpeedupTotals):
            return NotImplemented
        return SpeedupTotals(
            self.decode_s + other.decode_s,
            self.plain_decode_s + other.plain_decode_s,
            self.unestimated_decode_steps + other.unestimated_decode_steps,
            self.modelled_decode_steps + other.modelled_decode_steps,
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
            "modelled_decode_steps": self.modelled_decode_steps,
            "speedup_estimate": self.speedup_estimate,
        }
