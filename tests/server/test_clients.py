"""Client libraries people point at OpenAI-compatible servers, against a live specd server (tiny model, ngram
speculation): each returns a valid, schema-conforming object.

The packages are the `clients` extra (scripts/setup.sh installs it); a test whose package is absent is skipped,
saying which. Nothing here may touch the network: litellm reads its bundled model-cost map
(LITELLM_LOCAL_MODEL_COST_MAP) and the code paths used need no tiktoken download. Every call has a timeout.
"""

from __future__ import annotations

import json
import os
import types
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from specd.server.serving import IGNORED_FIELDS_HEADER

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 120
# The tiny random model writes noise: bounded strings keep every answer short enough to finish on the grammar.
PROMPT = "Extract the person: Ann is 31 and lives in Oslo."


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode requires

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    city: Literal["Oslo", "Paris", "Rome"]


def _check(person: object) -> None:
    assert isinstance(person, Person), person
    assert len(person.name) <= 8 and 0 <= person.age <= 120 and person.city in ("Oslo", "Paris", "Rome")


def _import(name: str) -> types.ModuleType:
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install -e '.[clients]')")


@pytest.fixture(scope="module")
def base_url(spec_server) -> str:
    return f"{spec_server.url}/v1"


def test_openai_client_every_field(spec_server):
    client = spec_server.client()
    raw = client.chat.completions.with_raw_response.create(
        model=spec_server.model, messages=[{"role": "system", "content": "You extract data."},
                                           {"role": "user", "content": PROMPT, "name": "ann"}],
        max_completion_tokens=80, temperature=0, seed=3, presence_penalty=0.1, frequency_penalty=0.1,
        logit_bias={"70": -1}, stop=["\n\n"], n=2, logprobs=True, top_logprobs=2, store=False,
        metadata={"run": "test"}, user="u", service_tier="auto", parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                                "strict": True}},
    )
    assert raw.headers[IGNORED_FIELDS_HEADER] == "user, store, metadata, service_tier, messages[].name"
    out = raw.parse()
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop" and choice.logprobs is not None, choice.message.content
        _check(Person.model_validate_json(choice.message.content))
    # .parse() with a pydantic model (response_format json_schema, strict)
    parsed = client.chat.completions.parse(model=spec_server.model, messages=[{"role": "user", "content": PROMPT}],
                                           response_format=Person, max_tokens=80, temperature=0)
    _check(parsed.choices[0].message.parsed)
    # Forced tool call, streamed
    tool = {"type": "function", "function": {"name": "save_person", "parameters": Person.model_json_schema()}}
    stream = client.chat.completions.create(
        model=spec_server.model, messages=[{"role": "user", "content": PROMPT}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": "save_person"}}, max_tokens=80, temperature=0,
        stream=True)
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in stream
                        if c.choices and c.choices[0].delta.tool_calls)
    _check(Person.model_validate_json(arguments))
    # Completions: echo, penalties, best_of 1, suffix null (what LangChain sends)
    completion = client.completions.create(model=spec_server.model, prompt="Ann is", max_tokens=4, echo=True,
                                           best_of=1, presence_penalty=0, frequency_penalty=0, logit_bias={},
                                           temperature=0)
    assert completion.choices[0].text.startswith("Ann is")


def test_langchain_openai_invoke(base_url, spec_server):
    langchain_openai = _import("langchain_openai")
    # LangChain's completions model always sends presence_penalty 0, frequency_penalty 0, logit_bias {}, n, best_of.
    llm = langchain_openai.OpenAI(base_url=base_url, api_key=spec_server.api_key, model=spec_server.model,
                                  max_tokens=8, temperature=0, timeout=TIMEOUT_S, max_retries=0)
    assert isinstance(llm.invoke("Ann is"), str)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(base_url, spec_server, method):
    langchain_openai = _import("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=base_url, api_key=spec_server.api_key, model=spec_server.model,
                                       max_tokens=80, temperature=0, timeout=TIMEOUT_S, max_retries=0)
    _check(chat.with_structured_output(Person, method=method).invoke(PROMPT))


def test_instructor_default_mode(spec_server):
    instructor = _import("instructor")
    client = instructor.from_openai(spec_server.client())  # default mode: TOOLS (a named tool_choice)
    person = client.chat.completions.create(model=spec_server.model, response_model=Person, max_retries=0,
                                            messages=[{"role": "user", "content": PROMPT}], max_tokens=80,
                                            temperature=0)
    _check(person)


def test_litellm_completion_with_response_format(base_url, spec_server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else it downloads the map at import
    litellm = _import("litellm")
    response = litellm.completion(model=f"openai/{spec_server.model}", api_base=base_url, api_key=spec_server.api_key,
                                  messages=[{"role": "user", "content": PROMPT}], response_format=Person,
                                  max_tokens=80, temperature=0, timeout=TIMEOUT_S, num_retries=0)
    _check(Person.model_validate(json.loads(response.choices[0].message.content)))


def test_llama_index_structured_predict(base_url, spec_server):
    openai_like = _import("llama_index.llms.openai_like")
    prompts = _import("llama_index.core.prompts")
    llm = openai_like.OpenAILike(model=spec_server.model, api_base=base_url, api_key=spec_server.api_key,
                                 is_chat_model=True, is_function_calling_model=True, context_window=256,
                                 max_tokens=160, temperature=0, timeout=TIMEOUT_S, max_retries=0)
    # It forces a call with tool_choice "required": the output is a list of calls, longer than the object alone.
    person = llm.structured_predict(Person, prompts.PromptTemplate("Extract the person: {text}"),
                                    text="Ann is 31 and lives in Oslo.")
    _check(person)
