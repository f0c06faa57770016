"""The four metric views agree exactly on the real default model (ngram proposer, heuristic k policy).

Same checks as tests/metrics/test_metrics_end_to_end.py, on SmolLM2 with chat prompts whose answers copy
from the prompt, so the n-gram proposer's drafts are partly accepted: the periodic log line (summed over
intervals), `get_metrics()`, the Prometheus exposition and a recount of the JSONL trace.
"""

from __future__ import annotations

import logging
from itertools import pairwise
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.config import SpeculationConfig
from specd.llm import LLM
from specd.metrics.log_sink import PREFIX
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.records import SpecCounters
from specd.metrics.trace import TraceRecord, read_trace, recount
from specd.sampling.params import SamplingParams
from specd.testing import parse_log_line

pytestmark = pytest.mark.integration

K_MAX = 4
MESSAGES = [
    [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}],
    [{"role": "user", "content": "Repeat exactly: one, two, three, four, five, six, seven, eight."}],
    [{"role": "user", "content": "Repeat exactly: Alice sent the report to Bob on Monday morning."}],
]
# get_metrics() counter name -> log-line key.
LOG_KEYS = {
    "steps": "steps", "spec_steps": "spec_steps", "drafts": "drafts", "draft_tokens": "draft_tokens",
    "accepted_tokens": "accepted", "emitted_tokens": "emitted", "nonspec_seq_steps": "nonspec_seq_steps",
    "nonspec_tokens": "nonspec_tokens", "drafted_at": "drafted_at", "reached_at": "reached_at",
    "accepted_at": "accepted_at", "accepted_length_hist": "accepted_len_hist",
}
SCALAR_COUNTERS = [name for name in LOG_KEYS if name not in ("drafted_at", "reached_at", "accepted_at",
                                                              "accepted_length_hist")]




def _from_log(lines: list[dict[str, Any]]) -> dict[str, Any]:
    summed: dict[str, Any] = {}
    for line in lines:
        for name, key in LOG_KEYS.items():
            value = line[key]
            if isinstance(value, list):
                summed[name] = [x + y for x, y in zip(summed.get(name, [0] * len(value)), value)]
            else:
                summed[name] = summed.get(name, 0) + value
    return summed


def _from_prometheus(registry: CollectorRegistry) -> dict[str, Any]:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.labels.get("model") == "default" and sample.labels.get("proposer") == "ngram":
                own = ("model", "proposer", "k_policy")
                extra = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in own))
                samples[sample.name, extra] = sample.value
    out: dict[str, Any] = {name: samples[f"specd_spec_decode_{name}_total", ()] for name in SCALAR_COUNTERS}
    for name in ("drafted_at", "reached_at", "accepted_at"):
        out[name] = [samples[f"specd_spec_decode_{name}_position_total", (("position", str(j)),)]
                     for j in range(1, K_MAX + 1)]
    cumulative = [samples["specd_spec_decode_accepted_length_bucket", (("le", f"{float(a)}"),)]
                  for a in range(K_MAX + 1)]
    out["accepted_length_hist"] = [cumulative[0], *(b - a for a, b in pairwise(cumulative))]
    assert samples["specd_spec_decode_accepted_length_sum", ()] == out["accepted_tokens"]
    assert samples["specd_spec_decode_accepted_length_count", ()] == out["drafts"] == cumulative[-1]
    return out


def test_four_metric_views_agree_on_the_default_model(tmp_path, caplog, pooled_from_counters) -> None:
    trace_path = tmp_path / "trace.jsonl"
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, model="default", proposer="ngram", k_policy="heuristic")
    llm = LLM(
        "default",
        max_model_len=512,
        speculation=SpeculationConfig(method="ngram", num_speculative_tokens=K_MAX, k_policy="heuristic"),
        stats_sinks=[sink],
        log_stats_interval_s=0.05,  # on the logger's timer; close() logs the rest, so the lines cover the run
        spec_trace_path=str(trace_path),
    )
    caplog.set_level(logging.INFO, logger="specd")
    outputs = llm.chat(MESSAGES, SamplingParams(max_tokens=32, temperature=0.0))
    llm.close()
    metrics = llm.get_metrics()
    counters = metrics["counters"]
    ints = {name: counters[name] for name in LOG_KEYS}
    assert counters["drafts"] > 0 and counters["accepted_tokens"] > 0, "the answers should copy the prompt"
    # The copied sentence ends where the prompt's does, so the drafts run on into <|im_end|> (EOS): the
    # verifier accepts it and what follows, but nothing after EOS is emitted, so e_i < a_i + 1 there.
    assert counters["emitted_tokens"] < counters["accepted_tokens"] + counters["drafts"]

    # 1. Log lines, summed over intervals.
    lines = [parse_log_line(r.getMessage()) for r in caplog.records if r.getMessage().startswith(PREFIX)]
    assert lines
    summed = _from_log(lines)
    assert summed == ints
    assert sum(line["finished_requests"] for line in lines) == len(MESSAGES)
    # 2. get_metrics(): its derived values are its counters' ratios; the same ratios from every view below.
    pooled = {key: value for key, value in metrics["derived"].items() if key.endswith("_pooled")}
    assert pooled_from_counters(counters) == pooled
    assert pooled_from_counters(summed) == pooled
    # 3. Prometheus.
    scraped = _from_prometheus(registry)
    assert scraped == ints
    assert pooled_from_counters(scraped) == pooled
    # 4. Trace recount.
    records = read_trace(trace_path)
    recounted = recount(records, K_MAX).to_dict()
    seconds = ("propose_s", "verify_s", "sample_s")
    assert {k: v for k, v in recounted["counters"].items() if k not in seconds} == {
        k: v for k, v in counters.items() if k not in seconds
    }
    assert {key: value for key, value in recounted["derived"].items() if key.endswith("_pooled")} == pooled
    assert recounted["per_request"] == metrics["per_request"]
    # Per request: the counters add up to the global ones, and to the tokens each user received.
    total = SpecCounters.zero(K_MAX)
    for out in outputs:
        total = total + out.spec_stats.counters
        assert len(out.outputs[0].token_ids) == out.spec_stats.counters.total_emitted_tokens
    assert total.to_dict() == {key: counters[key] for key in total.to_dict()}
    # The heuristic policy and n-gram matches made k vary between drafts.
    assert len({r.k for r in records if isinstance(r, TraceRecord) and r.k > 0}) > 1
