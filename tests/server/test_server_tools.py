"""Tool calling over HTTP: "auto" (OpenAI's default with tools), cut calls, parameterless tools, tool results in
the conversation; the openai client, LangChain bind_tools and litellm against a live server with ngram
speculation. The tiny random model writes noise, so tests steer its first character with logit_bias: "<"
(byte id 63) opens a call, anything else is text; the grammar does the rest."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from specd.config import SpeculationConfig
from specd.server.protocol import ChatCompletionRequest
from specd.server.structured import (
    TOOL_CALL_TAG,
    _call_pairs,
    tool_calls,
    tool_instructions,
    with_tool_instructions,
)

pytestmark = pytest.mark.timeout(300)
LT = 3 + ord("<")  # the byte tokenizer's id of "<"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}
NO_ARGS = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
RB = 3 + ord("]")
# "<" first: a call; "]" as soon as the list may close (neither fits anywhere else in these schemas).
CALL = {"logit_bias": {str(LT): 100, str(RB): 100}}
TEXT = {"logit_bias": {str(LT): -100}}


@pytest.fixture(scope="module")
def tools_server(make_llm, start_server) -> Iterator[Any]:
    """ngram speculation, 512 positions (the tool instructions are prompt tokens)."""
    registry = CollectorRegistry()
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic")
    llm = make_llm(registry, speculation=spec, max_num_seqs=4, max_waiting=16, max_model_len=512)
    with start_server(llm, registry) as live:
        yield live


def _chat(server: Any, **body: object) -> dict:
    response = server.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(server: Any, **body: object) -> list[dict]:
    payload = {"messages": ASK, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=payload, headers=server.auth,
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_makes_a_call_when_the_model_opens_one(tools_server, tool_choice):
    body = {"tools": [WEATHER], "max_tokens": 80, **CALL}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    choice = _chat(tools_server, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and len(message["tool_calls"]) >= 1
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Rome")


def test_auto_answers_in_text_when_the_model_does_not(tools_server):
    choice = _chat(tools_server, tools=[WEATHER], max_tokens=12, **TEXT)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"] and not choice["message"]["content"].startswith("<")
    # Streamed: the same text as content chunks, no tool_calls.
    chunks = _streamed(tools_server, tools=[WEATHER], max_tokens=12, **TEXT)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == choice["message"]["content"]
    assert not any(d.get("tool_calls") for d in deltas)


def test_auto_call_streams_as_tool_call_deltas(tools_server):
    whole = _chat(tools_server, tools=[WEATHER], max_tokens=80, **CALL)["choices"][0]["message"]["tool_calls"]
    chunks = [c for c in _streamed(tools_server, tools=[WEATHER], max_tokens=80, **CALL) if c["choices"]]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tells_the_model_its_tools(tools_server, monkeypatch):
    llm = tools_server.llm
    seen: list[list[int]] = []
    add = llm.add_request

    def record(prompt, params, prompt_token_ids=None, request_id=None):
        seen.append(list(prompt.token_ids))
        return add(prompt, params, prompt_token_ids, request_id)

    monkeypatch.setattr(llm, "add_request", record)
    _chat(tools_server, tools=[WEATHER], max_tokens=2, **TEXT)
    _chat(tools_server, max_tokens=2, **TEXT)
    with_tools, without = (llm.tokenizer.decode(ids) for ids in seen)
    assert "get_weather" in with_tools and TOOL_CALL_TAG in with_tools and "Weather now" in with_tools
    assert "get_weather" not in without


def test_a_cut_call_is_a_length_finish_with_the_calls_so_far(tools_server):
    # "required", cut after the name: the call, its arguments as far as they got, finish_reason "length".
    choice = _chat(tools_server, tools=[WEATHER], tool_choice="required", max_tokens=30)["choices"][0]
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    # Named, cut: the arguments generated so far, never as content.
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _chat(tools_server, tools=[WEATHER], tool_choice=named, max_tokens=4)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert (arguments and '{"city": "Oslo"}'.startswith(arguments)) or '{"city": "Rome"}'.startswith(arguments)


def test_a_tool_without_parameters_takes_an_empty_object(tools_server):
    named = {"type": "function", "function": {"name": "now"}}
    choice = _chat(tools_server, tools=[NO_ARGS], tool_choice=named, max_tokens=20)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_tool_results_come_back_in_the_conversation(tools_server):
    # The test template knows no tool role: results become marked user turns; the earlier call is in history.
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    choice = _chat(tools_server, messages=history, tools=[NO_ARGS], max_tokens=6, **TEXT)["choices"][0]
    assert choice["message"]["content"]


def test_call_pairs_of_whole_and_cut_lists():
    whole = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert _call_pairs(whole) == ([("a", '{"x": 1}'), ("b", "{}")], True)
    assert _call_pairs('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "tw') == (
        [("a", '{"x": 1}'), ("b", '{"y": "tw')], False)
    assert _call_pairs('[{"name": "a", "argu') == ([("a", "")], False)
    assert _call_pairs('[{"na') == ([], False)
    assert _call_pairs("") == ([], False)


def test_auto_output_is_content_or_calls_by_its_first_character():
    request = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    assert tool_calls(request, "Hello", []) is None
    parsed = tool_calls(request, TOOL_CALL_TAG + '[{"name": "get_weather", "arguments": {"city": "Rome"}}]', [])
    assert parsed is not None and parsed.complete and parsed.calls[0].function.arguments == '{"city": "Rome"}'
    assert "get_weather" in tool_instructions(request)
    merged = with_tool_instructions([{"role": "system", "content": "Be brief."}, *ASK], request,
                                    frozenset({"system", "user", "assistant"}))
    assert merged[0]["content"].startswith("Be brief.\n\n") and "get_weather" in merged[0]["content"]
    front = with_tool_instructions(list(ASK), request, frozenset({"system", "user", "assistant"}))
    assert front[0]["role"] == "system" and front[1] == ASK[0]


# ------------------------------------------------------------------ client libraries
def test_openai_client_tools_default_path(tools_server):
    client = tools_server.client()
    out = client.chat.completions.create(model=tools_server.model, messages=ASK, tools=[WEATHER], max_tokens=80,
                                         temperature=0, logit_bias=CALL["logit_bias"])
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    stream = client.chat.completions.create(model=tools_server.model, messages=ASK, tools=[WEATHER], max_tokens=80,
                                            temperature=0, logit_bias=CALL["logit_bias"], stream=True)
    names = [tc.function.name for c in stream if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert names and set(names) == {"get_weather"}


def test_langchain_bind_tools(tools_server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="pip install -e '.[clients]'")
    llm = langchain_openai.ChatOpenAI(model=tools_server.model, base_url=f"{tools_server.url}/v1",
                                      api_key=tools_server.api_key, temperature=0, max_tokens=80, timeout=120,
                                      max_retries=0, logit_bias={LT: 100, RB: 100})
    message = llm.bind_tools([WEATHER]).invoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Oslo", "Rome")


def test_litellm_tool_calling(tools_server):
    litellm = pytest.importorskip("litellm", reason="pip install -e '.[clients]'")
    out = asyncio.run(litellm.acompletion(
        model=f"openai/{tools_server.model}", api_base=f"{tools_server.url}/v1", api_key=tools_server.api_key,
        messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0, logit_bias=CALL["logit_bias"], timeout=120))
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
