"""Who gets into the engine's waiting queue when it is full: a line in front of it, first come first served,
and, for requests refused anyway, a Retry-After estimated from the queue and the rate requests finish at.

With only "503, retry in 1 s", clients race for each freed slot and the unlucky one loses every race (one of
16 clients needed 31 attempts). Waiting in line keeps arrival order; the estimate spreads retries out.
Everything here runs on the engine thread, except `retry_after_s`, which reads published numbers.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

RETRY_AFTER_MAX_S = 60  # the OpenAI client honours Retry-After up to 60 s
RETRY_AFTER_UNKNOWN_RATE_S = 10  # nothing finished in the last window: requests are long; do not hammer


class Waiting(Protocol):
    """A batch in line: all of its requests enter the queue together, or it keeps waiting."""

    @property
    def num_requests(self) -> int: ...

    @property
    def future(self) -> concurrent.futures.Future[None]: ...


_W = TypeVar("_W", bound=Waiting)


class AdmissionLine(Generic[_W]):
    """Batches waiting for room, in arrival order; at most `limit` requests in all, except that an empty line
    takes one batch of any size (a large `n` must be able to wait too). A batch whose future was cancelled
    (its client timed out or left) is dropped when it reaches the head."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: deque[_W] = deque()
        self.num_requests = 0

    def __bool__(self) -> bool:
        return bool(self._entries)

    def can_join(self, num_requests: int) -> bool:
        return not self._entries or self.num_requests + num_requests <= self.limit

    def join(self, entry: _W) -> None:
        self._entries.append(entry)
        self.num_requests += entry.num_requests

    def admit(self, fits: Callable[[int], bool], admit: Callable[[_W], None]) -> None:
        """Hand `admit` every head batch that `fits`, in order; stop at the first that does not (it keeps its
        place: a large batch is not overtaken by small ones behind it)."""
        while self._entries:
            head = self._entries[0]
            if not head.future.cancelled() and not fits(head.num_requests):
                return
            self._pop()
            if not head.future.cancelled():
                admit(head)

    def drain(self) -> list[_W]:
        """Remove and return every batch (shutdown)."""
        entries = list(self._entries)
        while self._entries:
            self._pop()
        return entries

    def _pop(self) -> None:
        self.num_requests -= self._entries.popleft().num_requests


class FinishRate:
    """Engine requests finished per second over the last `window_s` seconds (engine thread only)."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 4096) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque(maxlen=max_samples)

    def record(self, now: float) -> None:
        self._times.append(now)

    def per_second(self, now: float) -> float | None:
        """None when nothing finished within the window."""
        while self._times and self._times[0] < now - self._window_s:
            self._times.popleft()
        if not self._times:
            return None
        return len(self._times) / max(now - self._times[0], 1.0)


def retry_after_s(num_finishes_needed: int, finish_rate: float | None) -> int:
    """Seconds until `num_finishes_needed` more requests have finished at `finish_rate` per second, rounded up
    and kept within [1, RETRY_AFTER_MAX_S]."""
    if finish_rate is None or finish_rate <= 0:
        return RETRY_AFTER_UNKNOWN_RATE_S
    return min(RETRY_AFTER_MAX_S, max(1, math.ceil(max(1, num_finishes_needed) / finish_rate)))
