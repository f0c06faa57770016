"""Drafting work end to end: a draft model's forward passes and the positions they computed, counted by a wrapper
around the model itself, equal what get_metrics(), Prometheus, the log line and a trace recount report; with the
confidence policy more positions are computed than proposed (the ones its stop rule dropped)."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.metrics.log_sink import PREFIX
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.trace import read_trace, recount
from specd.sampling.params import SamplingParams
from specd.speculation.draft import DraftModelProposer
from specd.testing import CountingModel, capture_specd_log, parse_log_line


def test_draft_forwards_and_computed_positions_agree_everywhere(tiny_model, tokenizer, tmp_path) -> None:
    counting = CountingModel(tiny_model)
    proposer = DraftModelProposer(counting, 4, 256, num_layers=1)  # type: ignore[arg-type]
    spec = SpeculationConfig(method="layerskip", num_speculative_tokens=4, k_policy="confidence",
                             confidence_threshold=0.05)
    trace_path = tmp_path / "trace.jsonl"
    config = EngineConfig(speculation=spec, max_num_seqs=4, max_model_len=256, spec_trace_path=str(trace_path),
                          log_stats_interval_s=0.05)
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, model="tiny", proposer="layerskip", k_policy="confidence")
    llm = LLM.from_model(tiny_model, tokenizer, config, stats_sinks=[sink], proposer=proposer)
    with capture_specd_log() as log_lines:
        llm.generate(["abcabcabc", "hello hello hello", "the quick brown"],
                     SamplingParams(max_tokens=30, temperature=0.0))
        llm.close()
    c = llm.get_metrics()["counters"]
    assert counting.calls > 0
    assert (c["draft_forwards"], c["draft_tokens_computed"]) == (counting.calls, counting.rows)
    # Every proposed token was computed; the confidence stop dropped some computed positions.
    assert c["draft_tokens_computed"] > c["proposed_tokens"] > 0
    samples: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[sample.name] += sample.value
    assert samples["specd_spec_decode_draft_forwards_total"] == counting.calls
    assert samples["specd_spec_decode_draft_tokens_computed_total"] == counting.rows
    lines = [parse_log_line(line) for line in log_lines if line.startswith(PREFIX)]
    assert sum(line["draft_forwards"] for line in lines) == counting.calls
    assert sum(line["draft_tokens_computed"] for line in lines) == counting.rows
    recounted = recount(read_trace(trace_path), 4).to_dict()["counters"]
    assert (recounted["draft_forwards"], recounted["draft_tokens_computed"]) == (counting.calls, counting.rows)
