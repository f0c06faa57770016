"""A progress bar with an ETA for each phase of `specd train-draft` (stderr; one line per update when not a tty)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counts `done` out of `total` units of one phase and redraws at most every `interval_s` seconds.

    On a terminal the line is redrawn in place; in a log file (nohup) a line is appended every `log_interval_s`.
    """

    def __init__(self, phase: str, total: int, unit: str, stream: TextIO | None = None,
                 interval_s: float = 0.5, log_interval_s: float = 30.0) -> None:
        self.phase = phase
        self.total = max(1, total)
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s if self.tty else log_interval_s
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = float("-inf")
        self._drawn = -1  # `done` at the last draw
        self.note = ""

    def advance(self, units: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + units)
        if note:
            self.note = note
        now = time.monotonic()
        if now - self._last_draw >= self.interval_s or self.done == self.total:
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        eta_text = _clock(eta) if eta == eta else "?"
        text = (f"{self.phase:<9} [{bar}] {self.done}/{self.total} {self.unit} "
                f"elapsed {_clock(elapsed)} eta {eta_text}")
        return f"{text} {self.note}".rstrip()

    def _draw(self, now: float) -> None:
        self._last_draw, self._drawn = now, self.done
        if self.tty:
            self.stream.write("\r" + self.line(now) + "\033[K")
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def finish(self) -> float:
        """Draw the final state, end the line; returns the phase's wall time in seconds."""
        now = time.monotonic()
        if self._drawn != self.done:
            self._draw(now)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
        return now - self.start
