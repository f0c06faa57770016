"""Disconnects abort and free KV slots; a failing request ends with a 500, never the server; shutdown."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from specd.config import SpeculationConfig

LONG = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture
def server(make_llm, start_server):
    """Two KV slots and ~10 ms per step, so a 200-token request is still running when the client leaves."""
    registry = CollectorRegistry()
    llm = make_llm(registry, step_delay_s=0.01, max_num_seqs=2,
                   speculation=SpeculationConfig(method="ngram", k_policy="heuristic"))
    with start_server(llm, registry) as live:
        yield live


def _aborted(server) -> float:
    return server.metrics().get(("specd_request_finished_total", (("finish_reason", "abort"),
                                                                   ("model", server.model))), 0.0)


def _good_request_works(server) -> None:
    out = server.client().completions.create(model=server.model, prompt="abc", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_stream_disconnect_aborts_and_frees_kv(server):
    cache = server.llm.engine.cache
    with httpx.Client(timeout=30, headers=server.auth) as http, \
            http.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert cache.num_used_slots == 1
    # Leaving the block closes the connection mid-stream.
    server.wait_for(lambda: _aborted(server) == 1 and cache.num_used_slots == 0)
    metrics = server.metrics()
    assert metrics[("specd_num_requests_running", (("model", server.model),))] == 0
    assert metrics[("specd_kv_cache_used_slots", (("model", server.model),))] == 0
    state = server.llm.engine_state()  # the thread gauges publish what the engine thread runs
    assert metrics[("specd_cpu_threads", (("model", server.model),))] == state.num_threads >= 1
    assert ("specd_cpu_free_cores", (("model", server.model),)) in metrics
    # The abort's partial output is still counted, and its speculation stats were closed.
    assert metrics[("specd_generation_tokens_total", (("model", server.model),))] >= 1
    assert server.llm.engine.recorder.live_request_ids == ()
    _good_request_works(server)


def test_non_streaming_disconnect_aborts(server):
    cache = server.llm.engine.cache
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 2,
                                                  **{k: v for k, v in LONG.items() if k != "prompt"}},
                    timeout=httpx.Timeout(30, read=0.3))
    server.wait_for(lambda: _aborted(server) == 2 and cache.num_used_slots == 0)
    _good_request_works(server)


class _FailingOnce:
    """Stands in for the model: the first call raises, later ones run the real forward."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected forward failure")
        return self.model(*args, **kwargs)


def test_failed_request_is_500_and_server_keeps_serving(server):
    runner = server.llm.engine.runner  # owns the target model
    runner.model = _FailingOnce(runner.model)
    try:
        response = server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "injected forward failure" in error["message"]
        _good_request_works(server)
    finally:
        runner.model = runner.model.model
    errors = ("specd_request_finished_total", (("finish_reason", "error"), ("model", server.model)))
    assert server.metrics()[errors] == 1


def test_failed_stream_ends_with_error_event(server):
    runner = server.llm.engine.runner  # owns the target model
    runner.model = _FailingOnce(runner.model)
    try:
        response = server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True})
        events = [line for line in response.text.splitlines() if line]
        assert '"error"' in events[-2] and "injected forward failure" in events[-2]
        assert events[-1] == "data: [DONE]"
    finally:
        runner.model = runner.model.model
    _good_request_works(server)


def test_step_crash_fails_requests_in_flight_only(server):
    step = server.llm.step
    calls = []

    def crash_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step crash")
        return step()

    server.llm.step = crash_once
    try:
        response = server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        assert response.status_code == 500 and "injected step crash" in response.json()["error"]["message"]
        server.wait_for(lambda: server.llm.engine.cache.num_used_slots == 0)
        _good_request_works(server)
    finally:
        server.llm.step = step


def test_shutdown_past_the_grace_period_ends_requests_properly(make_llm, start_server, caplog):
    """Requests still running when the grace period ends: a stream ends as a finished one does (its final chunk
    with finish_reason "abort", the usage chunk), then an error event saying why and [DONE]; a non-streaming
    request gets a 503; nothing is cancelled mid-write and nothing logs a traceback."""
    registry = CollectorRegistry()
    llm = make_llm(registry, step_delay_s=0.02, max_num_seqs=2)
    lines: list[str] = []
    answers: list[httpx.Response] = []
    with caplog.at_level(logging.INFO):
        with start_server(llm, registry, shutdown_grace_s=0.5) as live:
            def read() -> None:
                body = {**LONG, "stream": True, "stream_options": {"include_usage": True}}
                with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=live.auth,
                                  timeout=30) as response:
                    lines.extend(response.iter_lines())

            def wait() -> None:
                answers.append(live.post("/v1/completions", json=LONG, timeout=30))

            readers = [threading.Thread(target=read), threading.Thread(target=wait)]
            for reader in readers:
                reader.start()
            live.wait_for(lambda: llm.engine.num_running == 2 and len(lines) > 1)
            started = time.monotonic()
        # start_server's exit asserts that the server and the engine thread stopped.
        for reader in readers:
            reader.join(30)
            assert not reader.is_alive()
    assert time.monotonic() - started < 20  # the 0.5 s grace, not uvicorn's backstop or a hang
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (final["code"], final["type"]) == ("server_shutting_down", "service_unavailable_error")
    usage = json.loads(events[-3].removeprefix("data: "))
    assert usage["choices"] == [] and 0 < usage["usage"]["completion_tokens"] < LONG["max_tokens"]
    last_choice = json.loads(events[-4].removeprefix("data: "))["choices"][0]
    assert last_choice["finish_reason"] == "abort"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-3]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])  # one final chunk, the last
    assert 0 < len(chunks) < LONG["max_tokens"]  # it was cut, after some tokens
    error = answers[0].json()["error"]
    assert answers[0].status_code == 503 and error["code"] == "server_shutting_down"
    assert llm.engine.cache.num_used_slots == 0 and not llm.engine.has_unfinished()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
