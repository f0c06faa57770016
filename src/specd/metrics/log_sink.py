"""The periodic one-line log of speculation metrics (`specd.testing.parse_log_line` reads it back).

Counters are printed as integers and parse back exactly; derived values are printed with 4 decimals,
undefined ones (denominator 0) as `n/a`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from specd.metrics.snapshots import SpecMetricsSnapshot
from specd.metrics.stats import SpecStatsRecorder

PREFIX = "SpecDecoding metrics: "
NOT_AVAILABLE = "n/a"


def _fmt(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.4f}"


def _fmt_list(values: Sequence[float | None] | Sequence[int]) -> str:
    return "[" + ",".join(str(v) if isinstance(v, int) else _fmt(v) for v in values) + "]"


def format_log_line(snapshot: SpecMetricsSnapshot, interval_s: float | None = None) -> str:
    """One line describing a window (normally one interval): counters, pooled derived values, per position."""
    counters, totals = snapshot.counters, snapshot.step_totals
    fields = [
        f"steps={totals.steps}",
        f"spec_steps={totals.spec_steps}",
        f"drafts={counters.drafts}",
        f"draft_tokens={counters.draft_tokens}",
        f"accepted={counters.accepted_tokens}",
        f"emitted={counters.emitted_tokens}",
        f"nonspec_seq_steps={counters.nonspec_seq_steps}",
        f"nonspec_tokens={counters.nonspec_tokens}",
        f"acceptance_rate={_fmt(counters.acceptance_rate)}",
        f"mean_accepted_len={_fmt(counters.mean_accepted_length)}",
        f"tau={_fmt(counters.mean_acceptance_length)}",
        f"emitted_per_draft={_fmt(counters.emitted_per_draft)}",
        f"mean_proposed_len={_fmt(counters.mean_proposed_length)}",
        f"tokens_per_forward={_fmt(counters.tokens_per_target_forward)}",
        f"finished_requests={snapshot.per_request.finished_requests}",
        f"tau_mean_per_request={_fmt(snapshot.mean_acceptance_length_mean_per_request)}",
        f"per_position_acceptance={_fmt_list(counters.per_position_acceptance)}",
        f"conditional={_fmt_list(counters.conditional_acceptance)}",
        f"drafted_at={_fmt_list(counters.drafted_at)}",
        f"reached_at={_fmt_list(counters.reached_at)}",
        f"accepted_at={_fmt_list(counters.accepted_at)}",
        f"accepted_len_hist={_fmt_list(counters.accepted_length_hist)}",
        f"propose_s={totals.propose_s:.6f}",
        f"verify_s={totals.verify_s:.6f}",
        f"sample_s={totals.sample_s:.6f}",
    ]
    if interval_s is not None:
        fields.append(f"interval_s={interval_s:.3f}")
    return PREFIX + " ".join(fields)


class PeriodicLogger:
    """Logs the recorder's interval line every interval_s seconds; the engine calls maybe_log(now) per step.

    It owns the recorder's take_interval(). An interval in which no step happened is not logged.
    """

    def __init__(
        self,
        recorder: SpecStatsRecorder,
        interval_s: float,
        logger: logging.Logger,
        start_s: float | None = None,
    ) -> None:
        if not 0.0 < interval_s < math.inf:
            raise ValueError(f"interval_s: must be a finite number of seconds > 0, got {interval_s!r}")
        self._recorder = recorder
        self._interval_s = interval_s
        self._logger = logger
        self._last_s = start_s

    def maybe_log(self, now: float) -> str | None:
        """If interval_s has elapsed since the last log (or start), take the interval and log it.

        `now` is any monotonic clock in seconds. Returns the line logged, or None. The first call
        without a start_s only starts the clock.
        """
        if self._last_s is None:
            self._last_s = now
            return None
        elapsed = now - self._last_s
        if elapsed < self._interval_s:
            return None
        self._last_s = now
        snapshot = self._recorder.take_interval()
        if snapshot.step_totals.steps == 0:
            return None
        line = format_log_line(snapshot, interval_s=elapsed)
        self._logger.info("%s", line)
        return line
