"""Bad input gets the right status and names the field; the server keeps serving after each."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from specd.config import SpeculationConfig
from specd.server.admission import RETRY_AFTER_UNKNOWN_RATE_S


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
    ({"prompt": "x", "stop": [1, 2]}, "stop", "invalid_type"),
    ({"prompt": [[1, "a"]]}, "prompt", "invalid_type"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"prompt": [5, 100000]}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": "x", "speculation": {"num_speculative_tokens": 9}}, "speculation.num_speculative_tokens",
     "invalid_value"),
    ({"prompt": "x", "speculation": {"k_policy": "psychic"}}, "speculation.k_policy", "invalid_value"),
    ({"prompt": "x", "speculation": {"draft": 1}}, "speculation.draft", "unsupported_parameter"),
    ({"prompt": "x", "best_of": 2}, "best_of", "unsupported_value"),
    ({"prompt": "x", "suffix": "z"}, "suffix", "unsupported_value"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs", "invalid_value"),
    ({"prompt": "x", "tools": []}, "tools", "unsupported_parameter"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "invalid_value"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", "invalid_value"),
    ({"prompt": "x", "guided_regex": "a+", "guided_choice": ["b"]}, "guided_choice", "invalid_value"),
]

_TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}

BAD_CHAT_BODIES = [
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "invalid_type"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "invalid_value"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "x", "surname": "bob"}]}, "messages[0].surname",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema", "invalid_value"),
    # tools alone are "auto" (a constraint: text or calls), which cannot be combined with a response format
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL], "response_format": {"type": "json_object"}},
     "tool_choice", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL, _TOOL], "tool_choice": "required"},
     "tools", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "invalid_value"),
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


@pytest.mark.parametrize(
    ("path", "body", "accepted"),
    [
        ("/v1/completions", {"prompt": "x", "stop": [1, 2]}, "stop: must be a string or a list of strings"),
        ("/v1/completions", {"prompt": {"text": "x"}},
         "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         'messages[0].content: must be a string or a list of text parts ({"type": "text"'),
    ],
)
def test_fields_of_several_types_say_what_they_accept(spec_server, path, body, accepted):
    # pydantic would name only the union's first member ("Input should be a valid string").
    error = _error(spec_server.post(path, json=body), 400)
    assert error["message"].startswith(accepted) and "valid string" not in error["message"]


def test_malformed_json_and_non_object(spec_server):
    headers = {**spec_server.auth, "Content-Type": "application/json"}
    for content in (b"{bad json", b"", b"[1, 2]", b'"prompt"', b"\xff\xfe"):
        error = _error(spec_server.post("/v1/completions", content=content, headers=headers), 400)
        assert error["type"] == "invalid_request_error" and "body" in error["message"]
    _good_request_works(spec_server)


def test_json_nested_past_the_parser_limit_names_the_limit(spec_server):
    # A valid body whose json_schema nests 250 levels: not "malformed", and the message says what the limit is.
    schema: dict = {"type": "object"}
    for _ in range(250):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    error = _error(spec_server.post("/v1/chat/completions", json=body), 400)
    assert error["code"] == "json_too_deep" and "malformed" not in error["message"]
    assert "200 levels deep" in error["message"]
    shallow = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    body["response_format"]["json_schema"]["schema"] = shallow
    body["max_tokens"] = 4
    assert spec_server.post("/v1/chat/completions", json=body).status_code == 200
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
    # the scheme's name is case-insensitive (RFC 7235); the key is not
    for scheme in ("bearer", "BEARER", "Bearer "):
        headers = {"Authorization": f"{scheme} {spec_server.api_key}"}
        assert httpx.get(f"{spec_server.url}/v1/models", headers=headers, timeout=10).status_code == 200
    wrong_case = {"Authorization": f"bearer {spec_server.api_key.upper()}"}
    assert httpx.get(f"{spec_server.url}/v1/models", headers=wrong_case, timeout=10).status_code == 401
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


@contextmanager
def _one_slot_server(make_llm, start_server, queue_timeout_s: float) -> Iterator:
    """One KV slot, a waiting queue of one (and a line of one), ~20 ms per step."""
    registry = CollectorRegistry()
    llm = make_llm(registry, step_delay_s=0.02, max_num_seqs=1, max_waiting=1,
                   speculation=SpeculationConfig(method="ngram"))
    with start_server(llm, registry, queue_timeout_s=queue_timeout_s) as live:
        yield live


def _first_event(lines: Iterator[str]) -> dict:
    # Pulls from a live iterator: leaving a `for` over response.iter_lines() would close the connection.
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            return json.loads(line[len("data: "):])
    raise AssertionError("no event")


LONG_STREAM = {"model": "tiny", "prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}


def _in_background(server, body: dict, results: list, **kw) -> threading.Thread:
    def send() -> None:
        try:
            results.append(server.post("/v1/completions", json=body, **kw))
        except httpx.HTTPError as exc:
            results.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@contextmanager
def _slot_held(server) -> Iterator[None]:
    """A long stream holds the only slot until the block ends (leaving it closes the stream)."""
    with httpx.Client(timeout=60, headers=server.auth) as http, \
            http.stream("POST", f"{server.url}/v1/completions", json=LONG_STREAM) as running:
        lines = running.iter_lines()  # kept: a discarded iterator would close the stream
        _first_event(lines)
        yield


def test_queue_full_without_waiting_is_503_with_retry_after(make_llm, start_server):
    with _one_slot_server(make_llm, start_server, queue_timeout_s=0) as server:
        engine = server.llm.engine
        with _slot_held(server):
            waiting: list = []
            waiter = _in_background(server, {"prompt": "abc", "max_tokens": 2}, waiting)
            server.wait_for(lambda: engine.num_waiting == 1)
            response = server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            error = _error(response, 503)
            # Nothing has finished yet, so there is no finish rate to estimate from: the fixed fallback.
            assert error["code"] == "queue_full"
            assert response.headers["retry-after"] == str(RETRY_AFTER_UNKNOWN_RATE_S)
            assert f"retry in {RETRY_AFTER_UNKNOWN_RATE_S}s" in error["message"]
            # n = 2 could fit an idle server (1 slot + 1 waiting), so it is a 503 too, not a 400.
            _error(server.post("/v1/completions", json={"prompt": "abc", "n": 2}), 503)
            assert engine.num_waiting == 1
        # Closing the stream aborted the long request, so the waiting one runs and succeeds.
        waiter.join(60)
        assert waiting[0].status_code == 200


def test_full_queue_waits_in_line_first_come_first_served(make_llm, start_server):
    with _one_slot_server(make_llm, start_server, queue_timeout_s=60) as server:
        engine = server.llm.engine
        in_line = ("specd_num_requests_in_line", (("model", server.model),))
        finished: list = []
        with _slot_held(server):
            threads = [_in_background(server, {"prompt": "first", "max_tokens": 2}, finished)]
            server.wait_for(lambda: engine.num_waiting == 1)  # in the engine's queue
            threads.append(_in_background(server, {"prompt": "second!", "max_tokens": 2}, finished))
            server.wait_for(lambda: server.metrics()[in_line] == 1)  # in line for room in the queue
            response = server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            error = _error(response, 503)  # the line (as long as the queue: one request) is full
            assert "1 more in line" in error["message"] and 1 <= int(response.headers["retry-after"]) <= 60
        # The long stream is gone: the queue moves, then the line, in arrival order (one slot: one at a time).
        for thread in threads:
            thread.join(60)
        assert [r.status_code for r in finished] == [200, 200]
        encode = server.llm.tokenizer.encode
        assert [r.json()["usage"]["prompt_tokens"] for r in finished] == [len(encode("first")), len(encode("second!"))]
        assert server.metrics()[in_line] == 0


def test_waiting_in_line_is_bounded_and_leaving_the_line_frees_it(make_llm, start_server, caplog):
    with _one_slot_server(make_llm, start_server, queue_timeout_s=0.5) as server:
        engine = server.llm.engine
        with _slot_held(server):
            waiting: list = []
            waiter = _in_background(server, {"prompt": "abc", "max_tokens": 2}, waiting)
            server.wait_for(lambda: engine.num_waiting == 1)
            started = time.monotonic()
            response = server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            error = _error(response, 503)
            assert "within 0.5s" in error["message"] and int(response.headers["retry-after"]) >= 1
            assert 0.4 < time.monotonic() - started < 30
            # A client that hangs up while in line leaves it at once, with one log line.
            with caplog.at_level(logging.INFO, logger="specd.server"):
                with pytest.raises(httpx.ReadTimeout):
                    server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2},
                                timeout=httpx.Timeout(30, read=0.2))
                server.wait_for(lambda: any("waiting for room" in r.getMessage() for r in caplog.records))
            assert engine.num_waiting == 1 and engine.num_running == 1
        waiter.join(60)
        assert waiting[0].status_code == 200
