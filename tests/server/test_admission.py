"""The admission line and the Retry-After estimate on their own (no engine, no HTTP)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from specd.server.admission import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_UNKNOWN_RATE_S,
    AdmissionLine,
    FinishRate,
    retry_after_s,
)


@dataclass
class _Batch:
    name: str
    num_requests: int
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


def test_line_admits_in_order_and_a_big_head_is_not_overtaken():
    line: AdmissionLine[_Batch] = AdmissionLine(limit=5)
    assert line.can_join(9)  # an empty line takes one batch of any size
    batches = [_Batch("a", 1), _Batch("big", 3), _Batch("c", 1)]
    for batch in batches:
        assert line.can_join(batch.num_requests)
        line.join(batch)
    assert line.num_requests == 5 and not line.can_join(1)
    admitted: list[str] = []
    room = [2]

    def fits(num_requests: int) -> bool:
        return num_requests <= room[0]

    def admit(batch: _Batch) -> None:
        admitted.append(batch.name)
        room[0] -= batch.num_requests

    line.admit(fits, admit)
    # "big" needs 3 but only 1 is left: it keeps its place and "c" (which would fit) waits behind it.
    assert admitted == ["a"] and line.num_requests == 4
    room[0] = 4
    line.admit(fits, admit)
    assert admitted == ["a", "big", "c"] and not line and line.num_requests == 0


def test_cancelled_batches_leave_the_line_without_being_admitted():
    line: AdmissionLine[_Batch] = AdmissionLine(limit=4)
    gave_up, patient = _Batch("gave-up", 2), _Batch("patient", 1)
    line.join(gave_up)
    line.join(patient)
    assert gave_up.future.cancel()  # what a handler's timeout does to a batch still in line
    admitted: list[str] = []
    line.admit(lambda n: n <= 1, lambda batch: admitted.append(batch.name))
    # The cancelled head is dropped even though it would not have fitted; the next one is admitted.
    assert admitted == ["patient"] and line.num_requests == 0
    line.join(_Batch("x", 1))
    assert [b.name for b in line.drain()] == ["x"] and line.num_requests == 0


def test_finish_rate_counts_the_recent_window_only():
    rate = FinishRate(window_s=10.0)
    assert rate.per_second(100.0) is None
    for t in (100.0, 101.0, 102.0, 103.0, 104.0):
        rate.record(t)
    assert rate.per_second(105.0) == 5 / 5.0
    # Ten seconds later the first three have left the window.
    assert rate.per_second(112.5) == 2 / (112.5 - 103.0)
    assert rate.per_second(1000.0) is None
    rate.record(2000.0)
    assert rate.per_second(2000.0) == 1.0  # spans shorter than a second count as one second


def test_retry_after_is_the_time_for_enough_finishes():
    assert retry_after_s(10, 2.0) == 5
    assert retry_after_s(3, 2.0) == 2  # rounded up
    assert retry_after_s(0, 2.0) == 1 and retry_after_s(-4, 50.0) == 1  # at least one finish, at least 1 s
    assert retry_after_s(10_000, 0.5) == RETRY_AFTER_MAX_S
    assert retry_after_s(3, None) == RETRY_AFTER_UNKNOWN_RATE_S == retry_after_s(3, 0.0)
