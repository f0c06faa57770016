"""A Ray Serve proxy middleware: a response its replica never finished still ends the way specd's errors do.

When a replica dies, the proxy's ASGI app returns without finishing the response it was relaying (it can only
log the replica's death). Left alone, a client mid-stream sees its connection cut ("incomplete chunked read")
and a client still waiting sees a bare 500. StreamGuard runs in the proxy, which outlives replicas, and:
  - an event stream (text/event-stream) that was cut gets specd's error event, then `data: [DONE]` (the
    OpenAI client raises APIError on that event, as for any error specd streams);
  - a request whose response never started gets a 500 in specd's error shape (code `replica_failed`);
  - a cut non-streaming body is left cut: appending to half a JSON document would not make it valid.

Ray Serve installs proxy middlewares from the callback named by the environment variable below, read when a
proxy starts: `specd serve --replicas` sets it for the Ray it starts; on a cluster it is set on every node
before `ray start` (docs/cluster.md). No Ray import here.
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "specd.cluster.stream_guard.proxy_middlewares"
logger = logging.getLogger("specd.cluster")

_MESSAGE = ("the replica serving this request failed before finishing it (Ray Serve restarts failed "
            "replicas; retrying the request is safe)")


def proxy_middlewares() -> list[Middleware]:
    """The callback Ray Serve's proxy calls (named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(StreamGuard)]


def error_body() -> bytes:
    error = {"message": _MESSAGE, "type": "server_error", "param": None, "code": "replica_failed"}
    return json.dumps({"error": error}).encode()


class StreamGuard:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = finished = event_stream = False

        async def watched(message: Message) -> None:
            nonlocal started, finished, event_stream
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                event_stream = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self._app(scope, receive, watched)
        except Exception:
            logger.exception("the proxy failed relaying %s", scope.get("path"))
        if finished:
            return
        if not started:
            body = error_body()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        elif event_stream:
            await send({"type": "http.response.body",
                        "body": b"data: " + error_body() + b"\n\ndata: [DONE]\n\n", "more_body": False})
