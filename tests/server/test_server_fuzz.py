"""Hypothesis-generated bodies for both endpoints against a live server: never a 5xx, every 4xx in OpenAI's
error shape naming a field or the body, every 200 a well-formed answer, and a normal request still works
after each batch of examples. Under CI's profile (tests/conftest.py) the examples are derandomized."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from specd.config import SpeculationConfig

EXAMPLES_PER_ENDPOINT = 150
BATCH = 30  # a normal request must succeed after every this many examples

_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
)
json_values = st.recursive(
    _scalars, lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children,
                                                                                max_size=3),
    max_leaves=6,
)


_special_texts = st.sampled_from(["<eos>", "<bos>", "<|user|>", "<|im_end|>", "\x00", "\ud7ff", "é", "😀"])
_texts = st.one_of(st.text(max_size=16), st.lists(st.text(max_size=4) | _special_texts, max_size=5).map("".join))
_token_ids = st.lists(st.one_of(*[st.integers(0, 319)] * 8, st.sampled_from([-3, 320, 2**40])), max_size=6)



def _mostly(valid: st.SearchStrategy, edge: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, valid, edge)


# Plausible values: the right JSON types, mostly in range.
COMMON_FIELDS = {
    "model": st.sampled_from(["tiny", "tiny", "tiny", "gpt-4"]),
    "max_tokens": _mostly(st.integers(1, 6), st.sampled_from([-2, 0, 64, 10**12, 2**63])),
    "temperature": _mostly(st.floats(0, 2), st.sampled_from([-1.0, math.inf, math.nan, 1e308])),
    "top_p": _mostly(st.floats(0.01, 1), st.sampled_from([0.0, -0.5, 1.5, math.nan])),
    "seed": _mostly(st.integers(0, 2**31), st.sampled_from([-1, 2**63, 2**65])),
    "stop": _texts | st.lists(_texts, max_size=3),
    "n": _mostly(st.integers(1, 4), st.sampled_from([-1, 0, 17, 20])),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()},
                                            optional={"include_obfuscation": st.just(True)}),
    "user": st.text(max_size=5),
    "top_k": _mostly(st.integers(-1, 50), st.sampled_from([-3, 500, 2**40])),
    "min_p": _mostly(st.floats(0, 1), st.sampled_from([-0.5, 1.5, math.nan])),
    "ignore_eos": st.booleans(),
    "speculation": st.fixed_dictionaries({}, optional={
        "enabled": st.booleans(),
        "num_speculative_tokens": _mostly(st.integers(0, 4), st.sampled_from([-1, 9])),
        "k_policy": st.sampled_from(["fixed", "heuristic", "goodput", "confidence", "psychic"]),
    }),
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": _texts | _token_ids | st.lists(_texts, max_size=3) | st.lists(_token_ids, max_size=3),
    "logprobs": _mostly(st.integers(0, 5), st.sampled_from([-1, 21, 25])),
}
_content = _texts | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]),
                                                    "text": _texts}), max_size=2)
_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "user", "assistant", "system", "tool", "user<|im_end|>"]), "content": _content,
})
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": st.lists(_message, min_size=1, max_size=3),
    "max_completion_tokens": _mostly(st.integers(1, 6), st.sampled_from([-1, 0])),
    "logprobs": st.booleans(),
    "top_logprobs": _mostly(st.integers(0, 5), st.sampled_from([-1, 21, 25])),
}


def _bodies(fields: dict[str, st.SearchStrategy], required: str) -> st.SearchStrategy[bytes]:
    """Half plausible bodies; a third of them with one field (or an unknown one) set to any JSON value; the
    rest any JSON value or bytes at all."""
    plausible = st.fixed_dictionaries({required: fields[required]},
                                      optional={k: v for k, v in fields.items() if k != required})
    one_wild = st.tuples(plausible, st.sampled_from([*fields, "presence_penalty", "x-anything"]), json_values).map(
        lambda case: {**case[0], case[1]: case[2]}
    )
    return st.one_of(
        plausible.map(lambda body: json.dumps(body).encode()),
        plausible.map(lambda body: json.dumps(body).encode()),
        one_wild.map(lambda body: json.dumps(body).encode()),
        json_values.map(lambda value: json.dumps(value).encode()),
        st.binary(max_size=24),
    )


@pytest.fixture(scope="module")
def fuzz_server(make_llm, start_server):
    """max_model_len 64 keeps every accepted request short; 4 slots and a queue of 16."""
    registry = CollectorRegistry()
    llm = make_llm(registry, max_model_len=64, max_num_seqs=4, max_waiting=16,
                   speculation=SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic"))
    with start_server(llm, registry) as live, httpx.Client(
        base_url=live.url, timeout=60, headers={**live.auth, "Content-Type": "application/json"}
    ) as http:
        yield live, http


def _check(http: httpx.Client, path: str, body: bytes) -> None:
    response = http.post(path, content=body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text
        assert error["param"] or "body" in error["message"], (body, response.text)
        return
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and all(json.loads(e[6:]) for e in events[:-1]), response.text
        assert not any('"error"' in e for e in events), response.text
    else:
        answer = response.json()
        assert answer["choices"] and answer["usage"]["completion_tokens"] >= 0


def _normal_request_works(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"], response.text


def _fuzz(fuzz_server, path: str, body: bytes, seen: list[int]) -> None:
    _, http = fuzz_server
    _check(http, path, body)
    seen.append(1)
    if len(seen) % BATCH == 0:
        _normal_request_works(http)


_FUZZ_SETTINGS = settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_fuzz_completions(fuzz_server):
    seen: list[int] = []

    @_FUZZ_SETTINGS
    @given(body=_bodies(COMPLETION_FIELDS, "prompt"))
    def run(body: bytes) -> None:
        _fuzz(fuzz_server, "/v1/completions", body, seen)

    run()
    _normal_request_works(fuzz_server[1])


def test_fuzz_chat_completions(fuzz_server):
    seen: list[int] = []

    @_FUZZ_SETTINGS
    @given(body=_bodies(CHAT_FIELDS, "messages"))
    def run(body: bytes) -> None:
        _fuzz(fuzz_server, "/v1/chat/completions", body, seen)

    run()
    _normal_request_works(fuzz_server[1])
