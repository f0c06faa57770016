"""`specd serve`'s own settings (the engine's are EngineConfig), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from specd.errors import InvalidParameterError
from specd.server.guards import ANY_HOST, normalize_host

# nginx's default too. A 2048-token prompt is ~10 KB as text or as token ids; 1 MiB still holds ~70 such
# id lists. The limit also bounds JSON parsing, which holds the GIL (~0.1-0.3 s per MiB of token ids here).
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """model_name: the name clients must send as `model` (omitting it is also accepted).
    api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`.
    engine_stop_timeout_s: how long shutdown waits for the engine thread after aborting every request.
    shutdown_grace_s: after SIGINT/SIGTERM, how long requests in flight may still run; those left then end
        with an error event (streams) or a 503.
    max_body_bytes: request bodies above this get 413 (the rest of a body up to 32 MiB is read and dropped first).
    header_timeout_s / body_timeout_s: a connection whose request headers / body have not fully arrived within
        this long is closed / answered 408 (slow clients cannot hold connections open).
    allowed_hosts: Host header names served besides 127.0.0.1, localhost and ::1 ("*": any).
    cors_allow_origins: browser origins allowed to call the API (CORS); empty: no CORS headers at all.
    queue_timeout_s: how long a request that finds the waiting queue full waits in line for room, first
        come first served, before 503 (0: 503 at once).
    parse_special_tokens: read control-token strings (`<|im_end|>`) in prompts and message contents as
        control tokens; off by default, when they are plain text and a client cannot forge chat turns.
    vllm_compat_metrics: /metrics also exports vLLM v1's names of the request metrics specd measures (and the
        speculation sink, built by the caller, its vllm:spec_decode_* names while speculating).
    """

    model_name: str
    api_key: str | None = None
    engine_stop_timeout_s: float = 10.0
    shutdown_grace_s: float = 10.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    allowed_hosts: tuple[str, ...] = ()
    cors_allow_origins: tuple[str, ...] = ()
    queue_timeout_s: float = 30.0
    parse_special_tokens: bool = False
    vllm_compat_metrics: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise InvalidParameterError("served_model_name", "must be a non-empty string")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidParameterError("api_key", "must be a non-empty string when given")
        for name in ("engine_stop_timeout_s", "shutdown_grace_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(name, f"must be > 0, got {getattr(self, name)!r}")
        if not self.queue_timeout_s >= 0:
            raise InvalidParameterError("queue_timeout_s", f"must be >= 0, got {self.queue_timeout_s!r}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < 1:
            raise InvalidParameterError("max_body_bytes", f"must be a positive integer, got {self.max_body_bytes!r}")
        for host in self.allowed_hosts:
            if not isinstance(host, str) or not normalize_host(host) or any(c in host for c in "/ @"):
                raise InvalidParameterError("allowed_hosts", f"{host!r} is not a host name or address (or '*')")
        for origin in self.cors_allow_origins:
            if not isinstance(origin, str) or not (origin == ANY_HOST or origin.startswith(("http://", "https://"))):
                raise InvalidParameterError(
                    "cors_allow_origins", f"{origin!r} is not an origin such as https://app.example.com (or '*')"
                )

    @property
    def host_allow_list(self) -> frozenset[str]:
        return frozenset(ANY_HOST if h.strip() == ANY_HOST else normalize_host(h) for h in self.allowed_hosts)
