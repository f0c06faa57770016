"""The periodic one-line log of speculation metrics (`specd.testing.parse_log_line` reads it back).

Counters are printed as integers and parse back exactly; derived values are printed with 4 decimals,
undefined ones (denominator 0) as `n/a`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from specd.metrics.records import K0_CAUSES
from specd.metrics.snapshots import SpecMetricsSnapshot
from specd.metrics.stats import SpecStatsRecorder

PREFIX = "specd spec-decode metrics: "
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
        f"proposed={counters.proposed_tokens}",
        f"cut_policy={counters.cut_policy_tokens}",
        f"cut_grammar={counters.cut_grammar_tokens}",
        f"rejected={counters.rejected_tokens}",
        f"past_stop={counters.past_stop_tokens}",
        f"draft_forwards={totals.draft_forwards}",
        f"draft_tokens_computed={totals.draft_tokens_computed}",
        *(f"k0_{cause}={count}" for cause, count in zip(K0_CAUSES, counters.nonspec_by_cause)),
        f"acceptance_rate={_fmt(counters.acceptance_rate)}",
        f"accepted_tokens_per_draft={_fmt(counters.accepted_tokens_per_draft)}",
        f"mean_accepted_len={_fmt(counters.accepted_tokens_per_draft)}",  # deprecated alias, kept one release
        f"tau={_fmt(counters.mean_acceptance_length)}",
        f"emitted_per_draft={_fmt(counters.emitted_per_draft)}",
        f"mean_proposed_len={_fmt(counters.mean_proposed_length)}",
        f"tokens_per_forward={_fmt(snapshot.tokens_per_target_forward)}",
        f"tokens_per_seq_step={_fmt(counters.tokens_per_seq_step)}",
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
        f"prefill_steps={totals.prefill_steps}",
        f"prefill_only_steps={totals.prefill_only_steps}",
        f"prefill_tokens={totals.prefill_tokens}",
        f"prefill_s={totals.prefill_s:.6f}",
        f"speedup={_fmt(snapshot.speedup.speedup_estimate)}",
        f"decode_s={snapshot.speedup.decode_s:.6f}",
        f"plain_decode_s={snapshot.speedup.plain_decode_s:.6f}",
        f"unestimated_decode_steps={snapshot.speedup.unestimated_decode_steps}",
        f"modelled_decode_steps={snapshot.speedup.modelled_decode_steps}",
    ]
    if interval_s is not None:
        fields.append(f"interval_s={interval_s:.3f}")
    return PREFIX + " ".join(fields)


class PeriodicLogger:
    """Logs the recorder's interval line on its own clock, every interval_s seconds, busy or idle.

    Intervals are cut at start + n * interval_s on `clock`, so each line covers exactly the seconds since the
    previous line (`interval_s=` on the line), not "since the step before". An interval with no step and no
    finished request is still logged: the first one after activity at INFO (so the last busy interval is
    always followed by a line saying the engine went idle), further idle ones at DEBUG. It owns the
    recorder's take_interval(). `start()` runs `tick()` on a daemon thread; without it, call `tick()`
    yourself (tests drive it with a fake clock). `close()` stops the thread and logs the partial last
    interval if anything happened in it.
    """

    def __init__(
        self,
        recorder: SpecStatsRecorder,
        interval_s: float,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < interval_s < math.inf:
            raise ValueError(f"interval_s: must be a finite number of seconds > 0, got {interval_s!r}")
        self._recorder = recorder
        self._interval_s = interval_s
        self._logger = logger
        self._clock = clock
        self._lock = threading.Lock()  # tick() from the timer thread and close() from the caller's
        self._start_s = self._last_s = clock()
        self._next_index = 1  # the next boundary is start + next_index * interval_s
        self._last_was_empty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def seconds_to_next(self) -> float:
        """Seconds from now (on the clock) to the next interval boundary; 0 if it has passed."""
        return max(0.0, self._start_s + self._next_index * self._interval_s - self._clock())

    def tick(self) -> str | None:
        """If an interval boundary has passed, take the interval (up to now) and log it. Returns the line.

        Boundaries missed while the caller was late are skipped, not logged one by one: their steps are in
        the one line, whose interval_s says how long it covers.
        """
        with self._lock:
            now = self._clock()
            if now < self._start_s + self._next_index * self._interval_s:
                return None
            self._next_index = int((now - self._start_s) // self._interval_s) + 1
            return self._log_interval(now)

    def close(self) -> str | None:
        """Stop the timer thread; log the partial interval since the last line if it recorded anything."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            now = self._clock()
            if now <= self._last_s:
                return None
            return self._log_interval(now, skip_empty=True)

    def _log_interval(self, now: float, skip_empty: bool = False) -> str | None:
        snapshot = self._recorder.take_interval()
        elapsed, self._last_s = now - self._last_s, now
        empty = snapshot.step_totals.steps == 0 and snapshot.per_request.finished_requests == 0
        if empty and skip_empty:
            return None
        line = format_log_line(snapshot, interval_s=elapsed)
        level = logging.DEBUG if empty and self._last_was_empty else logging.INFO
        self._last_was_empty = empty
        self._logger.log(level, "%s", line)
        return line

    def start(self) -> None:
        """Run tick() at every boundary on a daemon thread (it ends when close() is called or this is collected)."""
        if self._thread is not None:
            raise RuntimeError("PeriodicLogger: already started")
        self._thread = threading.Thread(
            target=_run_timer, args=(weakref.ref(self), self._stop), name="specd-stats-log", daemon=True
        )
        weakref.finalize(self, self._stop.set)
        self._thread.start()


def _run_timer(ref: weakref.ref[PeriodicLogger], stop: threading.Event) -> None:
    """The timer thread: holds the logger only weakly, so an unclosed LLM can still be collected."""
    while True:
        periodic = ref()
        if periodic is None:
            return
        wait_s = periodic.seconds_to_next()
        del periodic
        if stop.wait(wait_s):
            return
        periodic = ref()
        if periodic is None:
            return
        periodic.tick()
        del periodic
