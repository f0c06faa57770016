"""uvicorn set up for specd: a header timeout for slow clients, a shutdown that ends streams properly, and
a normal exit on SIGINT/SIGTERM.

uvicorn itself waits for a slow client's request headers forever, cancels request tasks mid-write when its
graceful-shutdown timeout passes (streams stop with no final event, and each task logs a traceback), and
re-raises the signal it caught after shutting down, so `kill PID` ends the process with -15 instead of 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from specd.server.async_engine import AsyncEngine
from specd.server.settings import ServerSettings

logger = logging.getLogger("specd.server")

# uvicorn's own deadline stays behind ours, as a backstop: requests are cut by the engine at the grace period,
# so their handlers finish by themselves and uvicorn never has to cancel a task.
_UVICORN_BACKSTOP_S = 5.0


class _H11WithHeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not complete
    `header_timeout_s` after the connection opened or the previous response ended (uvicorn's keep-alive
    timeout is reset by every byte, so a client dribbling a header never hits it)."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline, self.cycle)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self, cycle_when_armed: object) -> None:
        self._header_timer = None
        request_in_progress = self.cycle is not None and not self.cycle.response_complete
        if self.cycle is not cycle_when_armed or request_in_progress or self.transport.is_closing():
            return  # a request arrived in time (its body has its own deadline, in the app)
        logger.info("closing a connection from %s: no complete request headers within %gs",
                    _address(self.client), self.header_timeout_s)
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown client"


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """The h11 protocol class with `timeout_s` as its header deadline (uvicorn instantiates it itself)."""
    return type("SpecdH11Protocol", (_H11WithHeaderTimeout,), {"header_timeout_s": timeout_s})


class SpecdServer(uvicorn.Server):
    """A uvicorn.Server whose shutdown ends the requests still running `grace_s` after it began, through the
    engine (streams get an error event and `[DONE]`, waiting clients a 503), and which returns from `run`
    after a signal instead of re-raising it."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.get_running_loop().call_later(self._grace_s, self._end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _end_requests(self) -> None:
        if self.server_state.tasks:
            logger.warning("shutdown: %d request(s) still running after the %gs grace period; ending them",
                           len(self.server_state.tasks), self._grace_s)
        self._engine.request_stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Like uvicorn's, minus re-raising the caught signal at exit: a graceful shutdown is a success."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(app: FastAPI, settings: ServerSettings, **uvicorn_options: Any) -> SpecdServer:
    """The server for an app built by build_app; `uvicorn_options` go to uvicorn.Config (host, port, ...)."""
    config = uvicorn.Config(
        app,
        http=header_timeout_protocol(settings.header_timeout_s),
        timeout_graceful_shutdown=settings.shutdown_grace_s + _UVICORN_BACKSTOP_S,  # type: ignore[arg-type]
        **uvicorn_options,
    )
    return SpecdServer(config, app.state.engine, settings.shutdown_grace_s)
