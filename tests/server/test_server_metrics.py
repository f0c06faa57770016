"""/metrics agrees with what the responses reported: speculation counters equal the sum of usage figures."""

from __future__ import annotations

import asyncio

PROMPTS = ["abc abc abc abc abc abc abc", "one two one two one two one two", "xyzxyzxyzxyzxyz"]


def _spec(usage) -> dict:
    return usage.model_extra["speculative_decoding"]


def test_spec_counters_equal_sum_of_usage(spec_server):
    model = spec_server.model
    labels = (("k_policy", "heuristic"), ("model", model), ("proposer", "ngram"))
    names = ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens")
    before = spec_server.metrics()
    client = spec_server.client()
    usages = []
    for prompt in PROMPTS:
        usages.append(client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).usage)
    usages.append(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24, temperature=0.8, n=2,
        seed=3).usage)
    stream = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usages.append(list(stream)[-1].usage)

    async def concurrent() -> list:
        async_client = spec_server.async_client()
        try:
            outs = await asyncio.wait_for(asyncio.gather(*[
                async_client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0) for p in PROMPTS
            ]), timeout=120)
        finally:
            await async_client.close()
        return [o.usage for o in outs]

    usages.extend(asyncio.run(concurrent()))
    after = spec_server.metrics()

    def delta(name: str, sample_labels: tuple) -> float:
        return after.get((name, sample_labels), 0.0) - before.get((name, sample_labels), 0.0)

    summed = {name: sum(_spec(u)[name] for u in usages) for name in names}
    assert summed["drafts"] > 0 and summed["draft_tokens"] >= summed["drafts"]
    for name in names:
        assert delta(f"specd_spec_decode_{name}_total", labels) == summed[name], name
    # Per-request ratios are the ratios of that request's sums.
    for usage in usages:
        spec = _spec(usage)
        if spec["drafts"]:
            assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
            assert spec["mean_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["drafts"]
    # Request-level counters: one finished engine request per choice, their generated tokens.
    model_labels = (("model", model),)
    num_choices = len(usages) + 1  # the chat request had n = 2
    finished = sum(delta("specd_request_finished_total", (("finish_reason", reason), ("model", model)))
                   for reason in ("length", "stop"))
    assert finished == num_choices
    assert delta("specd_generation_tokens_total", model_labels) == sum(u.completion_tokens for u in usages)
    assert delta("specd_time_to_first_token_seconds_count", model_labels) == num_choices
    assert delta("specd_e2e_request_latency_seconds_count", model_labels) == num_choices
    assert after[("specd_num_requests_running", model_labels)] == 0


def test_n2_counts_one_http_request_and_two_choices(spec_server):
    """n > 1: the engine-level figures count choices, the http_* counters and usage count the HTTP request."""
    model = spec_server.model
    model_labels = (("model", model),)
    before = spec_server.metrics()
    client = spec_server.client()
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=16, temperature=0.8, n=2, seed=5)
    single = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    after = spec_server.metrics()

    def delta(name: str, sample_labels: tuple) -> float:
        return after.get((name, sample_labels), 0.0) - before.get((name, sample_labels), 0.0)

    assert len(out.choices) == 2
    assert _spec(out.usage)["choices"] == 2 and _spec(single.usage)["choices"] == 1
    assert delta("specd_http_requests_total", model_labels) == 2
    assert delta("specd_http_request_choices_total", model_labels) == 3
    finished = sum(delta("specd_request_finished_total", (("finish_reason", reason), ("model", model)))
                   for reason in ("length", "stop"))
    assert finished == 3  # per choice
    # The usage of the n = 2 request sums both choices: with the single request it makes the Prometheus delta.
    labels = (("k_policy", "heuristic"), ("model", model), ("proposer", "ngram"))
    for name in ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens"):
        summed = _spec(out.usage)[name] + _spec(single.usage)[name]
        assert delta(f"specd_spec_decode_{name}_total", labels) == summed, name
