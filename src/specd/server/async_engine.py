"""The engine on its own thread, bridged to asyncio.

The engine is single-threaded, so every call into it (add_request, abort, step) happens on one thread
here. HTTP handlers talk to it through a command list guarded by a condition variable: commands are
applied between steps, and the thread sleeps on the condition when it has neither commands nor work
(no busy spin). Deltas go back to each request's asyncio.Queue with one `call_soon_threadsafe` per
step and event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from specd.engine.outputs import RequestDelta
from specd.errors import QueueFullError, SpecdError
from specd.llm import LLM, EngineState, Prompt
from specd.sampling.params import SamplingParams
from specd.server.metrics import RequestMetrics

logger = logging.getLogger("specd.server")


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
    requests: list[EngineRequest]
    loop: asyncio.AbstractEventLoop
    queue_ref: weakref.ref[asyncio.Queue[RequestDelta]]
    future: concurrent.futures.Future[None]


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
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        # What the engine thread published after its latest step (read by /health, /v1/spec/stats).
        self.state: EngineState = llm.engine_state()

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Abort every request, let their final deltas out, end the thread. True if it ended in time."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    async def add_requests(self, requests: Sequence[EngineRequest]) -> DeltaStream:
        """Add all of `requests` or none of them. Raises what LLM.add_request raises (InvalidParameterError,
        PromptTooLongError), QueueFullError when the batch does not fit the waiting queue, or
        EngineStoppedError."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_AddBatch(list(requests), loop, weakref.ref(queue), future))
        try:
            await asyncio.wrap_future(future)
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
                    while not self._commands and not self._stopping and not llm.has_unfinished():
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command in commands:
                    if isinstance(command, _AddBatch):
                        self._apply_add(command, stopping)
                    else:
                        self._llm.abort(command.request_id)
                if stopping:
                    for request_id in list(self._routes):
                        self._llm.abort(request_id)
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
            for command in orphans:
                if isinstance(command, _AddBatch) and command.future.set_running_or_notify_cancel():
                    command.future.set_exception(EngineStoppedError("the engine thread crashed"))
            self._fail_routes("the engine thread crashed")

    def _apply_add(self, command: _AddBatch, stopping: bool) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the handler was cancelled before the engine saw the request
        if stopping:
            command.future.set_exception(EngineStoppedError("the server is shutting down"))
            return
        room = self._llm.queue_room()
        if room is not None and len(command.requests) > room:
            max_waiting = self._llm.config.max_waiting
            command.future.set_exception(QueueFullError(f"waiting queue is full ({max_waiting} requests)"))
            return
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

    def _fail_routes(self, message: str) -> None:
        deltas = []
        for request_id, route in self._routes.items():
            try:
                self._llm.abort(request_id)  # free its KV slot; its abort delta has no route and is dropped
            except Exception:
                logger.exception("abort of %s failed", request_id)
            deltas.append(RequestDelta(
                request_id, [], "", None, True, "error", route.num_prompt_tokens, route.num_output_tokens,
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
        state = self._llm.engine_state()
        self.state = state  # one reference assignment: readers on other threads see old or new, never half
        if self._metrics is not None:
            self._metrics.set_engine_state(state.num_running, state.num_waiting, state.kv_used_slots)


def _deliver(items: list[tuple[asyncio.Queue[RequestDelta], RequestDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)
