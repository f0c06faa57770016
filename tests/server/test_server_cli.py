"""`specd serve` flags and wiring: EngineConfig (max_waiting), the PrometheusSink, uvicorn's bind address."""

from __future__ import annotations

from dataclasses import replace

import uvicorn
from starlette.testclient import TestClient

from specd.cli import build_parser
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.server import app as app_module


def test_serve_defaults_bind_loopback():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("127.0.0.1", 8000, None, None)
    assert args.max_waiting > 0 and not args.vllm_compat_metrics


def test_serve_from_args_wiring(monkeypatch, tiny_model, tokenizer):
    monkeypatch.delenv("SPECD_API_KEY", raising=False)
    args = build_parser().parse_args([
        "serve", "--spec", "ngram", "--k-policy", "heuristic", "--max-waiting", "3", "--api-key", "k",
        "--served-model-name", "m", "--vllm-compat-metrics", "--port", "8123",
    ])
    captured = {}

    def fake_build(config, sinks):
        captured["config"], captured["sinks"] = config, sinks
        return LLM.from_model(tiny_model, tokenizer, replace(config, max_model_len=128), stats_sinks=sinks)

    def fake_run(server):
        captured["uvicorn"] = server.config

    monkeypatch.setattr(LLM, "from_config", staticmethod(fake_build))
    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    assert app_module.serve_from_args(args) == 0
    config = captured["config"]
    assert config.max_waiting == 3
    assert (config.speculation.method, config.speculation.k_policy) == ("ngram", "heuristic")
    assert len(captured["sinks"]) == 1 and isinstance(captured["sinks"][0], PrometheusSink)
    served = captured["uvicorn"]
    assert (served.host, served.port) == ("127.0.0.1", 8123)
    # In-process check of the built app: the key is enforced and the sink's families are exported.
    with TestClient(served.app) as client:
        assert client.get("/v1/models").status_code == 401
        models = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        text = client.get("/metrics").text
    assert 'specd_spec_decode_drafts_total{model="m",proposer="ngram"}' in text
    assert "vllm:spec_decode_num_drafts" in text
    assert "specd_num_requests_running" in text


def test_the_model_is_loaded_off_the_main_thread_and_load_errors_surface(tiny_model, tokenizer):
    import threading

    import pytest

    from specd.config import EngineConfig
    from specd.errors import ModelLoadError

    seen: list[str] = []

    def load() -> LLM:
        seen.append(threading.current_thread().name)
        return LLM.from_model(tiny_model, tokenizer, EngineConfig())

    llm = app_module.load_off_main_thread(load)
    assert isinstance(llm, LLM)
    # A thread that ran parallel torch ops keeps an OpenMP pool that slows the engine thread: not the caller's.
    assert seen == ["specd-load"] and seen[0] != threading.current_thread().name

    def broken() -> LLM:
        raise ModelLoadError("model: no such file")

    with pytest.raises(ModelLoadError, match="no such file"):
        app_module.load_off_main_thread(broken)
