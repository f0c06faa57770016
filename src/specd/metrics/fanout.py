"""The sink protocol and the fan-out that hands each step to every sink, isolating sinks from requests.

A sink is an exporter (log line, Prometheus, trace file): if one raises (a full disk, a bug), the step it
was handed is already counted by the recorder and the other sinks still get it; the error is counted and
logged once per sink, and never reaches the engine step that recorded it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from specd.metrics.records import StepRecord
from specd.metrics.snapshots import RequestSpecStats

if TYPE_CHECKING:
    from specd.metrics.stats import SpecStatsRecorder

logger = logging.getLogger("specd.metrics")


class StatsSink(Protocol):
    """Writes what the recorder computed (log, Prometheus, trace file). Changes only its own state.

    A sink that raises is isolated by the recorder: the error is logged once per sink, counted in
    `SpecStatsRecorder.sink_errors`, and never reaches the engine step or the other sinks.
    """

    def bind(self, recorder: SpecStatsRecorder) -> None:
        """Called once, when the recorder is created: the sink takes k_max (and anything else it reads,
        such as `sink_errors`) from the recorder, so every sink sizes its arrays the same way."""
        ...

    def on_step(self, record: StepRecord) -> None:
        """Called once per recorded step, after the recorder's counters include it."""
        ...

    def on_request_finished(self, request_id: str, stats: RequestSpecStats) -> None:
        """Called once when the engine finishes (or aborts) a request, with its final counters."""
        ...


class SinkFanout:
    """Calls every sink in order; an exception from one skips only that call and is counted in `errors`."""

    def __init__(self, sinks: Sequence[StatsSink]) -> None:
        self._sinks = tuple(sinks)
        self._lock = threading.Lock()
        self._failed: set[int] = set()  # id() of sinks whose first error was logged
        self.errors = 0

    def on_step(self, record: StepRecord) -> None:
        for sink in self._sinks:
            try:
                sink.on_step(record)
            except Exception:
                self._failed_call(sink, "on_step")

    def on_request_finished(self, request_id: str, stats: RequestSpecStats) -> None:
        for sink in self._sinks:
            try:
                sink.on_request_finished(request_id, stats)
            except Exception:
                self._failed_call(sink, "on_request_finished")

    def _failed_call(self, sink: StatsSink, call: str) -> None:
        """Count the exception being handled; log the sink's first one with its traceback, later ones at debug."""
        with self._lock:
            self.errors += 1
            first = id(sink) not in self._failed
            self._failed.add(id(sink))
        name = type(sink).__name__
        if first:
            logger.exception("stats sink %s failed in %s; requests are unaffected, further errors are only counted "
                             "(specd_stats_sink_errors_total)", name, call)
        else:
            logger.debug("stats sink %s failed again in %s", name, call, exc_info=True)
