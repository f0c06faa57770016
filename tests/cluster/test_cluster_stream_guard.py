"""StreamGuard, the proxy middleware: responses whose replica died still end in specd's error shape (no Ray)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from specd.cluster.stream_guard import StreamGuard, proxy_middlewares

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json")]


def _relay(headers: list[tuple[bytes, bytes]], chunks: list[bytes], finish: bool, raise_after: bool = False):
    """An ASGI app standing in for the proxy: it relays `chunks`, then finishes, returns, or raises."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if raise_after:
            raise RuntimeError("replica died")
        if finish:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def _never_answers(scope: Scope, receive: Receive, send: Send) -> None:
    return None


def _post(app) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=StreamGuard(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/v1/completions", json={})

    return asyncio.run(go())


def _events(text: str) -> list[str]:
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block]


@pytest.mark.parametrize("raise_after", [False, True])
def test_a_cut_event_stream_ends_with_an_error_event_then_done(raise_after):
    chunk = b'data: {"choices": [{"text": "hi"}]}\n\n'
    response = _post(_relay(SSE, [chunk], finish=False, raise_after=raise_after))
    events = _events(response.text)
    assert events[0] == '{"choices": [{"text": "hi"}]}'
    assert json.loads(events[1])["error"]["code"] == "replica_failed"
    assert events[2:] == ["[DONE]"]


def test_a_request_never_answered_gets_a_500_in_specds_error_shape():
    response = _post(_never_answers)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error" and "replica" in error["message"]


def test_finished_responses_are_untouched():
    chunk = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert _post(_relay(SSE, [chunk], finish=True)).content == chunk
    assert _post(_relay(JSON, [b'{"ok": true}'], finish=True)).json() == {"ok": True}


def test_a_cut_json_body_is_not_padded_into_something_else():
    sent: list[dict] = []

    async def record(message) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(StreamGuard(_relay(JSON, [b'{"id": "x", "cho'], finish=False))(scope, receive, record))
    # Exactly what the replica sent: the client sees the cut, not a different document.
    assert [m.get("body") for m in sent] == [None, b'{"id": "x", "cho']
    assert sent[-1]["more_body"] is True


def test_the_proxy_callback_returns_the_guard():
    [middleware] = proxy_middlewares()
    assert middleware.cls is StreamGuard
