"""Per-request stats and window snapshots: counters plus pooled and mean-per-request derived values."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from specd.metrics.records import (
    DEPRECATED_ALIASES,
    SCALAR_METRICS,
    SpecCounters,
    StepDetail,
    StepTotals,
    add_tuples,
    ratio,
)
from specd.metrics.speedup import SpeedupTotals


def tau_bucket_bounds(k_max: int) -> tuple[float, ...]:
    """Upper bounds (le) of the per-request tau histogram: 1.0, 1.5, ..., k_max + 1 (tau's whole range)."""
    return tuple(1.0 + 0.5 * i for i in range(2 * k_max + 1))


@dataclass(frozen=True, slots=True)
class PerRequestAggregates:
    """Finished requests of a window: sums for means of per-request values and the per-request tau histogram.

    totals[m] / counts[m] is the mean of SCALAR_METRICS[m] over the finished requests where it is defined
    (a request that never drafted has no acceptance rate and is left out of that mean, not counted as 0).
    """

    k_max: int
    finished_requests: int
    totals: tuple[float, ...]  # [len(SCALAR_METRICS)]
    counts: tuple[int, ...]  # [len(SCALAR_METRICS)]
    tau_hist: tuple[int, ...]  # [len(tau_bucket_bounds(k_max))], non-cumulative

    @classmethod
    def zero(cls, k_max: int) -> PerRequestAggregates:
        num = len(SCALAR_METRICS)
        return cls(k_max, 0, (0.0,) * num, (0,) * num, (0,) * len(tau_bucket_bounds(k_max)))

    def observe(self, counters: SpecCounters) -> PerRequestAggregates:
        """This window plus one finished request with these counters."""
        totals, counts = list(self.totals), list(self.counts)
        for index, metric in enumerate(SCALAR_METRICS):
            value = getattr(counters, metric)
            if value is not None:
                totals[index] += value
                counts[index] += 1
        tau_hist = list(self.tau_hist)
        tau = counters.mean_acceptance_length
        if tau is not None:
            tau_hist[bisect_left(tau_bucket_bounds(self.k_max), tau)] += 1
        return PerRequestAggregates(
            self.k_max, self.finished_requests + 1, tuple(totals), tuple(counts), tuple(tau_hist)
        )

    def __add__(self, other: PerRequestAggregates) -> PerRequestAggregates:
        if not isinstance(other, PerRequestAggregates):
            return NotImplemented
        return PerRequestAggregates(
            self.k_max,
            self.finished_requests + other.finished_requests,
            tuple(x + y for x, y in zip(self.totals, other.totals)),
            add_tuples(self.counts, other.counts),
            add_tuples(self.tau_hist, other.tau_hist),
        )

    def mean(self, metric: str) -> float | None:
        index = SCALAR_METRICS.index(metric)
        return ratio(self.totals[index], self.counts[index])


@dataclass(frozen=True, slots=True)
class RequestSpecStats:
    """Counters of one request, with its derived values; `steps` is set only for requests kept in detail."""

    request_id: str
    counters: SpecCounters
    steps: tuple[StepDetail, ...] | None = None
    finish_reason: str | None = None  # as the engine finished it (stop, length, abort, error); None if not said

    @property
    def drafts(self) -> int:
        return self.counters.drafts

    @property
    def draft_tokens(self) -> int:
        return self.counters.draft_tokens

    @property
    def accepted_tokens(self) -> int:
        return self.counters.accepted_tokens

    @property
    def emitted_tokens(self) -> int:
        return self.counters.emitted_tokens

    @property
    def acceptance_rate(self) -> float | None:
        return self.counters.acceptance_rate

    @property
    def accepted_tokens_per_draft(self) -> float | None:
        return self.counters.accepted_tokens_per_draft

    @property
    def mean_accepted_length(self) -> float | None:
        """Deprecated alias of accepted_tokens_per_draft, kept one release."""
        return self.counters.accepted_tokens_per_draft

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.counters.mean_acceptance_length

    @property
    def emitted_per_draft(self) -> float | None:
        return self.counters.emitted_per_draft

    @property
    def mean_proposed_length(self) -> float | None:
        return self.counters.mean_proposed_length

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request_id": self.request_id, "counters": self.counters.to_dict()}
        out["derived"] = {metric: getattr(self.counters, metric) for metric in SCALAR_METRICS}
        for old, new in DEPRECATED_ALIASES.items():
            out["derived"][old] = out["derived"][new]
        out["derived"]["per_position_acceptance"] = list(self.counters.per_position_acceptance)
        out["derived"]["conditional_acceptance"] = list(self.counters.conditional_acceptance)
        if self.steps is not None:
            out["steps"] = [step._asdict() for step in self.steps]
        return out


@dataclass(frozen=True, slots=True)
class SpecMetricsSnapshot:
    """Counters of a window (cumulative or one interval) with pooled and mean-per-request derived values."""

    counters: SpecCounters
    step_totals: StepTotals
    per_request: PerRequestAggregates
    speedup: SpeedupTotals = field(default_factory=SpeedupTotals)  # the recorder's; a trace recount has none

    @classmethod
    def zero(cls, k_max: int) -> SpecMetricsSnapshot:
        return cls(SpecCounters.zero(k_max), StepTotals(), PerRequestAggregates.zero(k_max), SpeedupTotals())

    def __add__(self, other: SpecMetricsSnapshot) -> SpecMetricsSnapshot:
        if not isinstance(other, SpecMetricsSnapshot):
            return NotImplemented
        return SpecMetricsSnapshot(
            self.counters + other.counters,
            self.step_totals + other.step_totals,
            self.per_request + other.per_request,
            self.speedup + other.speedup,
        )

    @property
    def k_max(self) -> int:
        return self.counters.k_max

    @property
    def acceptance_rate_pooled(self) -> float | None:
        return self.counters.acceptance_rate

    @property
    def acceptance_rate_mean_per_request(self) -> float | None:
        return self.per_request.mean("acceptance_rate")

    @property
    def accepted_tokens_per_draft_pooled(self) -> float | None:
        return self.counters.accepted_tokens_per_draft

    @property
    def accepted_tokens_per_draft_mean_per_request(self) -> float | None:
        return self.per_request.mean("accepted_tokens_per_draft")

    @property
    def mean_acceptance_length_pooled(self) -> float | None:
        return self.counters.mean_acceptance_length

    @property
    def mean_acceptance_length_mean_per_request(self) -> float | None:
        return self.per_request.mean("mean_acceptance_length")

    @property
    def tokens_per_target_forward(self) -> float | None:
        """Tokens emitted per target forward: (E + nonspec_tokens) / steps, every forward of the window counted
        once whatever its batch (prefill-only forwards included: they cost a forward and emit nothing)."""
        return ratio(self.counters.total_emitted_tokens, self.step_totals.steps)

    def derived(self) -> dict[str, Any]:
        """Every derived value, pooled and mean-per-request, JSON-ready (None where undefined)."""
        out: dict[str, Any] = {}
        for metric in SCALAR_METRICS:
            out[f"{metric}_pooled"] = getattr(self.counters, metric)
            out[f"{metric}_mean_per_request"] = self.per_request.mean(metric)
        for old, new in DEPRECATED_ALIASES.items():
            out[f"{old}_pooled"] = out[f"{new}_pooled"]
            out[f"{old}_mean_per_request"] = out[f"{new}_mean_per_request"]
        out["tokens_per_target_forward_pooled"] = self.tokens_per_target_forward
        out["per_position_acceptance_pooled"] = list(self.counters.per_position_acceptance)
        out["conditional_acceptance_pooled"] = list(self.counters.conditional_acceptance)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "counters": {**self.step_totals.to_dict(), **self.counters.to_dict()},
            "derived": self.derived(),
            "per_request": {
                "finished_requests": self.per_request.finished_requests,
                "defined_counts": dict(zip(SCALAR_METRICS, self.per_request.counts)),
                "tau_hist": {
                    "le": list(tau_bucket_bounds(self.k_max)),
                    "counts": list(self.per_request.tau_hist),
                },
            },
            "speedup": self.speedup.to_dict(),
        }
