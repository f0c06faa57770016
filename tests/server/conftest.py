"""Live uvicorn servers on 127.0.0.1 (free port) over a tiny random-weight model, one per module."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.server.app import ServerSettings, build_app
from specd.server.runner import SpecdServer, make_server

API_KEY = "test-key"
MODEL_NAME = "tiny"


@dataclass
class LiveServer:
    url: str
    llm: LLM
    registry: CollectorRegistry
    server: SpecdServer
    settings: ServerSettings
    model: str = MODEL_NAME
    api_key: str = API_KEY

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        kw.setdefault("api_key", API_KEY)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("headers", self.auth)
        kw.setdefault("timeout", 60)
        return httpx.post(f"{self.url}{path}", **kw)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics as {(sample name, sorted labels): value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.02)


def _make_llm(model, tokenizer, registry: CollectorRegistry | None = None, **kw) -> LLM:
    spec = kw.pop("speculation", SpeculationConfig())
    vllm_compat = kw.pop("vllm_compat", False)
    config = EngineConfig(speculation=spec, max_model_len=kw.pop("max_model_len", 256), **kw)
    sinks = []
    if registry is not None:
        sinks.append(PrometheusSink(registry, MODEL_NAME, spec.method, spec.k_policy, vllm_compat=vllm_compat,
                                     speculating=spec.enabled))
    return LLM.from_model(model, tokenizer, config, stats_sinks=sinks)


@pytest.fixture(scope="session")
def make_llm(tiny_model, tokenizer):
    """make_llm(registry=None, step_delay_s=0, **EngineConfig fields): an LLM over the tiny model; with a
    registry, a PrometheusSink is registered in it; step_delay_s sleeps before every engine step."""

    def make(registry: CollectorRegistry | None = None, step_delay_s: float = 0.0, **kw) -> LLM:
        llm = _make_llm(tiny_model, tokenizer, registry, **kw)
        if step_delay_s:
            # Slow the engine down so a long request is still running when a test acts on it.
            step = llm.step

            def slow_step() -> list:
                time.sleep(step_delay_s)
                return step()

            llm.step = slow_step
        return llm

    return make


@pytest.fixture(scope="session")
def start_server():
    """start_server(llm, registry, api_key=API_KEY, **ServerSettings fields) -> context manager yielding a
    LiveServer."""
    return run_server


@contextmanager
def run_server(llm: LLM, registry: CollectorRegistry, api_key: str | None = API_KEY,
               **settings: object) -> Iterator[LiveServer]:
    """The app served as `specd serve` serves it (runner.make_server); `settings` are ServerSettings fields
    (shutdown_grace_s defaults to 2 s here)."""
    settings.setdefault("shutdown_grace_s", 2.0)
    server_settings = ServerSettings(MODEL_NAME, api_key, engine_stop_timeout_s=10.0, **settings)  # type: ignore[arg-type]
    app = build_app(llm, server_settings, registry)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, server_settings, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", llm, registry, server, server_settings)
    try:
        live.wait_for(lambda: server.started, timeout_s=30)
        yield live
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive(), "server did not shut down"
    assert not app.state.engine.is_running


@pytest.fixture(scope="module")
def spec_server(tiny_model, tokenizer) -> Iterator[LiveServer]:
    """ngram speculation with the heuristic k policy, 4 slots, an API key."""
    registry = CollectorRegistry()
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic")
    llm = _make_llm(tiny_model, tokenizer, registry, speculation=spec, max_num_seqs=4, max_waiting=64)
    with run_server(llm, registry) as live:
        yield live
