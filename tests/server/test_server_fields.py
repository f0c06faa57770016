"""OpenAI fields judged by value over HTTP: neutral values are no-ops, metadata is reported in a header, every
offending field is named at once; penalties, logit_bias, response_format, tools and echo do what they say."""

from __future__ import annotations

import json
import logging

import pytest

from specd.sampling.params import SamplingParams, StructuredOutput
from specd.server.serving import IGNORED_FIELDS_HEADER

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "hello world, hello world"}]


def _chat(server, **body) -> dict:
    response = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 120, "temperature": 0,
                                                         **body})
    assert response.status_code == 200, response.text
    return response.json()


def _valid(value: dict) -> bool:
    return set(value) == {"id", "tag", "ok"} and 0 <= value["id"] <= 99 and value["tag"] in ("red", "green", "blue") \
        and isinstance(value["ok"], bool)


def test_neutral_values_are_no_ops(spec_server):
    plain = spec_server.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0}).json()
    neutral = spec_server.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 8, "temperature": 0, "presence_penalty": 0, "frequency_penalty": None,
        "logit_bias": {}, "echo": False, "best_of": 1, "suffix": None, "repetition_penalty": None})
    assert neutral.status_code == 200, neutral.text
    assert IGNORED_FIELDS_HEADER not in neutral.headers
    assert neutral.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    chat_plain = _chat(spec_server)
    chat_neutral = _chat(spec_server, tools=None, tool_choice="none", response_format={"type": "text"},
                         parallel_tool_calls=True, presence_penalty=0.0)
    assert chat_neutral["choices"][0]["message"] == chat_plain["choices"][0]["message"]
    # tool_choice "none" with tools: plain text, no calls.
    with_tools = _chat(spec_server, tools=[WEATHER], tool_choice="none")
    assert with_tools["choices"][0]["message"] == chat_plain["choices"][0]["message"]


def test_metadata_is_accepted_logged_once_and_listed_in_a_header(spec_server, caplog):
    body = {"messages": [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "go on"}],
            "max_tokens": 4, "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u1"}
    with caplog.at_level(logging.WARNING, logger="specd.server"):
        for stream in (False, True, False):
            response = spec_server.post("/v1/chat/completions", json={**body, "stream": stream})
            assert response.status_code == 200, response.text
            assert response.headers[IGNORED_FIELDS_HEADER] == "user, store, metadata, service_tier, messages[].name"
    logged = [r.getMessage() for r in caplog.records if "accepted but never used" in r.getMessage()]
    assert len(logged) == 5 and any("'messages[].name'" in m for m in logged)


def test_every_offending_field_is_named_at_once(spec_server):
    response = spec_server.post("/v1/completions", json={
        "prompt": "x", "best_of": 3, "suffix": "end", "frobnicate": 1, "max_tokens": "ten"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] in ("frobnicate", "max_tokens")  # the first one pydantic reports
    for name in ("frobnicate", "max_tokens", "best_of", "suffix"):
        assert name in error["message"]
    assert error["message"].startswith("4 fields cannot be honoured")


def test_penalties_and_logit_bias_map_onto_sampling_params(spec_server, make_llm):
    """Over HTTP (ngram speculation) the output equals LLM.generate without speculation with the same settings."""
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3, "logit_bias": {"104": 5}}
    prompt = "hello world, hello world, hello"
    out = spec_server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                    **penalties}).json()
    params = SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7,
                            repetition_penalty=1.3, logit_bias={104: 5.0})
    expected = make_llm().generate([prompt], params)[0].outputs[0].text
    assert out["choices"][0]["text"] == expected
    assert expected != make_llm().generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0].text
    # A bias of 100 makes the token certain.
    forced = spec_server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                       "logit_bias": {"104": 100}}).json()
    assert forced["choices"][0]["text"] == "eeeee"  # id 104 is byte 101, "e"


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_parses_and_validates(spec_server, make_llm, stream):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA,
                                                                       "strict": True}}}
    if not stream:
        out = _chat(spec_server, **body)
        text, finish = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
    else:
        response = spec_server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 120,
                                                                  "temperature": 0, "stream": True, **body})
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        finish = chunks[-1]["choices"][0]["finish_reason"]
    assert finish == "stop" and _valid(json.loads(text))
    expected = make_llm().chat(MESSAGES, SamplingParams(max_tokens=120, temperature=0.0, structured=StructuredOutput(
        "json_schema", SCHEMA)))[0].text
    assert text == expected


def test_json_object_and_truncation(spec_server):
    out = _chat(spec_server, response_format={"type": "json_object"}, max_tokens=200)
    choice = out["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    # Cut by max_tokens: honest "length" and the text as far as it got (not valid JSON).
    cut = _chat(spec_server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                max_tokens=5)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == '{"id"'


def test_named_tool_choice_returns_tool_calls(spec_server):
    choice = {"type": "function", "function": {"name": "weather"}}
    out = _chat(spec_server, tools=[TIME, WEATHER], tool_choice=choice)["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    (call,) = out["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "weather"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["celsius"], bool)
    # Streaming: the first delta names the call, the rest stream its arguments.
    response = spec_server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 120, "temperature": 0,
                                                              "tools": [TIME, WEATHER], "tool_choice": choice,
                                                              "stream": True})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "weather"
    assert all(d["id"] is None and d["function"]["name"] is None for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_one_of_the_tools(spec_server, stream):
    body = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0, "tools": [TIME, WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False, "stream": stream}
    response = spec_server.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["function"]["name"] in ("weather", "time") and calls[0]["id"].startswith("call_")
    assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)


def test_tool_history_is_accepted(spec_server):
    """An assistant turn with content null and tool calls; its result in the next user turn (the test template knows
    no tool role)."""
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "weather", "arguments": '{"city": "Oslo", "celsius": true}'}}]},
                {"role": "user", "content": "it is 3 degrees"}]
    response = spec_server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_prepends_each_prompt(spec_server, stream):
    body = {"prompt": ["abc", "hello"], "max_tokens": 4, "temperature": 0, "n": 2}
    plain = spec_server.post("/v1/completions", json=body).json()["choices"]
    response = spec_server.post("/v1/completions", json={**body, "echo": True, "stream": stream})
    if stream:
        texts = ["", "", "", ""]
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    else:
        texts = [c["text"] for c in response.json()["choices"]]
    assert texts == [prompt + c["text"] for prompt, c in zip(["abc", "abc", "hello", "hello"], plain)]


def test_echo_with_logprobs_scores_every_prompt_token(spec_server):
    """Each prompt token's top logprobs equal the engine's first-token logprobs after the tokens before it."""
    ids = spec_server.llm.tokenizer.encode("hello wor")
    out = spec_server.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True,
                                                    "logprobs": 3}).json()["choices"][0]
    logprobs = out["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 2 and out["text"].startswith("hello wor")
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for k in range(1, len(ids)):
        alone = spec_server.post("/v1/completions", json={"prompt": ids[:k], "max_tokens": 1, "temperature": 0,
                                                          "logprobs": 3}).json()["choices"][0]["logprobs"]
        echoed = logprobs["top_logprobs"][k]
        assert echoed.keys() == alone["top_logprobs"][0].keys()
        assert all(abs(echoed[t] - alone["top_logprobs"][0][t]) < 1e-6 for t in echoed)
        assert logprobs["token_logprobs"][k] <= max(echoed.values()) + 1e-9
    # The generated tokens' entries follow the prompt's, as without echo.
    plain = spec_server.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0,
                                                      "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][len(ids):] == plain["token_logprobs"]
