"""End to end on a tiny model: the four ways specd reports speculation agree exactly, with k varying.

One engine run (ngram proposer, heuristic k policy, greedy and sampled requests, one request stopped by a
stop token inside an accepted run) is read back four ways: the periodic log line, `LLM.get_metrics()`,
the Prometheus exposition and a recount of the JSONL trace. Integer counters must be equal, and so must
every pooled derived value (each is the same integer ratio). Float sums (phase seconds, means of
per-request values) are added in a different grouping by each writer, so those are compared to 1e-12.

The model is a tiny random Llama with its attention output muted: every next token then depends only on
the current one (a fixed token map), so prompts built from the map's own chains are copied exactly by
the n-gram proposer up to where they deviate. That gives long accepted runs, rejections and idle steps on
any machine, without relying on a random model happening to repeat itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.config import EngineConfig, SpeculationConfig
from specd.engine.outputs import RequestOutput
from specd.llm import LLM
from specd.metrics.log_sink import PREFIX
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.records import K0_CAUSES, SCALAR_METRICS, SpecCounters, StepDetail
from specd.metrics.trace import TraceRecord, read_trace, recount
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import Tokenizer
from specd.sampling.params import SamplingParams, SpecOverride
from specd.testing import byte_tokenizer, capture_specd_log, parse_log_line, tiny_hf_config_dict, tiny_specd_model

K_MAX = 4
MAX_TOKENS = 40
MODEL_LABEL = "tiny-bigram"
PER_POSITION = ("drafted_at", "reached_at", "accepted_at")
SECONDS = ("propose_s", "verify_s", "sample_s", "prefill_s")
# Log-line key -> get_metrics() counter name.
LOG_COUNTERS = {
    "steps": "steps", "spec_steps": "spec_steps", "drafts": "drafts", "draft_tokens": "draft_tokens",
    "accepted": "accepted_tokens", "emitted": "emitted_tokens", "nonspec_seq_steps": "nonspec_seq_steps",
    "nonspec_tokens": "nonspec_tokens", "drafted_at": "drafted_at", "reached_at": "reached_at",
    "accepted_at": "accepted_at", "accepted_len_hist": "accepted_length_hist",
    "prefill_steps": "prefill_steps", "prefill_only_steps": "prefill_only_steps", "prefill_tokens": "prefill_tokens",
}
# Log-line key -> get_metrics() pooled derived name.
LOG_DERIVED = {
    "acceptance_rate": "acceptance_rate_pooled", "mean_accepted_len": "mean_accepted_length_pooled",
    "accepted_tokens_per_draft": "accepted_tokens_per_draft_pooled",
    "tokens_per_seq_step": "tokens_per_seq_step_pooled",
    "tau": "mean_acceptance_length_pooled", "emitted_per_draft": "emitted_per_draft_pooled",
    "mean_proposed_len": "mean_proposed_length_pooled", "tokens_per_forward": "tokens_per_target_forward_pooled",
}


# ----------------------------------------------------------------------------------------- helpers


def _pooled(derived: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in derived.items() if key.endswith("_pooled")}


def _chunks_by_step(steps: tuple[StepDetail, ...], token_ids: list[int]) -> list[tuple[StepDetail, int]]:
    """(step, index of its first emitted token in the output) for every recorded step of one request."""
    out, start = [], 0
    for step in steps:
        out.append((step, start))
        start += step.emitted
    assert start == len(token_ids), "per-step emitted counts must add up to the output length"
    return out


def _first_token_inside_an_accepted_run(
    steps: tuple[StepDetail, ...], token_ids: list[int], tokenizer: Tokenizer | None = None
) -> int | None:
    """Output index of the first token that (a) is an accepted draft token that is not the last token its
    step emitted, so stopping there truncates an accepted run, and (b) is its own first occurrence in the
    output, so stopping on it (as a token id, or as a stop string when `tokenizer` is given) fires there.
    """
    for step, start in _chunks_by_step(steps, token_ids):
        for offset in range(min(step.accepted, step.emitted - 1)):
            index = start + offset
            token = token_ids[index]
            if token in token_ids[:index]:
                continue
            if tokenizer is None:
                return index
            text = tokenizer.decode([token])
            before = tokenizer.decode(token_ids[:index])
            if text and text.isascii() and text.isprintable() and before.isascii() and text not in before:
                return index
    return None


@dataclass
class Run:
    """One engine run read back every way: outputs, get_metrics(), log lines, Prometheus, trace file."""

    outputs: list[RequestOutput]
    metrics: dict[str, Any]
    log_lines: list[dict[str, Any]]
    prometheus: dict[str, dict[tuple[tuple[str, str], ...], float]]  # sample name -> labels -> value
    trace_path: Path
    stop_index: int
    stop_request: int


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def bigram_model() -> LlamaForCausalLM:
    model = tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float64)
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.zero_()  # attention contributes nothing: next token = f(current token)
    return model


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return byte_tokenizer(320)


def _ngram_config(**kw: Any) -> EngineConfig:
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=K_MAX, k_policy="heuristic")
    return EngineConfig(speculation=spec, max_model_len=256, max_num_seqs=8, **kw)


def _chain_prompts(model: LlamaForCausalLM, tokenizer: Tokenizer) -> dict[str, list[int]]:
    """Prompts built from the model's own continuations (chains of its token map), for the n-gram proposer.

    copy: the chain, then its start again: drafts copy the chain and are accepted.
    copy_with_error: the same with one wrong token: a rejection in the middle of a run.
    misleading: every chain token followed by a wrong one: every draft is rejected at once, so the
    heuristic policy walks k down 4, 3, 2, 1 to 0 and then only probes.
    """
    plain = LLM.from_model(model, tokenizer, EngineConfig(max_model_len=256, max_num_seqs=8))
    starts = [300, 72, 200, 150, 40]
    chains = [o.outputs[0].token_ids for o in plain.generate(
        prompt_token_ids=[[1, s] for s in starts],
        sampling_params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    )]
    copies = [[1, s, *c[:12], 7, s] for s, c in zip(starts, chains)]
    with_error = list(copies[1])
    with_error[6] = 9
    start, chain = starts[4], chains[4]
    wrong = [t for t in range(10, 100) if t not in chain and t != start]
    misleading = [1, start, *(t for pair in zip(chain, wrong) for t in pair), 7, start]
    return {"copy": copies[0], "copy_with_error": with_error, "copy_2": copies[2], "copy_3": copies[3],
            "misleading": misleading}


@pytest.fixture(scope="module")
def run(bigram_model, tokenizer, tmp_path_factory) -> Run:
    chains = _chain_prompts(bigram_model, tokenizer)
    text = tokenizer.encode("hello world, hello world, hello world, hello")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, spec_detail=True)
    requests = [
        (chains["copy"], greedy),
        (chains["copy_with_error"], greedy),
        (chains["copy_2"], greedy),  # stopped by a stop token inside an accepted run (set below)
        (chains["copy_3"], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1, ignore_eos=True)),
        (chains["misleading"], greedy),
        (text, greedy),
        (text, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=20, seed=2, ignore_eos=True)),
    ]
    prompts = [prompt for prompt, _ in requests]
    params = [p for _, p in requests]
    stop_request = 2

    # Find the stop token: the same request without it (alone: the model and k policy are per sequence).
    probe = LLM.from_model(bigram_model, tokenizer, _ngram_config())
    probe_out = probe.generate(prompt_token_ids=[prompts[stop_request]], sampling_params=greedy)[0]
    probe_ids = probe_out.outputs[0].token_ids
    stop_index = _first_token_inside_an_accepted_run(probe_out.spec_stats.steps, probe_ids)
    assert stop_index is not None, "no accepted run to stop inside: the prompts no longer make drafts accepted"
    params[stop_request] = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[probe_ids[stop_index]],
        spec_detail=True,
    )

    trace_path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, model=MODEL_LABEL, proposer="ngram", k_policy="heuristic", vllm_compat=True)
    # A short interval on the logger's own timer; close() logs the partial last one, so the lines cover the run.
    config = _ngram_config(log_stats_interval_s=0.05, spec_trace_path=str(trace_path))
    llm = LLM.from_model(bigram_model, tokenizer, config, stats_sinks=[sink])
    with capture_specd_log() as lines:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        llm.close()
    log_lines = [parse_log_line(line) for line in lines if line.startswith(PREFIX)]

    prometheus: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            prometheus[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return Run(outputs, llm.get_metrics(), log_lines, dict(prometheus), trace_path, stop_index, stop_request)


# --------------------------------------------------------------------------------------------- tests
def test_the_run_exercises_varying_k_rejections_and_a_stop(run: Run) -> None:
    records = [r for r in read_trace(run.trace_path) if isinstance(r, TraceRecord)]
    draft_ks = {r.k for r in records if r.k > 0}
    assert len(draft_ks) >= 3, f"k hardly varied across drafts: {sorted(draft_ks)}"
    seen: set[str] = set()
    decode_steps_without_draft = 0
    for r in records:  # a request's first record is its prefill step, always k = 0
        if r.request_id in seen and r.k == 0:
            decode_steps_without_draft += 1
        seen.add(r.request_id)
    assert decode_steps_without_draft > 0, "no decode step with k = 0 (heuristic at 0 or no n-gram match)"
    by_step: dict[int, set[int]] = defaultdict(set)
    for r in records:
        by_step[r.step].add(r.k)
    assert any(len(ks) > 1 for ks in by_step.values()), "k never differed between sequences of one step"
    c = run.metrics["counters"]
    assert 0 < c["accepted_tokens"] < c["draft_tokens"]
    assert c["accepted_length_hist"][0] > 0 and c["accepted_length_hist"][K_MAX] > 0  # full rejects and accepts
    # The misleading request: every draft rejected, so the heuristic took k from k_max down to 0.
    misleading = [(step.k, step.accepted) for step in run.outputs[4].spec_stats.steps]
    assert misleading[1:6] == [(4, 0), (3, 0), (2, 0), (1, 0), (0, 0)], misleading

    stopped = run.outputs[run.stop_request]
    assert stopped.outputs[0].finish_reason == "stop"
    assert len(stopped.outputs[0].token_ids) == run.stop_index + 1
    last = stopped.spec_stats.steps[-1]
    assert last.k >= 1 and last.emitted <= last.accepted  # the stop cut an accepted run: e_i < a_i + 1


def test_per_request_stats_add_up_to_the_global_counters_and_the_tokens(run: Run) -> None:
    total = SpecCounters.zero(K_MAX)
    for out in run.outputs:
        counters = out.spec_stats.counters
        total = total + counters
        # Every token a user received was counted once: by a draft (e_i) or by a k = 0 sequence-step.
        assert len(out.outputs[0].token_ids) == counters.emitted_tokens + counters.nonspec_tokens
    global_counters = {key: value for key, value in run.metrics["counters"].items() if key in total.to_dict()}
    assert total.to_dict() == global_counters
    assert run.metrics["per_request"]["finished_requests"] == len(run.outputs)
    for metric in SCALAR_METRICS:
        values = [getattr(out.spec_stats.counters, metric) for out in run.outputs]
        defined = [value for value in values if value is not None]
        assert run.metrics["per_request"]["defined_counts"][metric] == len(defined)
        assert run.metrics["derived"][f"{metric}_mean_per_request"] == pytest.approx(
            sum(defined) / len(defined), rel=1e-12
        )


def test_get_metrics_derived_values_follow_from_its_counters(run: Run, pooled_from_counters) -> None:
    assert _pooled(run.metrics["derived"]) == pooled_from_counters(run.metrics["counters"])


def test_log_lines_sum_to_get_metrics(run: Run, pooled_from_counters) -> None:
    c = run.metrics["counters"]
    assert run.log_lines and c["steps"] >= 10
    summed: dict[str, Any] = {}
    for line in run.log_lines:
        line_counters = {name: line[key] for key, name in LOG_COUNTERS.items()}
        # Each line agrees with itself: its derived values are its own counters' ratios, to 4 decimals.
        line_derived = pooled_from_counters(line_counters)
        for key, name in LOG_DERIVED.items():
            expected = line_derived[name]
            assert line[key] == (None if expected is None else round(expected, 4)), key
        for name, value in line_counters.items():
            if isinstance(value, list):
                summed[name] = [x + y for x, y in zip(summed.get(name, [0] * len(value)), value)]
            else:
                summed[name] = summed.get(name, 0) + value
    assert summed == {name: c[name] for name in LOG_COUNTERS.values()}
    assert sum(line["finished_requests"] for line in run.log_lines) == len(run.outputs)
    # Derived values of the whole run, recomputed from the summed lines, equal get_metrics() exactly.
    assert pooled_from_counters(summed) == _pooled(run.metrics["derived"])
    for key in SECONDS:  # printed with 6 decimals per line
        assert sum(line[key] for line in run.log_lines) == pytest.approx(c[key], abs=1e-6 * len(run.log_lines))


def test_prometheus_equals_get_metrics(run: Run, pooled_from_counters) -> None:
    c = run.metrics["counters"]
    labels = (("k_policy", "heuristic"), ("model", MODEL_LABEL), ("proposer", "ngram"))
    prom = run.prometheus

    def value(name: str, *extra: tuple[str, str]) -> float:
        return prom[name][tuple(sorted((*labels, *extra)))]

    scalars = {
        name: value(f"specd_spec_decode_{name}_total")
        for name in ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens", "steps", "spec_steps",
                     "nonspec_seq_steps", "nonspec_tokens", "prefill_steps", "prefill_tokens")
    }
    assert scalars == {name: c[name] for name in scalars}
    per_position = {
        name: [value(f"specd_spec_decode_{name}_position_total", ("position", str(j))) for j in range(1, K_MAX + 1)]
        for name in PER_POSITION
    }
    assert per_position == {name: c[name] for name in PER_POSITION}
    buckets = [value("specd_spec_decode_accepted_length_bucket", ("le", f"{float(a)}")) for a in range(K_MAX + 1)]
    assert buckets == list(accumulate(c["accepted_length_hist"]))
    assert value("specd_spec_decode_accepted_length_bucket", ("le", "+Inf")) == c["drafts"]
    assert value("specd_spec_decode_accepted_length_count") == c["drafts"]
    assert value("specd_spec_decode_accepted_length_sum") == c["accepted_tokens"]
    # The same counters under vLLM's names (position 0-based there).
    vllm = (("engine", "0"), ("model_name", MODEL_LABEL))
    assert prom["vllm:spec_decode_num_drafts_total"][vllm] == c["drafts"]
    assert prom["vllm:spec_decode_num_draft_tokens_total"][vllm] == c["draft_tokens"]
    assert prom["vllm:spec_decode_num_accepted_tokens_total"][vllm] == c["accepted_tokens"]
    assert [
        prom["vllm:spec_decode_num_accepted_tokens_per_pos_total"][(*vllm, ("position", str(j)))]
        for j in range(K_MAX)
    ] == c["accepted_at"]
    # Pooled derived values computed from the scraped counters (as PromQL would) equal get_metrics() exactly.
    scraped = {**scalars, **per_position, "accepted_length_hist": c["accepted_length_hist"]}
    assert pooled_from_counters(scraped) == _pooled(run.metrics["derived"])

    per_request = run.metrics["per_request"]
    tau_count = per_request["defined_counts"]["mean_acceptance_length"]
    assert value("specd_spec_decode_request_mean_acceptance_length_count") == tau_count
    tau_buckets = [value("specd_spec_decode_request_mean_acceptance_length_bucket", ("le", str(le)))
                   for le in per_request["tau_hist"]["le"]]
    assert tau_buckets == list(accumulate(per_request["tau_hist"]["counts"]))
    assert value("specd_spec_decode_request_mean_acceptance_length_sum") == pytest.approx(
        run.metrics["derived"]["mean_acceptance_length_mean_per_request"] * tau_count, rel=1e-12
    )
    for phase in ("propose", "verify", "sample", "prefill"):
        count = c["prefill_steps"] if phase == "prefill" else c["steps"]
        assert value("specd_spec_decode_phase_seconds_count", ("phase", phase)) == count
        assert value("specd_spec_decode_phase_seconds_sum", ("phase", phase)) == pytest.approx(
            c[f"{phase}_s"], rel=1e-12
        )


def test_trace_recount_equals_get_metrics(run: Run) -> None:
    recounted = recount(read_trace(run.trace_path), K_MAX).to_dict()
    ours = run.metrics
    seconds = set(SECONDS)
    assert {k: v for k, v in recounted["counters"].items() if k not in seconds} == {
        k: v for k, v in ours["counters"].items() if k not in seconds
    }
    for key in SECONDS:
        assert recounted["counters"][key] == pytest.approx(ours["counters"][key], rel=1e-12)
    assert _pooled(recounted["derived"]) == _pooled(ours["derived"])
    for metric in SCALAR_METRICS:
        assert recounted["derived"][f"{metric}_mean_per_request"] == pytest.approx(
            ours["derived"][f"{metric}_mean_per_request"], rel=1e-12
        )
    assert recounted["per_request"] == ours["per_request"]


def test_stop_string_inside_an_accepted_run_shows_accepted_above_emitted(bigram_model, tokenizer) -> None:
    """a_i is the verifier's decision, e_i what the user got: a stop string inside an accepted run makes
    the last step's a_i > e_i - 1, and the request's accepted tokens exceed the accepted tokens it emitted."""
    prompt = _chain_prompts(bigram_model, tokenizer)["copy"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, spec_detail=True)
    probe = LLM.from_model(bigram_model, tokenizer, _ngram_config())
    probe_out = probe.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    probe_ids = probe_out.outputs[0].token_ids
    index = _first_token_inside_an_accepted_run(probe_out.spec_stats.steps, probe_ids, tokenizer)
    assert index is not None
    stop = tokenizer.decode([probe_ids[index]])

    llm = LLM.from_model(bigram_model, tokenizer, _ngram_config())
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, spec_detail=True, stop=[stop]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == probe_ids[: index + 1]  # the token holding the stop string is kept
    assert out.outputs[0].text == tokenizer.decode(probe_ids[:index])  # the text stops before it
    stats = out.spec_stats
    last = stats.steps[-1]
    assert last.k >= 1 and last.accepted > last.emitted - 1
    drafts = [step for step in stats.steps if step.k > 0]
    accepted_and_emitted = sum(min(step.accepted, step.emitted) for step in drafts)
    assert stats.accepted_tokens == sum(step.accepted for step in drafts)
    assert stats.accepted_tokens > accepted_and_emitted
    assert stats.emitted_tokens == sum(step.emitted for step in drafts) < stats.accepted_tokens + stats.drafts
    # The global counters keep the same distinction (this engine ran only this request).
    counters = llm.get_metrics()["counters"]
    assert (counters["accepted_tokens"], counters["emitted_tokens"]) == (stats.accepted_tokens, stats.emitted_tokens)


def test_prefill_only_steps_are_recorded_everywhere_with_prefill_time_apart(bigram_model, tokenizer, tmp_path) -> None:
    """Long prompts and a small token budget: chunked prefill makes steps that sample nothing. They count in
    steps, the prefill totals, the trace and Prometheus; mixed steps split the forward into prefill and verify."""
    trace_path = tmp_path / "trace.jsonl"
    registry = CollectorRegistry()
    config = EngineConfig(
        speculation=SpeculationConfig(method="ngram", num_speculative_tokens=K_MAX, k_policy="heuristic"),
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24, spec_trace_path=str(trace_path),
    )
    sink = PrometheusSink(registry, model=MODEL_LABEL, proposer="ngram", k_policy="heuristic")
    llm = LLM.from_model(bigram_model, tokenizer, config, stats_sinks=[sink])
    prompts = [[1, *range(10 + i, 10 + i + 90)] for i in range(3)]
    llm.generate(prompt_token_ids=prompts,
                 sampling_params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.close()
    c = llm.get_metrics()["counters"]
    assert c["prefill_tokens"] == sum(len(p) for p in prompts)
    assert c["prefill_only_steps"] >= 3  # 91-token prompts through a 24-token budget
    assert c["prefill_steps"] > c["prefill_only_steps"]  # and some steps mix chunks with decoding rows
    sampled_steps = {line.step for line in read_trace(trace_path) if isinstance(line, TraceRecord)}
    assert c["steps"] == len(sampled_steps) + c["prefill_only_steps"]
    assert c["prefill_s"] > 0 and c["verify_s"] > 0
    recounted = recount(read_trace(trace_path), K_MAX).to_dict()["counters"]
    assert {k: v for k, v in recounted.items() if k not in SECONDS} == {
        k: v for k, v in c.items() if k not in SECONDS
    }
    for key in SECONDS:
        assert recounted[key] == pytest.approx(c[key], rel=1e-12)
    text = generate_latest(registry).decode()
    labels = f'{{k_policy="heuristic",model="{MODEL_LABEL}",proposer="ngram"}}'
    assert f"specd_spec_decode_steps_total{labels} {float(c['steps'])}" in text
    assert f"specd_spec_decode_prefill_tokens_total{labels} {float(c['prefill_tokens'])}" in text


def test_proposed_tokens_and_k0_causes_add_up(run: Run) -> None:
    c = run.metrics["counters"]
    causes = c["nonspec_by_cause"]
    assert c["proposed_tokens"] == c["draft_tokens"] + c["cut_policy_tokens"] + c["cut_grammar_tokens"]
    assert c["cut_grammar_tokens"] == 0  # no grammar in this run
    assert sum(causes.values()) == c["nonspec_seq_steps"]
    assert causes["first_token"] == len(run.outputs)  # every request's first token comes from its prompt's last chunk
    assert causes["other"] == 0 and causes["disabled"] == 0 and causes["grammar"] == 0
    assert causes["policy"] > 0  # the heuristic policy walks k down to 0 on the misleading prompt
    assert causes["max_tokens"] > 0  # no drafts when one token is left
    labels = (("k_policy", "heuristic"), ("model", MODEL_LABEL), ("proposer", "ngram"))
    prom = run.prometheus
    assert prom["specd_spec_decode_proposed_tokens_total"][labels] == c["proposed_tokens"]
    assert prom["specd_spec_decode_cut_tokens_total"][tuple(sorted((*labels, ("cause", "policy"))))] == (
        c["cut_policy_tokens"])
    for cause, count in causes.items():
        assert prom["specd_spec_decode_nonspec_seq_steps_by_cause_total"][tuple(sorted((*labels, ("cause", cause))))] \
            == count
    summed = {key: sum(line[f"k0_{key}"] for line in run.log_lines) for key in causes}
    assert summed == causes
    assert sum(line["proposed"] for line in run.log_lines) == c["proposed_tokens"]


def test_goodput_cuts_and_disabled_requests_are_counted(bigram_model, tokenizer) -> None:
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=K_MAX, k_policy="goodput")
    llm = LLM.from_model(bigram_model, tokenizer, EngineConfig(speculation=spec, max_model_len=256, max_num_seqs=4))
    chains = _chain_prompts(bigram_model, tokenizer)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    off = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, speculation=SpecOverride(enabled=False))
    outs = llm.generate(prompt_token_ids=[chains["copy"], chains["misleading"], chains["copy_2"]],
                        sampling_params=[greedy, greedy, off])
    c = llm.get_metrics()["counters"]
    assert c["proposed_tokens"] == c["draft_tokens"] + c["cut_policy_tokens"] + c["cut_grammar_tokens"]
    assert sum(c["nonspec_by_cause"].values()) == c["nonspec_seq_steps"]
    assert c["cut_policy_tokens"] > 0  # goodput keeps a prefix of what the proposer found: the rest is counted
    assert c["nonspec_by_cause"]["no_match"] > 0  # the misleading prompt gives the proposer nothing to copy
    assert c["nonspec_by_cause"]["disabled"] == 4  # the speculation-off request's 5 tokens, the first from prefill
    off_stats = outs[2].spec_stats.counters
    assert off_stats.nonspec_by_cause[K0_CAUSES.index("disabled")] == 4 and off_stats.proposed_tokens == 0


def test_wasted_work_is_recounted_from_the_trace_lines(run: Run) -> None:
    """rejected = T - A and tokens computed past a stop = Σ (a_i + 1 - e_i), recounted from the trace's (k, a, e)
    with plain loops; the stop token inside an accepted run makes the second one non-zero."""
    records = [r for r in read_trace(run.trace_path) if isinstance(r, TraceRecord)]
    rejected = sum(r.k - r.accepted for r in records)
    past_stop = sum(r.accepted + 1 - r.emitted for r in records)
    c = run.metrics["counters"]
    assert (c["rejected_tokens"], c["past_stop_tokens"]) == (rejected, past_stop)
    assert rejected > 0 and past_stop > 0
    labels = (("k_policy", "heuristic"), ("model", MODEL_LABEL), ("proposer", "ngram"))
    assert run.prometheus["specd_spec_decode_rejected_tokens_total"][labels] == rejected
    assert run.prometheus["specd_spec_decode_past_stop_tokens_total"][labels] == past_stop
    assert sum(line["rejected"] for line in run.log_lines) == rejected
    assert sum(line["past_stop"] for line in run.log_lines) == past_stop
    # ngram looks drafts up: no draft-model forward anywhere.
    assert c["draft_forwards"] == c["draft_tokens_computed"] == 0
    assert run.prometheus["specd_spec_decode_draft_forwards_total"][labels] == 0
