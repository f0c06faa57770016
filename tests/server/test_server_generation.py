"""Generation through a live server equals LLM.generate / LLM.chat; streaming, concurrency, n, logprobs."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from specd.sampling.params import SamplingParams

PROMPTS = ["hello world, hello world", "abc", "the quick brown fox jumps over", "Zebra zebra zebra"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(make_llm):
    """Greedy outputs of the offline API (no speculation: greedy speculation must be lossless)."""
    llm = make_llm()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    completions = {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    conversation = [{"role": "user", "content": "say hi"}]
    chat = llm.chat(conversation, params)[0].text
    return completions, conversation, chat


def test_completions_sync_equal_generate(spec_server, reference):
    completions, _, _ = reference
    client = spec_server.client()
    for prompt in PROMPTS[:2]:
        out = client.completions.create(model=spec_server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == completions[prompt]
        assert out.choices[0].finish_reason in ("length", "stop")
        usage = out.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        spec = usage.model_extra["speculative_decoding"]
        assert set(spec) >= {"drafts", "draft_tokens", "accepted_tokens", "acceptance_rate",
                             "accepted_tokens_per_draft", "mean_accepted_length", "mean_acceptance_length"}
        assert spec["mean_accepted_length"] == spec["accepted_tokens_per_draft"]  # the deprecated alias
    # A list of prompts: one choice per prompt, in order.
    out = client.completions.create(model=spec_server.model, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [completions[p] for p in PROMPTS[:3]]
    # Token-id prompts (one list, or a list of lists) mean the same as the text they encode.
    ids = [spec_server.llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    out = client.completions.create(model=spec_server.model, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == completions[PROMPTS[0]] and out.usage.prompt_tokens == len(ids[0])
    out = client.completions.create(model=spec_server.model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in out.choices] == [completions[p] for p in PROMPTS[:2]]
    assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_completions_stream_with_usage(spec_server, reference):
    completions, _, _ = reference
    stream = spec_server.client().completions.create(
        model=spec_server.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completions[PROMPTS[0]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done_event(spec_server):
    body = {"model": spec_server.model, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{spec_server.url}/v1/completions", json=body, timeout=30,
                      headers=spec_server.auth) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_chat_sync_and_stream_equal_llm_chat(spec_server, reference):
    _, conversation, chat = reference
    client = spec_server.client()
    out = client.chat.completions.create(model=spec_server.model, messages=conversation, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert out.choices[0].message.content == chat and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=spec_server.model, messages=conversation, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat


def test_concurrent_async_streams_each_get_their_output(spec_server, reference):
    completions, conversation, chat = reference

    async def one_completion(client, prompt: str) -> str:
        stream = await client.completions.create(model=spec_server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def one_chat(client) -> str:
        out = await client.chat.completions.create(model=spec_server.model, messages=conversation,
                                                   max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].message.content

    async def main() -> list[str]:
        client = spec_server.async_client()
        try:
            return await asyncio.wait_for(
                asyncio.gather(*[one_completion(client, p) for p in PROMPTS], one_chat(client)), timeout=120
            )
        finally:
            await client.close()

    results = asyncio.run(main())
    assert results == [completions[p] for p in PROMPTS] + [chat]


def test_n_with_seed_is_reproducible_and_choices_differ(spec_server):
    client = spec_server.client()

    def sample() -> list[str]:
        out = client.completions.create(model=spec_server.model, prompt="abc", max_tokens=10, temperature=1.0, n=2,
                                        seed=1234)
        assert [c.index for c in out.choices] == [0, 1]
        return [c.text for c in out.choices]

    first, second = sample(), sample()
    assert first == second
    assert first[0] != first[1]
    # Streamed, the two choices interleave by index and add up to the same texts.
    texts = ["", ""]
    for chunk in client.completions.create(model=spec_server.model, prompt="abc", max_tokens=10, temperature=1.0,
                                           n=2, seed=1234, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == first
    chat = client.chat.completions.create(model=spec_server.model, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=6, temperature=1.0, n=2, seed=7)
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content


def test_logprobs_shapes(spec_server):
    client = spec_server.client()
    out = client.completions.create(model=spec_server.model, prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(t.values()) - v) < 1e-9 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=spec_server.model, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)


def test_stop_string_and_extensions(spec_server, reference):
    completions, _, _ = reference
    text = completions[PROMPTS[2]]
    stop = text[4:6]
    client = spec_server.client()
    out = client.completions.create(model=spec_server.model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                    stop=stop)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == text[: text.index(stop)]
    out = client.completions.create(
        model=spec_server.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"speculation": {"enabled": False}, "top_k": 5, "ignore_eos": True},
    )
    assert out.choices[0].text == completions[PROMPTS[0]]
    assert out.usage.model_extra["speculative_decoding"]["drafts"] == 0


def test_models_health_and_spec_stats(spec_server):
    models = spec_server.client().models.list()
    assert [m.id for m in models.data] == [spec_server.model]
    assert httpx.get(f"{spec_server.url}/health", timeout=10).json() == {"status": "ok"}
    stats = httpx.get(f"{spec_server.url}/v1/spec/stats", headers=spec_server.auth,
                      timeout=10).json()
    assert stats["speculation"]["method"] == "ngram"
    assert stats["metrics"]["counters"]["drafts"] == spec_server.llm.get_metrics()["counters"]["drafts"]
