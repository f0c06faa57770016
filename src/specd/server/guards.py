"""What a request must satisfy before a handler parses it: a Host the server answers to, a JSON content type,
and a body that is not too large and arrives in time.

Without an API key, the server's only protection from web pages is that a browser cannot read its answers
and cannot send it JSON cross-origin without a CORS preflight. The Host check closes DNS rebinding (a page
whose own name resolves to 127.0.0.1 is still sent with its own name as Host); requiring
`application/json` closes the cross-origin form post (`text/plain` needs no preflight).
"""

from __future__ import annotations

import asyncio
import ipaddress

from fastapi import Request

from specd.server.errors import APIError

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
ANY_HOST = "*"


class ClientDisconnected(Exception):
    """The client went away before its request could be answered (mid-upload, or while waiting for room)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def normalize_host(host: str) -> str:
    """`Host` header value or allow-list entry -> bare lowercase name: no port, brackets or trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(host_header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's Host names this server: loopback names, entries of `allowed` (normalized), or
    anything when `allowed` holds "*"."""
    if ANY_HOST in allowed:
        return True
    if not host_header:
        return False
    host = normalize_host(host_header)
    if host in LOOPBACK_HOSTS or host in allowed:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback  # 127.0.0.2 and friends
    except ValueError:
        return False


def check_host(request: Request, allowed: frozenset[str]) -> None:
    host = request.headers.get("host")
    if not host_allowed(host, allowed):
        # 421: the request reached a server that does not serve that name (what DNS rebinding looks like).
        raise APIError(
            421, f"Host {(host or '')[:100]!r} is not served here: this server answers to 127.0.0.1, localhost, ::1 "
            "and the names given with --allowed-hosts", param="Host", code="invalid_host",
        )


def check_json_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(
            415, f"the request body must be JSON sent with 'Content-Type: application/json', got "
            f"{content_type[:100]!r}", param="Content-Type", code="unsupported_media_type",
        )


# How much of a refused body is still read (and dropped) before the 413. Clients that write the whole body before
# reading the answer (async httpx, which the OpenAI SDK runs on) see a 413 sent over an unread upload as a
# connection reset, and retry. Past this, or past the body timeout, the connection is closed under the upload.
MAX_DRAIN_BYTES = 32 * 1024 * 1024


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, refused with 413 once it is known to exceed `max_bytes` (from Content-Length, or while
    reading a chunked body), after reading and dropping the rest of it up to MAX_DRAIN_BYTES within the time
    left, so the client reads the answer; 408 if it has not fully arrived `timeout_s` after the headers.
    Raises ClientDisconnected if the client hangs up mid-upload."""
    declared = request.headers.get("content-length")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"Content-Length must be a number of bytes, got {declared[:40]!r}",
                           param="Content-Length", code="invalid_value")
        if int(declared) > max_bytes:
            if int(declared) <= MAX_DRAIN_BYTES:
                await _drain(request, 0, deadline)
            raise _too_large(f"Content-Length is {declared}", max_bytes)
    body = bytearray()
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise APIError(
                408, f"request body: {len(body)} bytes arrived in {timeout_s:g}s, the upload time limit "
                "(--body-timeout)", code="request_timeout", headers={"Connection": "close"},
            ) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected(f"during upload, after {len(body)} of {declared or 'unknown'} bytes")
        body += message.get("body", b"")
        if len(body) > max_bytes:
            seen = len(body)
            if message.get("more_body", False):
                await _drain(request, seen, deadline)
            raise _too_large(f"{seen} bytes arrived so far", max_bytes)
        if not message.get("more_body", False):
            return bytes(body)


async def _drain(request: Request, received: int, deadline: float) -> None:
    """Read and drop the rest of the body, up to MAX_DRAIN_BYTES in all and until `deadline`; returns early,
    never raises, if the client hangs up, the limit is reached or time runs out."""
    loop = asyncio.get_running_loop()
    while received <= MAX_DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect":
            return
        received += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _too_large(seen: str, max_bytes: int) -> APIError:
    # Connection: close: whatever of the upload was not drained is never read.
    return APIError(
        413, f"request body is over the {max_bytes}-byte limit (--max-body-bytes): {seen}",
        code="request_too_large", headers={"Connection": "close"},
    )
