"""`specd serve`: the FastAPI app, its command-line flags, and the uvicorn entry point.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/spec/stats (all under
--api-key when one is set), GET /health and GET /metrics (always open, for probes and scrapers).
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
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specd.cluster.options import add_cluster_arguments
from specd.config_args import MAX_WAITING_FLAG, engine_config_from_args
from specd.errors import InvalidParameterError
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.server.async_engine import AsyncEngine
from specd.server.errors import APIError
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
from specd.server.serving import OpenAIServing

logger = logging.getLogger("specd.server")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """model_name: the name clients must send as `model` (omitting it is also accepted).
    api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`.
    engine_stop_timeout_s: how long shutdown waits for the engine thread after aborting every request."""

    model_name: str
    api_key: str | None = None
    engine_stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise InvalidParameterError("served_model_name", "must be a non-empty string")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidParameterError("api_key", "must be a non-empty string when given")
        if not self.engine_stop_timeout_s > 0:
            raise InvalidParameterError("engine_stop_timeout_s", "must be > 0")


def build_app(llm: LLM, settings: ServerSettings, registry: CollectorRegistry) -> FastAPI:
    """The app over an existing LLM. The engine thread starts and stops with the app's lifespan.

    `registry` is exported at /metrics; request metrics are added to it here (speculation metrics come
    from a PrometheusSink the caller registered in it when building `llm`).
    """
    metrics = RequestMetrics(registry, settings.model_name)
    engine = AsyncEngine(llm, metrics)
    serving = OpenAIServing(llm, engine, settings.model_name)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            # Requests still in flight here outlived uvicorn's graceful period: abort them, end the thread.
            if not await asyncio.to_thread(engine.stop, settings.engine_stop_timeout_s):
                logger.error("the engine thread did not stop within %.1fs", settings.engine_stop_timeout_s)

    app = FastAPI(title="specd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.llm = llm

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        metrics.observe_error(exc.info.code or exc.info.type)
        return JSONResponse(exc.body().model_dump(), status_code=exc.status_code, headers=exc.headers)

    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        body = ErrorBody(error=ErrorInfo(message=f"internal error: {type(exc).__name__}", type="server_error",
                                         code="internal_error"))
        return JSONResponse(body.model_dump(), status_code=500)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Unknown routes and wrong methods, in the same error shape as everything else.
        assert isinstance(exc, StarletteHTTPException)
        body = ErrorBody(error=ErrorInfo(message=str(exc.detail), type="invalid_request_error",
                                         code=f"http_{exc.status_code}"))
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)

    async def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        expected = f"Bearer {settings.api_key}"
        if not secrets.compare_digest(header.encode(), expected.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           error_type="authentication_error", code="invalid_api_key")

    guarded = [Depends(authorize)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await serving.completions(await request.body(), request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await request.body(), request)

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
    g.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECD_API_KEY, else none)")
    MAX_WAITING_FLAG.add_to(g, default=128)  # a server should bound its queue; the engine's default does not
    g.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    g.add_argument("--vllm-compat-metrics", action="store_true",
                   help="also export vllm:spec_decode_* metric names")
    g.add_argument("--shutdown-timeout", type=int, default=10,
                   help="seconds in-flight requests get to finish on shutdown before they are aborted")
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


def serve_from_args(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Returns the process exit code."""
    import uvicorn

    config = engine_config_from_args(args)
    settings = ServerSettings(args.served_model_name or args.model, args.api_key, float(args.shutdown_timeout))
    registry = CollectorRegistry()
    sink = PrometheusSink(
        registry,
        k_max=config.speculation.metrics_k_max,
        model=settings.model_name,
        proposer=config.speculation.method,
        vllm_compat=args.vllm_compat_metrics,
    )
    started = time.perf_counter()
    llm = load_off_main_thread(lambda: LLM.from_config(config, [sink]))
    logger.info("loaded %s in %.1fs; speculation: %s; serving as '%s' on http://%s:%d", llm.source,
                time.perf_counter() - started, config.speculation.method, settings.model_name, args.host, args.port)
    if args.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        logger.warning("listening on %s without --api-key", args.host)
    app = build_app(llm, settings, registry)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=args.shutdown_timeout,
    ))
    server.run()
    return 0
