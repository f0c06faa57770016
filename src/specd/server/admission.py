"""Who gets into the engine's waiting queue when it is full: a line in front of it, first come first served,
and, for requests refused anyway, a Retry-After estimated from the queue and the rate requests finish at.

With only "503, retry in 1 s", clients race for each freed slot and the unlucky one loses every race (one of
16 clients needed 31 attempts). Waiting in line keeps arrival order; the estimate spreads retries out. A batch
refused even so (the line full, or its wait over) is told when to come back, and the room it was told to wait
for is held for it (`Reservations`): until then, or until it returns, newcomers cannot take it, so a client that
honours Retry-After keeps its place instead of losing to whoever arrives the moment a slot frees.
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

    def can_join(self, num_requests: int, reserved: int = 0) -> bool:
        """Whether a batch may join, with `reserved` requests of room promised to batches before it."""
        if not self._entries and not reserved:
            return True
        return self.num_requests + reserved + num_requests <= self.limit

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


RESERVATION_GRACE_S = 5.0  # how long past its Retry-After a refused batch's room is held


class Reservations:
    """Room held for refused batches, by key (a hash of the client's credentials and body: a retry sends the same
    bytes), oldest first; each expires RESERVATION_GRACE_S after the Retry-After it was given, so a client that
    never comes back holds nothing for long. At most `limit` requests are held in all (engine thread only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, tuple[int, float]] = {}  # key -> (num_requests, expires at), in order of refusal

    def hold(self, key: str, num_requests: int, retry_after_s: float, now: float) -> bool:
        """Hold room for a refused batch (or renew its hold, keeping its place); False if the holds are full."""
        self.expire(now)
        if key not in self._held and self.num_held() + num_requests > self.limit:
            return False
        self._held[key] = (num_requests, now + retry_after_s + RESERVATION_GRACE_S)  # a renewal keeps its place
        return True

    def before(self, key: str | None, now: float) -> int:
        """Requests held for batches refused before `key`'s (all of them for a key that holds nothing)."""
        self.expire(now)
        total = 0
        for held_key, (num_requests, _) in self._held.items():
            if held_key == key:
                return total
            total += num_requests
        return total

    def release(self, key: str | None) -> None:
        if key is not None:
            self._held.pop(key, None)

    def num_held(self) -> int:
        return sum(n for n, _ in self._held.values())

    def expire(self, now: float) -> None:
        for key in [k for k, (_, expires) in self._held.items() if expires <= now]:
            del self._held[key]


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
