"""`specd serve` flags and wiring: EngineConfig (max_waiting), the PrometheusSink, uvicorn's bind address."""

from __future__ import annotations

from dataclasses import replace

import pytest
import uvicorn
from starlette.testclient import TestClient

from specd.cli import build_parser
from specd.errors import InvalidParameterError
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.server import app as app_module
from specd.server.settings import ServerSettings


def test_serve_defaults_bind_loopback():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("127.0.0.1", 8000, None, None)
    assert args.max_waiting > 0 and not args.vllm_compat_metrics


def test_serve_flags_become_server_settings(monkeypatch):
    monkeypatch.setenv("SPECD_API_KEY", "from-env")
    settings = app_module.settings_from_args(build_parser().parse_args(["serve"]))
    assert settings.api_key == "from-env"  # the environment, which ps does not show, is the default source
    assert settings.allowed_hosts == () and settings.cors_allow_origins == () and not settings.parse_special_tokens
    assert settings.max_body_bytes == 1024 * 1024 and settings.queue_timeout_s == 30
    settings = app_module.settings_from_args(build_parser().parse_args([
        "serve", "--api-key", "flag", "--host", "10.1.2.3", "--allowed-hosts", "a.example,b.example",
        "--allowed-hosts", "c.example:8000", "--cors-allow-origin", "https://app.example", "--max-body-bytes", "1000",
        "--header-timeout", "2", "--body-timeout", "3", "--queue-timeout", "0", "--shutdown-timeout", "4.5",
        "--parse-special-tokens",
    ]))
    assert settings.api_key == "flag"
    # The bind address is a name clients use; the loopback names are always served.
    assert settings.host_allow_list == {"a.example", "b.example", "c.example", "10.1.2.3"}
    assert settings.cors_allow_origins == ("https://app.example",) and settings.parse_special_tokens
    assert (settings.max_body_bytes, settings.header_timeout_s, settings.body_timeout_s) == (1000, 2, 3)
    assert (settings.queue_timeout_s, settings.shutdown_grace_s) == (0, 4.5)
    monkeypatch.delenv("SPECD_API_KEY")
    assert app_module.settings_from_args(build_parser().parse_args(["serve"])).api_key is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_body_bytes", 0), ("body_timeout_s", 0), ("header_timeout_s", -1), ("queue_timeout_s", -1),
     ("allowed_hosts", ("http://x.example/",)), ("cors_allow_origins", ("app.example",)), ("shutdown_grace_s", 0)],
)
def test_bad_server_settings_name_the_field(field, value):
    with pytest.raises(InvalidParameterError) as info:
        ServerSettings("m", **{field: value})
    assert info.value.field == field


def test_serve_from_args_wiring(monkeypatch, tiny_model, tokenizer, caplog):
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
    assert any("visible" in r.getMessage() and "SPECD_API_KEY" in r.getMessage() for r in caplog.records)
    config = captured["config"]
    assert config.max_waiting == 3
    assert (config.speculation.method, config.speculation.k_policy) == ("ngram", "heuristic")
    assert len(captured["sinks"]) == 1 and isinstance(captured["sinks"][0], PrometheusSink)
    served = captured["uvicorn"]
    assert (served.host, served.port) == ("127.0.0.1", 8123)
    assert served.http.header_timeout_s == 10.0  # the h11 protocol with the header deadline
    # In-process check of the built app: the key is enforced and the sink's families are exported.
    with TestClient(served.app, base_url="http://127.0.0.1:8123") as client:
        assert client.get("/v1/models").status_code == 401
        models = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        text = client.get("/metrics").text
    assert 'specd_spec_decode_drafts_total{k_policy="heuristic",model="m",proposer="ngram"}' in text
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
