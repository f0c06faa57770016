"""`specd serve`: the FastAPI app, its command-line flags, and the uvicorn entry point.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/spec/stats (all under
--api-key when one is set), GET /health and GET /metrics (always open, for probes and scrapers). Every
route checks the Host header first; the POST routes take JSON bodies only (guards.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specd.cluster.options import add_cluster_arguments
from specd.config_args import MAX_WAITING_FLAG, engine_config_from_args
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.server.async_engine import AsyncEngine
from specd.server.errors import APIError
from specd.server.guards import (
    LOOPBACK_HOSTS,
    ClientDisconnected,
    check_host,
    check_json_content_type,
    read_body,
)
from specd.server.metrics import RequestMetrics
from specd.server.protocol import (
    EngineStateInfo,
    ErrorBody,
    ErrorInfo,
    ModelCard,
    ModelList,
    SpecStatsResponse,
    SpeculationInfo,
)
from specd.server.runner import make_server
from specd.server.serving import IGNORED_FIELDS_HEADER, OpenAIServing
from specd.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings

__all__ = ["ServerSettings", "add_serve_arguments", "build_app", "serve", "serve_from_args"]

logger = logging.getLogger("specd.server")


def build_app(llm: LLM, settings: ServerSettings, registry: CollectorRegistry) -> FastAPI:
    """The app over an existing LLM. The engine thread starts and stops with the app's lifespan.

    `registry` is exported at /metrics; request metrics are added to it here (speculation metrics come
    from a PrometheusSink the caller registered in it when building `llm`).
    """
    metrics = RequestMetrics(registry, settings.model_name, vllm_compat=settings.vllm_compat_metrics)
    engine = AsyncEngine(llm, metrics)
    serving = OpenAIServing(llm, engine, settings.model_name, settings.queue_timeout_s,
                            split_special_tokens=not settings.parse_special_tokens)
    started = int(time.time())
    allowed_hosts = settings.host_allow_list

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            # Requests still in flight here outlived the shutdown grace period (runner.SpecdServer ends them at
            # its deadline; under another server they end here): abort them, end the thread.
            if not await asyncio.to_thread(engine.stop, settings.engine_stop_timeout_s):
                logger.error("the engine thread did not stop within %.1fs", settings.engine_stop_timeout_s)

    async def check_request_host(request: Request) -> None:
        check_host(request, allowed_hosts)

    # No trailing-slash redirects: their Location would echo the request's Host header.
    app = FastAPI(title="specd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False, dependencies=[Depends(check_request_host)])
    app.state.engine = engine
    app.state.llm = llm
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(settings.cors_allow_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"], expose_headers=[IGNORED_FIELDS_HEADER], max_age=600,
        )

    def error_response(status_code: int, info: ErrorInfo, headers: dict[str, str] | None = None) -> Response:
        # Every error status goes through here, so specd_request_errors_total counts them all.
        metrics.observe_error(info.code or info.type)
        return JSONResponse(ErrorBody(error=info).model_dump(), status_code=status_code, headers=headers)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc.status_code, exc.info, exc.headers)

    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, ErrorInfo(message=f"internal error: {type(exc).__name__}", type="server_error",
                                             code="internal_error"))

    async def http_error(request: Request, exc: Exception) -> Response:
        # Unknown routes and wrong methods, in the same error shape as everything else.
        assert isinstance(exc, StarletteHTTPException)
        info = ErrorInfo(message=str(exc.detail), type="invalid_request_error", code=f"http_{exc.status_code}")
        return error_response(exc.status_code, info, exc.headers)

    async def client_gone(request: Request, exc: Exception) -> Response:
        # Nobody is left to answer; uvicorn drops what is sent to a closed connection.
        assert isinstance(exc, ClientDisconnected)
        client = f"{request.client.host}:{request.client.port}" if request.client else "unknown client"
        logger.info("%s %s: client %s disconnected %s", request.method, request.url.path, client, exc.what)
        return Response(status_code=499)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnected, client_gone)
    app.add_exception_handler(Exception, unexpected_error)

    async def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        # "Bearer" is matched case-insensitively: an auth scheme's name is (RFC 7235, section 2.1)
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        matches = secrets.compare_digest(token.strip().encode(), settings.api_key.encode())
        if scheme.lower() != "bearer" or not matches:
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           error_type="authentication_error", code="invalid_api_key")

    async def json_only(request: Request) -> None:
        check_json_content_type(request)

    guarded = [Depends(authorize)]
    posted = [Depends(json_only), Depends(authorize)]

    async def body_of(request: Request) -> bytes:
        return await read_body(request, settings.max_body_bytes, settings.body_timeout_s)

    @app.post("/v1/completions", dependencies=posted)
    async def completions(request: Request) -> Response:
        return await serving.completions(await body_of(request), request)

    @app.post("/v1/chat/completions", dependencies=posted)
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await body_of(request), request)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> Response:
        card = ModelCard(id=settings.model_name, created=started, max_model_len=llm.config.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/v1/spec/stats", dependencies=guarded)
    async def spec_stats() -> Response:
        spec = llm.config.speculation
        body = SpecStatsResponse(
            model=settings.model_name,
            speculation=SpeculationInfo(method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
                                        k_policy=spec.k_policy),
            engine=EngineStateInfo(**engine.state._asdict()),
            uptime_s=time.time() - started,
            metrics=llm.get_metrics(),
        )
        return Response(body.model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Server flags; the engine and speculation flags come from config_args.add_engine_arguments."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; prefer the SPECD_API_KEY environment "
                   "variable, which (unlike this flag) other users cannot read with ps")
    MAX_WAITING_FLAG.add_to(g, default=128)  # a server should bound its queue; the engine's default does not
    g.add_argument("--queue-timeout", type=float, default=30.0,
                   help="seconds a request that finds the waiting queue full waits in line (first come, first "
                   "served) before 503 (0 = 503 at once)")
    g.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    g.add_argument("--vllm-compat-metrics", action="store_true",
                   help="also export vLLM's metric names: vllm:spec_decode_* (while speculating) and the request "
                   "metrics specd measures (vllm:e2e_request_latency_seconds, vllm:generation_tokens_total, ...)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on shutdown; then streams end with an error "
                   "event and the rest get 503")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (the rest of one, up to 32 MiB, is read and dropped first)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="close connections whose request headers are not complete within this many seconds")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="answer 408 to requests whose body is not complete within this many seconds")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST[,HOST...]",
                   help="Host header names served besides 127.0.0.1, localhost and ::1 (repeatable; '*' = any): "
                   "needed when clients reach the server by another name or address")
    g.add_argument("--cors-allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. https://app.example.com; repeatable, '*' = any) call "
                   "the API from a browser (default: no CORS)")
    g.add_argument("--parse-special-tokens", action="store_true",
                   help="read control-token text such as <|im_end|> in prompts and message contents as control "
                   "tokens (default: plain text, so clients cannot forge chat turns)")
    add_cluster_arguments(parser)


def load_off_main_thread(load: Callable[[], LLM]) -> LLM:
    """Run `load` on a short-lived thread and return its LLM (its exception is re-raised here).

    OpenMP keeps a worker pool per thread that has run parallel torch ops, and on a small CPU that pool keeps
    competing with the engine thread's own pool for the cores: measured on 2 cores, every parallel op of the
    engine thread ran 2-3x slower (decoding 30 instead of 60 tok/s) once the main thread had loaded the model.
    A pool is freed when its thread exits, so the model is loaded on a thread that then ends, and the main
    thread (HTTP) never runs parallel torch work.
    """
    box: dict[str, LLM | BaseException] = {}

    def run() -> None:
        try:
            box["llm"] = load()
        except BaseException as exc:  # re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="specd-load", daemon=True)  # Ctrl-C during a load can exit
    thread.start()
    thread.join()
    error = box.get("error")
    if isinstance(error, BaseException):
        raise error
    llm = box["llm"]
    assert isinstance(llm, LLM)
    return llm


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """ServerSettings from `specd serve` flags (the API key from SPECD_API_KEY unless --api-key is given)."""
    allowed_hosts = [host.strip() for entry in args.allowed_hosts for host in entry.split(",") if host.strip()]
    bind_host = args.host.strip("[]")
    if bind_host not in ("0.0.0.0", "::", "", *LOOPBACK_HOSTS):  # clients reach a specific address by it
        allowed_hosts.append(bind_host)
    return ServerSettings(
        args.served_model_name or args.model,
        api_key=args.api_key or os.environ.get("SPECD_API_KEY") or None,
        shutdown_grace_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        allowed_hosts=tuple(allowed_hosts),
        cors_allow_origins=tuple(args.cors_allow_origin),
        queue_timeout_s=args.queue_timeout,
        parse_special_tokens=args.parse_special_tokens,
        vllm_compat_metrics=args.vllm_compat_metrics,
    )


def serve_from_args(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Returns the process exit code."""

    config = engine_config_from_args(args)
    settings = settings_from_args(args)
    if args.api_key:
        logger.warning("--api-key is visible to every user of this machine (ps); prefer SPECD_API_KEY")
    registry = CollectorRegistry()
    sink = PrometheusSink(
        registry,
        model=settings.model_name,
        proposer=config.speculation.method,
        k_policy=config.speculation.k_policy,
        vllm_compat=settings.vllm_compat_metrics,
        speculating=config.speculation.enabled,
    )
    started = time.perf_counter()
    llm = load_off_main_thread(lambda: LLM.from_config(config, [sink]))
    logger.info("loaded %s in %.1fs; speculation: %s; serving as '%s' on http://%s:%d", llm.source,
                time.perf_counter() - started, config.speculation.method, settings.model_name, args.host, args.port)
    if args.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        logger.warning("listening on %s without an API key (SPECD_API_KEY)", args.host)
    return serve(build_app(llm, settings, registry), settings, host=args.host, port=args.port)


def serve(app: FastAPI, settings: ServerSettings, **uvicorn_options: object) -> int:
    """Serve `app` (from build_app) until SIGINT/SIGTERM, then shut down gracefully. Returns 0."""
    make_server(app, settings, log_level="info", **uvicorn_options).run()
    return 0
