"""Bad input gets the right status and names the field; the server keeps serving after each."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from specd.config import SpeculationConfig


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


BAD_BODIES = [
    # (body, param, code)
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", "invalid_type"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "invalid_type"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "x", "temperature": -0.5}, "temperature", "invalid_value"),
    ({"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"prompt": "x", "n": 0}, "n", "invalid_value"),
    ({"prompt": "x", "n": 17}, "n", "invalid_value"),
    ({"prompt": "x", "logprobs": 99}, "logprobs", "invalid_value"),
    ({"prompt": "x", "stop": [""]}, "stop", "invalid_value"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"prompt": [5, 100000]}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": "x", "speculation": {"num_speculative_tokens": 9}}, "speculation.num_speculative_tokens",
     "invalid_value"),
    ({"prompt": "x", "speculation": {"k_policy": "psychic"}}, "speculation.k_policy", "invalid_value"),
    ({"prompt": "x", "speculation": {"draft": 1}}, "speculation.draft", "unsupported_parameter"),
] + [
    ({"prompt": "x", name: value}, name, "unsupported_parameter")
    for name, value in [("presence_penalty", 0.5), ("frequency_penalty", 0.1), ("logit_bias", {"5": 1}),
                        ("echo", True), ("best_of", 2), ("suffix", "z"), ("tools", [])]
]

BAD_CHAT_BODIES = [
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, "messages", "context_length_exceeded"),
]


def _good_request_works(server) -> None:
    out = server.client().completions.create(model=server.model, prompt="abc", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize(("body", "param", "code"), BAD_BODIES)
def test_bad_completion_fields(spec_server, body, param, code):
    error = _error(spec_server.post("/v1/completions", json=body), 400)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param.split(".")[-1].split("[")[0] in error["message"]


@pytest.mark.parametrize(("body", "param", "code"), BAD_CHAT_BODIES)
def test_bad_chat_fields(spec_server, body, param, code):
    error = _error(spec_server.post("/v1/chat/completions", json=body), 400)
    assert (error["param"], error["code"]) == (param, code)


def test_malformed_json_and_non_object(spec_server):
    for content in (b"{bad json", b"", b"[1, 2]", b'"prompt"'):
        error = _error(spec_server.post("/v1/completions", content=content), 400)
        assert error["type"] == "invalid_request_error"
    _good_request_works(spec_server)


def test_too_long_prompt_is_context_length_exceeded(spec_server):
    error = _error(spec_server.post("/v1/completions", json={"prompt": "y" * 400}), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as info:
        spec_server.client().completions.create(model=spec_server.model, prompt="y" * 400)
    assert info.value.code == "context_length_exceeded"
    _good_request_works(spec_server)


def test_unknown_model_is_404(spec_server):
    error = _error(spec_server.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        spec_server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    _good_request_works(spec_server)


def test_api_key_required(spec_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": spec_server.api_key}):
        error = _error(spec_server.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
        assert httpx.get(f"{spec_server.url}/v1/models", headers=headers, timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        spec_server.client(api_key="wrong").models.list()
    # Probes and scrapers need no key.
    assert httpx.get(f"{spec_server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{spec_server.url}/metrics", timeout=10).status_code == 200
    _good_request_works(spec_server)


def test_unknown_route_has_openai_error_shape(spec_server):
    error = _error(httpx.get(f"{spec_server.url}/v1/nothing", timeout=10), 404)
    assert error["code"] == "http_404"
    _error(httpx.get(f"{spec_server.url}/v1/completions", headers=spec_server.auth, timeout=10), 405)


def test_errors_are_counted(spec_server):
    key = ("specd_request_errors_total", (("code", "model_not_found"), ("model", spec_server.model)))
    before = spec_server.metrics().get(key, 0.0)
    spec_server.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert spec_server.metrics()[key] == before + 1


@pytest.fixture
def slow_server(make_llm, start_server):
    """One KV slot, a waiting queue of one, and ~20 ms per step, so a long request holds the slot."""
    registry = CollectorRegistry()
    llm = make_llm(registry, step_delay_s=0.02, max_num_seqs=1, max_waiting=1,
                   speculation=SpeculationConfig(method="ngram"))
    with start_server(llm, registry) as live:
        yield live


def _first_event(lines: Iterator[str]) -> dict:
    # Pulls from a live iterator: leaving a `for` over response.iter_lines() would close the connection.
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            return json.loads(line[len("data: "):])
    raise AssertionError("no event")


def test_queue_full_is_503_with_retry_after(slow_server):
    engine = slow_server.llm.engine
    body = {"model": slow_server.model, "prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=slow_server.auth) as http, \
            http.stream("POST", f"{slow_server.url}/v1/completions", json=body) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        _first_event(lines)  # the long request holds the only slot now
        waiting_result: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: waiting_result.append(slow_server.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 2})))
        waiter.start()
        slow_server.wait_for(lambda: engine.num_waiting == 1)
        response = slow_server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        error = _error(response, 503)
        assert error["code"] == "queue_full" and response.headers["retry-after"] == "1"
        # n = 2 does not fit either, even as one request: choices are added all or nothing.
        _error(slow_server.post("/v1/completions", json={"prompt": "abc", "n": 2}), 503)
        assert engine.num_waiting == 1
    # Closing the stream aborted the long request, so the waiting one runs and succeeds.
    waiter.join(60)
    assert waiting_result and waiting_result[0].status_code == 200
    _good_request_works(slow_server)
