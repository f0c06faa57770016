"""The engine on its own thread, bridged to asyncio.

The engine is single-threaded, so every call into it (add_request, abort, step) happens on one thread
here. HTTP handlers talk to it through a command list guarded by a condition variable: commands are
applied between steps, and the thread sleeps on the condition when it has neither commands nor work
(no busy spin). Deltas go back to each request's asyncio.Queue with one `call_soon_threadsafe` per
step and event loop. A batch that finds the waiting queue full may wait in an AdmissionLine for room.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from specd.engine.outputs import RequestDelta
from specd.errors import QueueFullError, SpecdError
from specd.llm import LLM, EngineState, Prompt
from specd.sampling.params import SamplingParams
from specd.server.admission import AdmissionLine, FinishRate, retry_after_s
from specd.server.metrics import RequestMetrics

logger = logging.getLogger("specd.server")

SHUTDOWN_MESSAGE = "the server is shutting down; the request was cut at the end of the shutdown grace period"


def cut_by_shutdown(delta: RequestDelta) -> bool:
    """A final delta of a request still running when the engine stopped (finish_reason "abort" + error)."""
    return delta.error is not None and delta.finish_reason == "abort"


class EngineStoppedError(SpecdError):
    """The engine thread has stopped (shutdown or crash); no request can be added."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One engine request (one choice of an HTTP request); the prompt was validated by LLM.prompt/chat_prompt."""

    request_id: str
    prompt: Prompt
    params: SamplingParams


@dataclass(slots=True)
class _Route:
    """Where one request's deltas go. The queue is held weakly: once its handler is gone, nobody can
    read it, and the request is aborted instead of generating into the void."""

    loop: asyncio.AbstractEventLoop
    queue_ref: weakref.ref[asyncio.Queue[RequestDelta]]
    num_prompt_tokens: int
    num_output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class _AddBatch:
    """may_wait: join the admission line when there is no room (else fail at once with QueueFullError)."""

    requests: list[EngineRequest]
    loop: asyncio.AbstractEventLoop
    queue_ref: weakref.ref[asyncio.Queue[RequestDelta]]
    future: concurrent.futures.Future[None]
    may_wait: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.requests)


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class DeltaStream:
    """The deltas of one HTTP request's engine requests (its choices), in the order the engine made them."""

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str], queue: asyncio.Queue[RequestDelta]) -> None:
        self._engine = engine
        self._queue = queue
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        while self._unfinished:
            delta = await self._queue.get()
            if delta.finished:
                self._unfinished.discard(delta.request_id)
            yield delta

    def abort(self) -> None:
        """Abort every choice that has not finished (idempotent); their final deltas still arrive."""
        for request_id in self._unfinished:
            self._engine.abort(request_id)


class AsyncEngine:
    """Runs `llm` on a dedicated thread; `add_requests` / `abort` may be called from any event loop."""

    def __init__(self, llm: LLM, metrics: RequestMetrics | None = None) -> None:
        self._llm = llm
        self._metrics = metrics
        self._cond = threading.Condition()
        self._commands: list[_AddBatch | _Abort] = []
        self._stopping = False
        self._routes: dict[str, _Route] = {}  # engine thread only
        self.capacity = llm.queue_capacity()  # most engine requests queued at once; None: unbounded
        # The line holds as many engine requests as the waiting queue itself (engine thread only).
        self._line: AdmissionLine[_AddBatch] = AdmissionLine(llm.config.max_waiting)
        self._finish_rate = FinishRate()  # engine thread only
        self.finish_rate: float | None = None  # published after each step
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        # What the engine thread published after its latest step (read by /health, /v1/spec/stats).
        self.state: EngineState = llm.engine_state()

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def request_stop(self) -> None:
        """Start stopping without waiting: requests still running end with an error delta (SHUTDOWN_MESSAGE,
        finish_reason "abort"), batches in line fail with EngineStoppedError, then the thread ends."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """request_stop(), then wait for the thread to end. True if it ended in time."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def retry_after_s(self, num_requests: int) -> int:
        """Seconds until a batch of `num_requests` could find room, from the published queue state and the
        recent finish rate (any thread)."""
        if self.capacity is None:
            return 1
        state = self.state
        queued = state.num_running + state.num_waiting + state.num_in_line
        return retry_after_s(queued + num_requests - self.capacity, self.finish_rate)

    async def add_requests(self, requests: Sequence[EngineRequest], wait_s: float = 0.0) -> DeltaStream:
        """Add all of `requests` or none of them. With wait_s > 0, a batch that finds no room waits in line
        (first come, first served) up to wait_s seconds for it. Raises what LLM.add_request raises
        (InvalidParameterError, PromptTooLongError), QueueFullError (no room, line full or wait_s passed;
        with a Retry-After estimate), or EngineStoppedError."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_AddBatch(list(requests), loop, weakref.ref(queue), future, may_wait=wait_s > 0))
        try:
            # On timeout the line entry is cancelled (dropped when it reaches the head).
            await asyncio.wait_for(asyncio.wrap_future(future), wait_s if wait_s > 0 else None)
        except asyncio.TimeoutError:
            for request in requests:  # admitted in the same instant: undo it
                self.abort(request.request_id)
            raise QueueFullError(
                f"no room in the waiting queue within {wait_s:g}s", self.retry_after_s(len(requests))
            ) from None
        except asyncio.CancelledError:
            # The handler went away while the add was in flight; if it landed, undo it.
            for request in requests:
                self.abort(request.request_id)
            raise
        return DeltaStream(self, [r.request_id for r in requests], queue)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (unknown or finished ids are ignored)."""
        try:
            self._submit(_Abort(request_id))
        except EngineStoppedError:
            pass  # stopping aborts everything anyway

    def _submit(self, command: _AddBatch | _Abort) -> None:
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineStoppedError("the engine is not running")
            self._commands.append(command)
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        llm = self._llm
        try:
            while True:
                with self._cond:
                    # A batch in line always fits an idle engine (larger ones never join), so an idle engine
                    # with a line goes on to admit it rather than sleep.
                    while not (self._commands or self._stopping or self._line or llm.has_unfinished()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command in commands:
                    if isinstance(command, _AddBatch):
                        self._on_add(command, stopping)
                    else:
                        self._llm.abort(command.request_id)
                if stopping:
                    for batch in self._line.drain():
                        if batch.future.set_running_or_notify_cancel():
                            batch.future.set_exception(EngineStoppedError("the server is shutting down"))
                    if self._routes:
                        self._fail_routes(SHUTDOWN_MESSAGE, finish_reason="abort")
                else:
                    self._line.admit(self._fits, self._apply_add)
                if llm.has_unfinished():
                    self._step()
                self._publish_state()
                if stopping and not llm.has_unfinished():
                    return
        except BaseException:
            logger.exception("the engine thread crashed")
            with self._cond:
                self._stopping = True
                orphans, self._commands = self._commands, []
            for command in [*orphans, *self._line.drain()]:
                if isinstance(command, _AddBatch) and command.future.set_running_or_notify_cancel():
                    command.future.set_exception(EngineStoppedError("the engine thread crashed"))
            self._fail_routes("the engine thread crashed")

    def _fits(self, num_requests: int) -> bool:
        room = self._llm.queue_room()
        return room is None or num_requests <= room

    def _on_add(self, command: _AddBatch, stopping: bool) -> None:
        """Add a new batch now if it fits and nobody is in line before it; else line it up or refuse it."""
        if stopping:
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineStoppedError("the server is shutting down"))
            return
        never_fits = self.capacity is not None and command.num_requests > self.capacity
        if not self._line and self._fits(command.num_requests):
            self._apply_add(command)
        elif command.may_wait and not never_fits and self._line.can_join(command.num_requests):
            self._line.join(command)
        elif command.future.set_running_or_notify_cancel():
            in_line = f", {self._line.num_requests} more in line for room" if self._line else ""
            self._publish_state()  # the estimate reads the published state
            command.future.set_exception(QueueFullError(
                f"waiting queue is full ({self._llm.config.max_waiting} requests{in_line})",
                self.retry_after_s(command.num_requests),
            ))

    def _apply_add(self, command: _AddBatch) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the handler was cancelled (or timed out) before the engine took the batch
        added: list[str] = []
        try:
            for request in command.requests:
                self._llm.add_request(request.prompt, request.params, request_id=request.request_id)
                added.append(request.request_id)
                self._routes[request.request_id] = _Route(
                    command.loop, command.queue_ref, len(request.prompt.token_ids)
                )
        except Exception as exc:
            for request_id in added:  # all or nothing: roll back the choices already queued
                del self._routes[request_id]
                self._llm.abort(request_id)
            command.future.set_exception(exc)
        else:
            if self._metrics is not None:
                self._metrics.observe_admitted(len(command.requests))
            command.future.set_result(None)

    def _step(self) -> None:
        try:
            deltas = self._llm.step()
        except Exception as exc:
            # LLMEngine fails a bad batch itself; this is the last resort for a bug outside it.
            logger.exception("engine step failed; failing every request in flight")
            self._fail_routes(f"{type(exc).__name__}: {exc}")
            return
        self._dispatch(deltas)

    def _fail_routes(self, message: str, finish_reason: str = "error") -> None:
        deltas = []
        for request_id, route in self._routes.items():
            try:
                self._llm.abort(request_id)  # free its KV slot; its abort delta has no route and is dropped
            except Exception:
                logger.exception("abort of %s failed", request_id)
            deltas.append(RequestDelta(
                request_id, [], "", None, True, finish_reason, route.num_prompt_tokens, route.num_output_tokens,
                error=message,
            ))
        self._dispatch(deltas)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestDelta], RequestDelta]]] = {}
        for delta in deltas:
            route = self._routes.get(delta.request_id)
            if route is None:
                continue  # rolled back or already failed
            route.num_output_tokens = delta.num_output_tokens
            if delta.finished:
                del self._routes[delta.request_id]
                self._finish_rate.record(time.monotonic())
                if self._metrics is not None:
                    self._metrics.observe_finished(delta)
            queue = route.queue_ref()
            if queue is None:
                if not delta.finished:
                    self._llm.abort(delta.request_id)
                continue
            batches.setdefault(route.loop, []).append((queue, delta))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its requests have no reader
                for _, delta in items:
                    if not delta.finished:
                        self._llm.abort(delta.request_id)

    def _publish_state(self) -> None:
        state = self._llm.engine_state()._replace(num_in_line=self._line.num_requests)
        self.state = state  # one reference assignment: readers on other threads see old or new, never half
        self.finish_rate = self._finish_rate.per_second(time.monotonic())
        if self._metrics is not None:
            self._metrics.set_engine_state(state.num_running, state.num_waiting, state.kv_used_slots,
                                           state.num_in_line, state.num_threads, state.free_cpus)


def _deliver(items: list[tuple[asyncio.Queue[RequestDelta], RequestDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)
