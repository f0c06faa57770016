"""--vllm-compat-metrics keeps its promise: vLLM v1's names of the request figures specd measures carry the same
values as specd's own, and the vllm:spec_decode_* families exist only while the engine speculates. Without the
flag, /metrics has no vllm: name at all."""

from __future__ import annotations

from collections import defaultdict

import pytest
from prometheus_client import CollectorRegistry

from specd.config import SpeculationConfig

PROMPTS = ["abc abc abc abc abc abc abc", "one two one two one two one two", "xyzxyzxyzxyzxyz"]
# vLLM name -> specd name of the same figure (histograms compared by _count and _sum).
SAME_FIGURE = {
    "vllm:prompt_tokens_total": "specd_prompt_tokens_total",
    "vllm:generation_tokens_total": "specd_generation_tokens_total",
    "vllm:time_to_first_token_seconds_count": "specd_time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "specd_time_to_first_token_seconds_sum",
    "vllm:e2e_request_latency_seconds_count": "specd_e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "specd_e2e_request_latency_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count": "specd_time_per_output_token_seconds_count",
    "vllm:request_time_per_output_token_seconds_sum": "specd_time_per_output_token_seconds_sum",
    "vllm:num_requests_running": "specd_num_requests_running",
    "vllm:num_requests_waiting": "specd_num_requests_waiting",
}


def _by_name(samples: dict) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = defaultdict(dict)
    for (name, labels), value in samples.items():
        out[name][labels] = value
    return out


def _traffic(server) -> int:
    """Three completions and one chat request with n = 2; returns the completion tokens of all choices."""
    client = server.client()
    tokens = 0
    for prompt in PROMPTS:
        tokens += client.completions.create(model=server.model, prompt=prompt, max_tokens=20, temperature=0).usage \
            .completion_tokens
    tokens += client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12, temperature=0.8, n=2,
        seed=1).usage.completion_tokens
    return tokens


@pytest.mark.parametrize("method", ["ngram", "off"])
def test_compat_names_carry_specd_values_and_spec_families_only_when_speculating(make_llm, start_server, method):
    registry = CollectorRegistry()
    spec = SpeculationConfig(method=method, num_speculative_tokens=4, k_policy="heuristic" if method != "off"
                             else "fixed")
    llm = make_llm(registry, speculation=spec, vllm_compat=True, max_num_seqs=4)
    with start_server(llm, registry, vllm_compat_metrics=True) as server:
        completion_tokens = _traffic(server)
        server.wait_for(lambda: server.metrics().get(
            ("specd_request_finished_total", (("finish_reason", "length"), ("model", server.model))), 0)
            + server.metrics().get(
            ("specd_request_finished_total", (("finish_reason", "stop"), ("model", server.model))), 0) == 5)
        samples = _by_name(server.metrics())
    vllm_labels = (("engine", "0"), ("model_name", server.model))
    specd_labels = (("model", server.model),)
    for vllm_name, specd_name in SAME_FIGURE.items():
        assert samples[vllm_name] == {vllm_labels: samples[specd_name][specd_labels]}, vllm_name
    assert samples["vllm:generation_tokens_total"][vllm_labels] == completion_tokens
    success = {dict(labels)["finished_reason"]: value
               for labels, value in samples["vllm:request_success_total"].items()}
    finished = {dict(labels)["finish_reason"]: value
                for labels, value in samples["specd_request_finished_total"].items()}
    assert success == finished and sum(success.values()) == 5  # per choice, as vLLM counts
    assert samples["vllm:e2e_request_latency_seconds_count"][vllm_labels] == 5
    counters = llm.get_metrics()["counters"]
    spec_families = {name for name in samples if name.startswith("vllm:spec_decode")}
    if method == "off":
        assert spec_families == set()  # no speculation, no vLLM spec families (vLLM has none either)
        assert samples["specd_spec_decode_steps_total"]  # specd's own counters still say what ran
    else:
        assert samples["vllm:spec_decode_num_drafts_total"][vllm_labels] == counters["drafts"] > 0
        assert samples["vllm:spec_decode_num_accepted_tokens_total"][vllm_labels] == counters["accepted_tokens"]
    own = {labels for name, by_labels in samples.items() if name.startswith("specd_spec_decode")
           for labels in by_labels}
    assert all(("k_policy", spec.k_policy) in labels for labels in own)


def test_without_the_flag_no_vllm_name_is_exported(spec_server):
    spec_server.client().completions.create(model=spec_server.model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    names = {name for name, _ in spec_server.metrics()}
    assert "specd_generation_tokens_total" in names and "specd_spec_decode_drafts_total" in names
    assert not [name for name in names if name.startswith("vllm:")]
