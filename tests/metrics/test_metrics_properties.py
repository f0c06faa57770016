"""Property tests: random step sequences through the recorder with every sink attached, checked against
a brute-force recount written straight from the definitions in docs/metrics.md."""

from __future__ import annotations

import ast
import tempfile
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.metrics.log_sink import format_log_line
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.records import K0_CAUSES, SCALAR_METRICS, K0Cause, SpecCounters
from specd.metrics.snapshots import SpecMetricsSnapshot, tau_bucket_bounds
from specd.metrics.stats import RequestSpecStats, SpecStatsRecorder, StepPhaseTimes
from specd.metrics.trace import TraceSink, read_trace, recount
from specd.testing import parse_log_line

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Step:
    request_ids: list[str]
    rows: list[tuple[int, int, int]]  # (k, a, e) per sequence
    drafting: list[tuple[int, int, K0Cause]]  # (proposed p >= k, grammar cut g <= p - k, k = 0 cause) per sequence
    times: StepPhaseTimes
    draft_work: tuple[int, int]  # (draft-model forwards, draft positions computed) of the step
    finish_after: list[str]
    take_interval_after: bool


@dataclass
class Scenario:
    k_max: int
    fixed_k: int | None
    steps: list[Step]


@st.composite
def scenarios(draw: Any, fixed_k: bool = False) -> Scenario:
    k_max = draw(st.integers(1 if fixed_k else 0, 6))
    k_fixed = draw(st.integers(1, k_max)) if fixed_k else None
    prefixes = ["req-", 'q"\\-', "é✓ "]  # ids that need JSON escaping must survive the trace
    live: list[str] = []
    next_id = 0
    steps = []
    for _ in range(draw(st.integers(1, 20))):
        for _ in range(draw(st.integers(0 if live else 1, 3))):
            live.append(f"{draw(st.sampled_from(prefixes))}{next_id}")
            next_id += 1
        batch = draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        rows, drafting = [], []
        for _ in batch:
            k = k_fixed if k_fixed is not None else draw(st.integers(0, k_max))
            a = draw(st.integers(0, k))
            e = draw(st.integers(0, a + 1))  # e < a + 1: a stop string / EOS truncated the accepted run
            rows.append((k, a, e))
            proposed = draw(st.integers(k, k_max))
            drafting.append((proposed, draw(st.integers(0, proposed - k)), draw(st.sampled_from(K0_CAUSES))))
        times = StepPhaseTimes(*(draw(st.floats(0, 0.5, allow_nan=False)) for _ in range(3)))
        finish = draw(st.lists(st.sampled_from(live), max_size=2, unique=True))
        live = [request_id for request_id in live if request_id not in finish]
        draft_work = (draw(st.integers(0, k_max)), draw(st.integers(0, 3 * k_max)))
        steps.append(Step(batch, rows, drafting, times, draft_work, finish, draw(st.booleans())))
    if live:
        steps[-1].finish_after.extend(live)
    return Scenario(k_max, k_fixed, steps)


@dataclass
class Run:
    recorder: SpecStatsRecorder
    intervals: list[SpecMetricsSnapshot]
    finished: dict[str, RequestSpecStats]
    exposition: str
    trace_snapshot: SpecMetricsSnapshot
    rows: list[tuple[int, str, int, int, int]] = field(default_factory=list)  # (step, id, k, a, e)
    drafting: list[tuple[int, int, K0Cause]] = field(default_factory=list)  # aligned with rows


def run(scenario: Scenario) -> Run:
    registry = CollectorRegistry()
    prometheus = PrometheusSink(registry, model="m", proposer="ngram", k_policy="heuristic", vllm_compat=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.jsonl"
        with TraceSink(trace_path) as trace:
            recorder = SpecStatsRecorder(scenario.k_max, sinks=[prometheus, trace])
            intervals, finished, rows, drafting = [], {}, [], []
            for index, step in enumerate(scenario.steps):
                counts = torch.tensor(step.rows, dtype=torch.int64).T  # [3, num_seqs]
                recorder.record_step(
                    step.request_ids, counts, step.times, num_proposed=[p for p, _, _ in step.drafting],
                    num_grammar_cut=[g for _, g, _ in step.drafting], k0_causes=[c for _, _, c in step.drafting],
                    num_draft_forwards=step.draft_work[0], num_computed_draft_tokens=step.draft_work[1],
                )
                rows += [(index, rid, *row) for rid, row in zip(step.request_ids, step.rows)]
                drafting += step.drafting
                for request_id in step.finish_after:
                    finished[request_id] = recorder.finish_request(request_id)
                if step.take_interval_after:
                    intervals.append(recorder.take_interval())
            intervals.append(recorder.take_interval())
        trace_snapshot = recount(read_trace(trace_path), scenario.k_max)
    return Run(recorder, intervals, finished, generate_latest(registry).decode(), trace_snapshot, rows, drafting)


def brute_force(
    rows: list[tuple[int, str, int, int, int]], drafting: list[tuple[int, int, K0Cause]], k_max: int
) -> dict[str, Any]:
    """The definitions, literally."""
    drafts = [(k, a, e) for _, _, k, a, e in rows if k >= 1]
    positions = range(1, k_max + 1)
    return {
        "proposed_tokens": sum(p for p, _, _ in drafting),
        "cut_grammar_tokens": sum(g for _, g, _ in drafting),
        "cut_policy_tokens": sum(p - row[2] - g for row, (p, g, _) in zip(rows, drafting)),
        "nonspec_by_cause": {
            cause: sum(1 for row, (_, _, c) in zip(rows, drafting) if row[2] == 0 and c == cause)
            for cause in K0_CAUSES
        },
        "drafts": len(drafts),
        "draft_tokens": sum(k for k, _, _ in drafts),
        "accepted_tokens": sum(a for _, a, _ in drafts),
        "emitted_tokens": sum(e for _, _, e in drafts),
        "nonspec_seq_steps": sum(1 for _, _, k, _, _ in rows if k == 0),
        "nonspec_tokens": sum(e for _, _, k, _, e in rows if k == 0),
        "rejected_tokens": sum(k - a for _, _, k, a, _ in rows),
        "past_stop_tokens": sum(a + 1 - e for _, _, _, a, e in rows),
        "target_forward_seq_steps": len(rows),
        "drafted_at": [sum(1 for k, _, _ in drafts if k >= j) for j in positions],
        "reached_at": [sum(1 for k, a, _ in drafts if k >= j and a >= j - 1) for j in positions],
        "accepted_at": [sum(1 for _, a, _ in drafts if a >= j) for j in positions],
        "accepted_length_hist": [sum(1 for _, a, _ in drafts if a == length) for length in range(k_max + 1)],
        "joint_hist": [
            [sum(1 for k, a, _ in drafts if (k, a) == (kk, aa)) for aa in range(k_max + 1)] for kk in positions
        ],
    }


def assert_counters_equal_brute(
    counters: SpecCounters, rows: list[tuple[int, str, int, int, int]], drafting: list[tuple[int, int, K0Cause]]
) -> None:
    expected = brute_force(rows, drafting, counters.k_max)
    actual = counters.to_dict()
    assert {key: actual[key] for key in expected} == expected


@SETTINGS
@given(scenarios())
def test_counters_equal_brute_force_recount(scenario: Scenario) -> None:
    result = run(scenario)
    snapshot = result.recorder.snapshot()
    assert_counters_equal_brute(snapshot.counters, result.rows, result.drafting)
    assert snapshot.step_totals.steps == len(scenario.steps)
    assert snapshot.step_totals.spec_steps == sum(1 for s in scenario.steps if any(k for k, _, _ in s.rows))
    assert snapshot.step_totals.verify_s == pytest.approx(sum(s.times.verify_s for s in scenario.steps))
    assert snapshot.step_totals.draft_forwards == sum(s.draft_work[0] for s in scenario.steps)
    assert snapshot.step_totals.draft_tokens_computed == sum(s.draft_work[1] for s in scenario.steps)
    # Every request's counters match a brute force over its own rows.
    for request_id, stats in result.finished.items():
        mine = [index for index, row in enumerate(result.rows) if row[1] == request_id]
        assert_counters_equal_brute(
            stats.counters, [result.rows[i] for i in mine], [result.drafting[i] for i in mine]
        )


@SETTINGS
@given(scenarios())
def test_invariants(scenario: Scenario) -> None:
    counters = run(scenario).recorder.snapshot().counters
    k_max = scenario.k_max
    assert counters.accepted_tokens <= counters.draft_tokens
    assert counters.emitted_tokens <= counters.accepted_tokens + counters.drafts
    if counters.drafts:
        assert 0 <= Fraction(counters.accepted_tokens, counters.drafts) <= k_max
        assert counters.accepted_tokens_per_draft is not None and 0.0 <= counters.accepted_tokens_per_draft <= k_max
        assert counters.mean_acceptance_length == pytest.approx(1.0 + counters.accepted_tokens_per_draft)
        assert counters.mean_accepted_length == counters.accepted_tokens_per_draft  # the deprecated alias
    else:
        assert counters.acceptance_rate is None and counters.mean_acceptance_length is None
    assert all(x >= y for x, y in zip(counters.accepted_at, counters.accepted_at[1:]))
    assert all(x >= y for x, y in zip(counters.drafted_at, counters.drafted_at[1:]))
    assert all(d >= r >= a for d, r, a in zip(counters.drafted_at, counters.reached_at, counters.accepted_at))
    assert sum(counters.accepted_length_hist) == counters.drafts
    assert sum(map(sum, counters.joint_hist)) == counters.drafts
    assert sum(counters.accepted_at) == counters.accepted_tokens
    assert sum(counters.drafted_at) == counters.draft_tokens
    assert counters.proposed_tokens == counters.draft_tokens + counters.cut_policy_tokens + counters.cut_grammar_tokens
    assert counters.cut_policy_tokens >= 0 and counters.cut_grammar_tokens >= 0
    assert sum(counters.nonspec_by_cause) == counters.nonspec_seq_steps
    for rate in (*counters.per_position_acceptance, *counters.conditional_acceptance):
        assert rate is None or 0.0 <= rate <= 1.0


@SETTINGS
@given(scenarios(fixed_k=True))
def test_fixed_k_mean_accepted_length_is_k_times_acceptance_rate(scenario: Scenario) -> None:
    counters = run(scenario).recorder.snapshot().counters
    k = scenario.fixed_k
    assert k is not None and counters.drafts > 0
    assert counters.draft_tokens == k * counters.drafts
    assert Fraction(counters.accepted_tokens, counters.drafts) == k * Fraction(
        counters.accepted_tokens, counters.draft_tokens
    )
    assert counters.mean_proposed_length == k


@SETTINGS
@given(scenarios())
def test_per_request_and_interval_windows_sum_to_cumulative(scenario: Scenario) -> None:
    result = run(scenario)
    cumulative = result.recorder.snapshot()
    request_sum = SpecCounters.zero(scenario.k_max)
    for stats in result.finished.values():
        request_sum = request_sum + stats.counters
    assert request_sum == cumulative.counters
    interval_sum = SpecMetricsSnapshot.zero(scenario.k_max)
    for interval in result.intervals:
        interval_sum = interval_sum + interval
    assert interval_sum.counters == cumulative.counters
    assert interval_sum.step_totals.steps == cumulative.step_totals.steps
    assert interval_sum.step_totals.propose_s == pytest.approx(cumulative.step_totals.propose_s)
    assert interval_sum.per_request.counts == cumulative.per_request.counts
    assert interval_sum.per_request.tau_hist == cumulative.per_request.tau_hist
    assert cumulative.per_request.finished_requests == len(result.finished)
    # Mean of per-request values, recomputed with exact fractions from the finished requests.
    rates = [Fraction(s.accepted_tokens, s.draft_tokens) for s in result.finished.values() if s.draft_tokens]
    expected = float(sum(rates) / len(rates)) if rates else None
    assert cumulative.acceptance_rate_mean_per_request == pytest.approx(expected)
    taus = [1 + Fraction(s.accepted_tokens, s.drafts) for s in result.finished.values() if s.drafts]
    expected_tau = float(sum(taus) / len(taus)) if taus else None
    assert cumulative.mean_acceptance_length_mean_per_request == pytest.approx(expected_tau)


@SETTINGS
@given(scenarios())
def test_trace_recount_equals_recorder(scenario: Scenario) -> None:
    result = run(scenario)
    recorded, traced = result.recorder.snapshot(), result.trace_snapshot
    assert traced.counters == recorded.counters
    assert traced.step_totals.steps == recorded.step_totals.steps
    assert traced.step_totals.spec_steps == recorded.step_totals.spec_steps
    assert traced.step_totals.draft_forwards == recorded.step_totals.draft_forwards
    assert traced.step_totals.draft_tokens_computed == recorded.step_totals.draft_tokens_computed
    assert traced.step_totals.sample_s == pytest.approx(recorded.step_totals.sample_s)
    assert traced.per_request.finished_requests == recorded.per_request.finished_requests
    assert traced.per_request.counts == recorded.per_request.counts
    assert traced.per_request.tau_hist == recorded.per_request.tau_hist
    for metric in SCALAR_METRICS:
        assert traced.per_request.mean(metric) == pytest.approx(recorded.per_request.mean(metric))


@SETTINGS
@given(scenarios())
def test_log_line_parses_back_to_interval_snapshot(scenario: Scenario) -> None:
    for interval in run(scenario).intervals:
        parsed = parse_log_line(format_log_line(interval, interval_s=1.5))
        counters = interval.counters
        assert parsed["steps"] == interval.step_totals.steps
        assert parsed["spec_steps"] == interval.step_totals.spec_steps
        assert parsed["drafts"] == counters.drafts
        assert parsed["draft_tokens"] == counters.draft_tokens
        assert parsed["accepted"] == counters.accepted_tokens
        assert parsed["emitted"] == counters.emitted_tokens
        assert parsed["nonspec_seq_steps"] == counters.nonspec_seq_steps
        assert parsed["nonspec_tokens"] == counters.nonspec_tokens
        assert parsed["drafted_at"] == list(counters.drafted_at)
        assert parsed["reached_at"] == list(counters.reached_at)
        assert parsed["accepted_at"] == list(counters.accepted_at)
        assert parsed["accepted_len_hist"] == list(counters.accepted_length_hist)
        assert parsed["finished_requests"] == interval.per_request.finished_requests
        for key, value in (
            ("acceptance_rate", counters.acceptance_rate),
            ("accepted_tokens_per_draft", counters.accepted_tokens_per_draft),
            ("mean_accepted_len", counters.accepted_tokens_per_draft),
            ("tau", counters.mean_acceptance_length),
            ("tokens_per_forward", interval.tokens_per_target_forward),
            ("tokens_per_seq_step", counters.tokens_per_seq_step),
            ("tau_mean_per_request", interval.mean_acceptance_length_mean_per_request),
        ):
            # The line prints 4 decimals: up to 5e-5 off, plus float rounding of the half-way case.
            assert parsed[key] == (None if value is None else pytest.approx(value, abs=1e-4)), key
        for key, values in (
            ("per_position_acceptance", counters.per_position_acceptance),
            ("conditional", counters.conditional_acceptance),
        ):
            assert len(parsed[key]) == scenario.k_max
            for got, want in zip(parsed[key], values):
                assert got == (None if want is None else pytest.approx(want, abs=1e-4))
        assert parsed["propose_s"] == pytest.approx(interval.step_totals.propose_s, abs=1e-6)
        assert parsed["proposed"] == counters.proposed_tokens
        assert parsed["cut_policy"] == counters.cut_policy_tokens
        assert parsed["cut_grammar"] == counters.cut_grammar_tokens
        assert parsed["rejected"] == counters.rejected_tokens
        assert parsed["past_stop"] == counters.past_stop_tokens
        assert parsed["draft_forwards"] == interval.step_totals.draft_forwards
        assert parsed["draft_tokens_computed"] == interval.step_totals.draft_tokens_computed
        assert [parsed[f"k0_{cause}"] for cause in K0_CAUSES] == list(counters.nonspec_by_cause)


def samples(exposition: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


@SETTINGS
@given(scenarios())
def test_prometheus_exposition_equals_counters(scenario: Scenario) -> None:
    result = run(scenario)
    snapshot = result.recorder.snapshot()
    counters, got = snapshot.counters, samples(result.exposition)
    ours = {("model", "m"), ("proposer", "ngram"), ("k_policy", "heuristic")}
    vllm = {("model_name", "m"), ("engine", "0")}

    def value(name: str, labels: set[tuple[str, str]]) -> float:
        return got[(name, frozenset(labels))]

    for name, expected in (
        ("drafts", counters.drafts),
        ("draft_tokens", counters.draft_tokens),
        ("accepted_tokens", counters.accepted_tokens),
        ("emitted_tokens", counters.emitted_tokens),
        ("steps", snapshot.step_totals.steps),
        ("spec_steps", snapshot.step_totals.spec_steps),
        ("nonspec_seq_steps", counters.nonspec_seq_steps),
        ("nonspec_tokens", counters.nonspec_tokens),
        ("proposed_tokens", counters.proposed_tokens),
        ("rejected_tokens", counters.rejected_tokens),
        ("past_stop_tokens", counters.past_stop_tokens),
        ("draft_forwards", snapshot.step_totals.draft_forwards),
        ("draft_tokens_computed", snapshot.step_totals.draft_tokens_computed),
    ):
        assert value(f"specd_spec_decode_{name}_total", ours) == expected, name
    assert value("specd_spec_decode_cut_tokens_total", ours | {("cause", "policy")}) == counters.cut_policy_tokens
    assert value("specd_spec_decode_cut_tokens_total", ours | {("cause", "grammar")}) == counters.cut_grammar_tokens
    for cause, count in zip(K0_CAUSES, counters.nonspec_by_cause):
        assert value("specd_spec_decode_nonspec_seq_steps_by_cause_total", ours | {("cause", cause)}) == count
    for j in range(1, scenario.k_max + 1):
        at = ours | {("position", str(j))}
        assert value("specd_spec_decode_drafted_at_position_total", at) == counters.drafted_at[j - 1]
        assert value("specd_spec_decode_reached_at_position_total", at) == counters.reached_at[j - 1]
        assert value("specd_spec_decode_accepted_at_position_total", at) == counters.accepted_at[j - 1]
        vllm_at = vllm | {("position", str(j - 1))}
        assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", vllm_at) == counters.accepted_at[j - 1]
    cumulative = 0
    for length, count in enumerate(counters.accepted_length_hist):
        cumulative += count
        assert value("specd_spec_decode_accepted_length_bucket", ours | {("le", f"{length:.1f}")}) == cumulative
    assert value("specd_spec_decode_accepted_length_count", ours) == counters.drafts
    assert value("specd_spec_decode_accepted_length_sum", ours) == counters.accepted_tokens
    assert value("vllm:spec_decode_num_drafts_total", vllm) == counters.drafts
    assert value("vllm:spec_decode_num_draft_tokens_total", vllm) == counters.draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total", vllm) == counters.accepted_tokens
    # Per-request tau histogram observed at finish, phase histograms once per step.
    tau_count = snapshot.per_request.counts[SCALAR_METRICS.index("mean_acceptance_length")]
    assert value("specd_spec_decode_request_mean_acceptance_length_count", ours) == tau_count
    cumulative = 0
    for bound, count in zip(tau_bucket_bounds(scenario.k_max), snapshot.per_request.tau_hist):
        cumulative += count
        le = ours | {("le", str(bound))}
        assert value("specd_spec_decode_request_mean_acceptance_length_bucket", le) == cumulative
    for phase, total in (
        ("propose", snapshot.step_totals.propose_s),
        ("verify", snapshot.step_totals.verify_s),
        ("sample", snapshot.step_totals.sample_s),
    ):
        labels = ours | {("phase", phase)}
        assert value("specd_spec_decode_phase_seconds_count", labels) == snapshot.step_totals.steps
        assert value("specd_spec_decode_phase_seconds_sum", labels) == pytest.approx(total)
    # Labels never name a request.
    assert all("request" not in dict(labels) for _, labels in got)


@pytest.mark.parametrize("module", ["stats.py", "records.py", "snapshots.py"])
def test_computation_modules_import_no_exporter(module: str) -> None:
    """Metrics are computed in one place with no exporter imports; sinks only write."""
    tree = ast.parse(Path(__file__).parents[2].joinpath("src/specd/metrics", module).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    forbidden = (
        "prometheus_client",
        "logging",
        "specd.metrics.log_sink",
        "specd.metrics.prometheus_sink",
        "specd.metrics.trace",
    )
    assert not [name for name in imported if name.startswith(forbidden)]


@SETTINGS
@given(scenarios())
def test_exposition_in_default_and_spec_off_modes_equals_the_compat_one(scenario: Scenario) -> None:
    """The same steps through three sinks: vLLM-compat (checked against the recorder above), default, and compat
    with speculation off. specd's families are identical in all three; vllm:spec_decode_* exist only in the
    first; the k_policy label is the configured policy everywhere."""
    registries = {mode: CollectorRegistry() for mode in ("compat", "default", "off")}
    sinks = [
        PrometheusSink(registries["compat"], "m", "ngram", "heuristic", vllm_compat=True),
        PrometheusSink(registries["default"], "m", "ngram", "heuristic"),
        PrometheusSink(registries["off"], "m", "ngram", "heuristic", vllm_compat=True, speculating=False),
    ]
    recorder = SpecStatsRecorder(scenario.k_max, sinks=sinks)
    for step in scenario.steps:
        recorder.record_step(step.request_ids, torch.tensor(step.rows, dtype=torch.int64).T, step.times,
                             num_proposed=[p for p, _, _ in step.drafting])
        for request_id in step.finish_after:
            recorder.finish_request(request_id)
    got = {mode: samples(generate_latest(registry).decode()) for mode, registry in registries.items()}
    # (`*_created` samples are each sink's creation time, not a count.)
    own = {mode: {key: value for key, value in values.items()
                  if key[0].startswith("specd_") and not key[0].endswith("_created")}
           for mode, values in got.items()}
    assert own["compat"] == own["default"] == own["off"]
    assert own["compat"][("specd_spec_decode_drafts_total", frozenset(
        {("model", "m"), ("proposer", "ngram"), ("k_policy", "heuristic")}))] == recorder.snapshot().counters.drafts
    assert all(dict(labels)["k_policy"] == "heuristic" for _, labels in own["compat"])
    vllm_names = {mode: {name for name, _ in values if name.startswith("vllm:")} for mode, values in got.items()}
    assert vllm_names["compat"] >= {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total"}
    assert vllm_names["default"] == vllm_names["off"] == set()
