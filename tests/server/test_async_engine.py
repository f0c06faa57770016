"""The engine thread bridge on its own: idle sleep, all-or-nothing adds, abandoned streams are aborted."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from specd.errors import InvalidParameterError, QueueFullError
from specd.llm import Prompt
from specd.sampling.params import SamplingParams
from specd.server.async_engine import (
    SHUTDOWN_MESSAGE,
    AsyncEngine,
    EngineRequest,
    EngineStoppedError,
    cut_by_shutdown,
)

LONG = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)


def _request(llm, request_id: str, params: SamplingParams = LONG, prompt: str = "abc") -> EngineRequest:
    return EngineRequest(request_id, llm.prompt(prompt), params)


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def engine_and_llm(make_llm):
    llm = make_llm(max_num_seqs=2, max_waiting=2)
    calls = []
    step = llm.step

    def counting_step():
        calls.append(1)
        return step()

    llm.step = counting_step
    engine = AsyncEngine(llm)
    engine.start()
    yield engine, llm, calls
    assert engine.stop(10)


def test_idle_thread_does_not_step(engine_and_llm):
    engine, llm, calls = engine_and_llm

    async def one() -> str:
        stream = await engine.add_requests([_request(llm, "a", SamplingParams(max_tokens=3, temperature=0.0))])
        return "".join([d.new_text async for d in stream])

    asyncio.run(one())
    settled = len(calls)
    time.sleep(0.3)
    assert len(calls) == settled  # sleeping on the condition, not spinning through empty steps


def test_add_is_all_or_nothing_and_errors_propagate(engine_and_llm):
    engine, llm, _ = engine_and_llm

    async def main() -> None:
        # The second choice is invalid: neither is queued, and the error names the field.
        bad = EngineRequest("b-1", Prompt(None, [1, 10**6]), LONG)
        with pytest.raises(InvalidParameterError) as info:
            await engine.add_requests([_request(llm, "b-0"), bad])
        assert info.value.field == "prompt_token_ids"
        running = await engine.add_requests([_request(llm, "r-0"), _request(llm, "r-1")])
        while engine.state.num_running < 2:  # both take a slot at the next step
            await asyncio.sleep(0.01)
        waiting = await engine.add_requests([_request(llm, "w-0"), _request(llm, "w-1")])  # the queue of two
        with pytest.raises(QueueFullError):
            await engine.add_requests([_request(llm, "q-0")])
        assert engine.state.num_waiting == 2
        running.abort()
        waiting.abort()
        reasons = {d.request_id: d.finish_reason async for d in running if d.finished}
        reasons.update({d.request_id: d.finish_reason async for d in waiting if d.finished})
        assert reasons == {"r-0": "abort", "r-1": "abort", "w-0": "abort", "w-1": "abort"}

    asyncio.run(asyncio.wait_for(main(), 60))
    _wait_for(lambda: llm.engine.cache.num_used_slots == 0 and not llm.engine.has_unfinished())


def test_abandoned_stream_is_aborted(engine_and_llm):
    engine, llm, _ = engine_and_llm

    async def main() -> None:
        stream = await engine.add_requests([_request(llm, "lost")])
        async for _ in stream:
            break
        del stream  # the handler is gone without aborting: nobody can read this request any more
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    _wait_for(lambda: llm.engine.cache.num_used_slots == 0 and not llm.engine.has_unfinished())
    assert llm.engine.recorder.live_request_ids == ()


def test_stopped_engine_refuses_requests(make_llm):
    llm = make_llm()
    engine = AsyncEngine(llm)
    engine.start()
    assert engine.stop(10) and not engine.is_running

    async def add() -> None:
        await engine.add_requests([_request(llm, "late")])

    with pytest.raises(EngineStoppedError):
        asyncio.run(add())


def test_full_queue_line_is_first_come_first_served(engine_and_llm):
    """Two slots and a queue of two are full: later batches wait in line (as many requests as the queue
    holds) and are admitted in arrival order; one that finds the line full is refused at once, with a
    Retry-After estimate."""
    engine, llm, _ = engine_and_llm

    async def main() -> None:
        running = await engine.add_requests([_request(llm, "r-0"), _request(llm, "r-1")])
        waiting = await engine.add_requests([_request(llm, "w-0"), _request(llm, "w-1")])
        admitted: list[str] = []

        async def in_line(request_id: str):
            stream = await engine.add_requests([_request(llm, request_id)], wait_s=60)
            admitted.append(request_id)
            return stream

        first = asyncio.ensure_future(in_line("l-0"))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(in_line("l-1"))
        while engine.state.num_in_line < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError) as full:
            await engine.add_requests([_request(llm, "q-0")], wait_s=60)  # the line holds 2 at most
        assert "2 more in line" in str(full.value) and 1 <= full.value.retry_after_s <= 60
        assert not first.done() and not second.done()
        running.abort()  # two slots free up: the queue moves on and the line follows, in order
        streams = await asyncio.gather(first, second)
        assert admitted == ["l-0", "l-1"]
        for stream in (waiting, *streams):
            stream.abort()
            assert [d.finish_reason async for d in stream if d.finished] == ["abort"] * len(stream.request_ids)
        assert engine.state.num_in_line == 0

    asyncio.run(asyncio.wait_for(main(), 60))
    _wait_for(lambda: llm.engine.cache.num_used_slots == 0 and not llm.engine.has_unfinished())


def test_line_entry_that_times_out_never_runs(engine_and_llm):
    engine, llm, _ = engine_and_llm
    # Hold the engine while "gave-up" waits: on a fast machine the tiny model can finish a 150-token
    # request inside 0.2 s, free a slot and admit it (a CI run saw exactly that).
    moving = threading.Event()
    moving.set()
    step = llm.step

    def held_step():
        moving.wait()
        return step()

    llm.step = held_step

    async def main() -> None:
        full = await engine.add_requests([_request(llm, f"f-{i}") for i in range(4)])
        moving.clear()
        with pytest.raises(QueueFullError, match=r"within 0\.2s"):
            await engine.add_requests([_request(llm, "gave-up")], wait_s=0.2)
        moving.set()
        full.abort()
        _ = [d async for d in full]
        later = await engine.add_requests([_request(llm, "later", SamplingParams(max_tokens=2))], wait_s=5)
        assert [d.request_id async for d in later] and llm.engine.num_waiting == 0

    asyncio.run(asyncio.wait_for(main(), 60))
    assert "gave-up" not in llm.engine._seqs  # never added: its line entry was dropped, not admitted


def test_stop_ends_running_requests_with_an_error_and_refuses_the_line(engine_and_llm):
    engine, llm, _ = engine_and_llm

    async def main() -> None:
        running = await engine.add_requests([_request(llm, f"f-{i}") for i in range(4)])
        line = asyncio.ensure_future(engine.add_requests([_request(llm, "l-0")], wait_s=60))
        while engine.state.num_in_line < 1:
            await asyncio.sleep(0.01)
        engine.request_stop()
        finals = [d async for d in running if d.finished]
        assert {d.request_id for d in finals} == {f"f-{i}" for i in range(4)}
        assert all(cut_by_shutdown(d) and d.error == SHUTDOWN_MESSAGE for d in finals)
        with pytest.raises(EngineStoppedError):
            await line

    asyncio.run(asyncio.wait_for(main(), 60))
    _wait_for(lambda: not engine.is_running and llm.engine.cache.num_used_slots == 0)


def test_line_is_admitted_when_the_engine_goes_idle(engine_and_llm):
    """A batch that needs the whole queue waits in line behind running requests; when they end and the engine
    has nothing left to step, the thread must still wake up and admit it."""
    engine, llm, _ = engine_and_llm

    async def main() -> None:
        running = await engine.add_requests([_request(llm, "r-0"), _request(llm, "r-1")])
        while engine.state.num_running < 2:
            await asyncio.sleep(0.01)
        whole = asyncio.ensure_future(engine.add_requests([_request(llm, f"b-{i}") for i in range(4)], wait_s=30))
        while engine.state.num_in_line < 4:
            await asyncio.sleep(0.01)
        running.abort()
        _ = [d async for d in running]
        stream = await asyncio.wait_for(whole, 10)
        stream.abort()
        assert [d.finish_reason async for d in stream if d.finished] == ["abort"] * 4

    asyncio.run(asyncio.wait_for(main(), 60))
