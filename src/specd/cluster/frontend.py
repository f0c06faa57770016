"""The ASGI app a replica serves: specd's own app (server/app.py build_app), with two answers pooled.

GET /metrics and GET /v1/spec/stats first run through the replica's own app, so its checks (API key, and any
middleware it has) decide as they do on one process; a 200 then has its body replaced by the pooled figures
of every replica (specd.cluster.pooling). Every response carries `x-specd-replica`, the replica that served it.
No Ray import here: the board is whatever `PooledSource` the caller gives.
"""

from __future__ import annotations

import json
import logging
from typing import NamedTuple, Protocol

from prometheus_client import generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specd.cluster.pooling import BoardEntry, MergedFamilies, pooled_spec_stats

REPLICA_HEADER = "x-specd-replica"
POOLED_PATHS = ("/metrics", "/v1/spec/stats")
logger = logging.getLogger("specd.cluster")


class PooledSource(Protocol):
    async def pooled_entries(self) -> list[BoardEntry]:
        """Publish this replica's latest report, then return every replica's (fresh for this one)."""
        ...


class _Captured(NamedTuple):
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class ReplicaFrontend:
    def __init__(self, app: ASGIApp, replica: str, source: PooledSource, k_max: int) -> None:
        self._app = app
        self._replica = replica.encode()
        self._source = source
        self._k_max = k_max

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: the specd app starts and stops its engine thread
            await self._app(scope, receive, send)
            return
        send = self._tagging(send)
        if scope["method"] != "GET" or scope["path"] not in POOLED_PATHS:
            await self._app(scope, receive, send)
            return
        own = await _capture(self._app, scope, receive)
        if own.status != 200:
            await _respond(send, own.status, own.headers, own.body)
            return
        try:
            entries = await self._source.pooled_entries()
        except Exception as exc:  # the hub is gone or unreachable: say so rather than answer for one replica
            logger.exception("pooled metrics unavailable")
            error = {"message": f"pooled metrics unavailable: {type(exc).__name__}: {exc}",
                     "type": "service_unavailable_error", "param": None, "code": "metrics_unavailable"}
            await _respond(send, 503, [(b"content-type", b"application/json")],
                           json.dumps({"error": error}).encode())
            return
        if scope["path"] == "/metrics":
            body = generate_latest(MergedFamilies(entries))  # type: ignore[arg-type]  # any .collect() will do
        else:
            body = json.dumps(pooled_spec_stats(json.loads(own.body), entries, self._k_max)).encode()
        await _respond(send, 200, own.headers, body)

    def _tagging(self, send: Send) -> Send:
        replica = self._replica

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), replica)]}
            await send(message)

        return tagged


async def _capture(app: ASGIApp, scope: Scope, receive: Receive) -> _Captured:
    status, headers, chunks = 500, [], []

    async def keep(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, keep)
    return _Captured(status, headers, b"".join(chunks))


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    kept = [(name, value) for name, value in headers if name.lower() != b"content-length"]
    await send({"type": "http.response.start", "status": status,
                "headers": [*kept, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
