"""The time-weighted speed-up estimate (metrics/speedup.py), driven with synthetic step times only."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.metrics.log_sink import format_log_line
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.speedup import PlainStepCost, SpeedupTotals, VerifyStepCost
from specd.metrics.stats import SpecStatsRecorder, StepPhaseTimes
from specd.testing import parse_log_line


def test_plain_step_cost_by_batch_size() -> None:
    cost = PlainStepCost()
    assert cost.estimate(4) is None
    cost.observe(2, 0.010)
    cost.observe(2, 0.014)
    assert cost.estimate(2) == pytest.approx(0.012)
    assert cost.estimate(8) == pytest.approx(0.012)  # one size measured: its mean for every size
    cost.observe(4, 0.016)
    assert cost.estimate(4) == pytest.approx(0.016)  # measured sizes use their own mean
    assert cost.estimate(3) == pytest.approx(0.014)  # the line through (2, 0.012) and (4, 0.016)
    assert cost.estimate(6) == pytest.approx(0.020)
    cost.observe(3, 0.001)  # noisy means: the line may fall below every measurement far away
    assert cost.estimate(100) >= 0.001 and cost.estimate(1) >= 0.001


def test_speedup_totals_add_and_ratio() -> None:
    assert SpeedupTotals().speedup_estimate is None
    total = SpeedupTotals(0.5, 1.0, 1) + SpeedupTotals(0.5, 0.5, 2)
    assert total == SpeedupTotals(1.0, 1.5, 3)
    assert total.speedup_estimate == 1.5
    assert total.to_dict() == {"decode_s": 1.0, "plain_decode_s": 1.5, "unestimated_decode_steps": 3,
                               "modelled_decode_steps": 0, "speedup_estimate": 1.5}


def _times(propose_s: float, verify_s: float, sample_s: float, prefill_s: float = 0.0) -> StepPhaseTimes:
    return StepPhaseTimes(propose_s, verify_s, sample_s, prefill_s)


def test_recorder_log_line_and_prometheus_agree_on_the_estimate() -> None:
    registry = CollectorRegistry()
    recorder = SpecStatsRecorder(4, sinks=[PrometheusSink(registry, model="m", proposer="ngram", k_policy="fixed")])
    ids = ["x", "y"]
    # 1. A speculative step before any plain step was measured: no estimate, counted as such.
    recorder.record_counts(ids, [2, 3], [1, 0], [2, 1], _times(0.002, 0.020, 0.002))
    # 2. A prefill-only step and a mixed step (prefill + k = 0 rows) measure nothing and add nothing.
    recorder.record_counts([], [], [], [], _times(0.0, 0.0, 0.0, 0.050), num_prefill_tokens=32)
    recorder.record_counts(["z"], [0], [0], [1], _times(0.0, 0.001, 0.001, 0.040), num_prefill_tokens=32,
                           k0_causes=["first_token"])
    first = recorder.take_interval()
    assert first.speedup == SpeedupTotals(0.0, 0.0, 2)
    assert first.speedup.speedup_estimate is None
    assert parse_log_line(format_log_line(first))["speedup"] is None
    # 3. A plain decode step at B = 2: its cost is verify + sample = 0.012 (proposing is not plain decoding's).
    recorder.record_counts(ids, [0, 0], [0, 0], [1, 1], _times(0.001, 0.010, 0.002), k0_causes=["no_match"] * 2)
    # 4. A speculative step at B = 2 that emitted 3 + 2 tokens in 0.018 s: plain needs 2.5 steps of 0.012 s.
    recorder.record_counts(ids, [3, 2], [2, 1], [3, 2], _times(0.002, 0.014, 0.002))
    second = recorder.take_interval()
    decode_s = 0.013 + 0.018
    plain_decode_s = 0.012 * 2 / 2 + 0.012 * 5 / 2
    assert second.speedup.unestimated_decode_steps == 0
    assert second.speedup.decode_s == pytest.approx(decode_s)
    assert second.speedup.plain_decode_s == pytest.approx(plain_decode_s)
    assert second.speedup.speedup_estimate == pytest.approx(plain_decode_s / decode_s)  # 1.355
    line = parse_log_line(format_log_line(second, interval_s=10.0))
    assert line["speedup"] == pytest.approx(round(plain_decode_s / decode_s, 4))
    assert line["decode_s"] == pytest.approx(decode_s) and line["plain_decode_s"] == pytest.approx(plain_decode_s)
    assert line["unestimated_decode_steps"] == 0
    total = recorder.snapshot().to_dict()["speedup"]
    assert total["unestimated_decode_steps"] == 2
    assert total["speedup_estimate"] == pytest.approx(plain_decode_s / decode_s)
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    assert math.isclose(samples["specd_spec_decode_speedup_decode_seconds_total"], decode_s)
    assert math.isclose(samples["specd_spec_decode_speedup_plain_decode_seconds_total"], plain_decode_s)


def test_each_step_is_priced_at_the_plain_cost_known_when_it_was_recorded() -> None:
    recorder = SpecStatsRecorder(2)
    for verify_s in (0.010, 0.012, 0.014):
        recorder.record_counts(["a", "b", "c"], [0, 0, 0], [0, 0, 0], [1, 1, 1], _times(0.0, verify_s, 0.0),
                               k0_causes=["disabled"] * 3)
    speedup = recorder.snapshot().speedup
    # Each step is priced at the running mean at the time it was recorded: 0.010, 0.011, 0.012.
    assert speedup.decode_s == pytest.approx(0.036)
    assert speedup.plain_decode_s == pytest.approx(0.033)
    assert speedup.speedup_estimate == pytest.approx(0.033 / 0.036)


def test_verify_step_cost_line_needs_two_row_counts_and_a_positive_value() -> None:
    cost = VerifyStepCost()
    assert cost.estimate(1) is None
    cost.observe(5, 0.020)
    cost.observe(5, 0.022)
    assert cost.estimate(1) is None  # one row count: no slope, no price
    cost.observe(3, 0.017)
    # Least squares through (5, 0.020), (5, 0.022), (3, 0.017): slope 0.002, at 1 row 0.013.
    assert cost.estimate(1) == pytest.approx(0.013)
    falling = VerifyStepCost()
    falling.observe(2, 0.010)
    falling.observe(4, 0.002)
    assert falling.estimate(1) == pytest.approx(0.014)
    assert falling.estimate(6) is None  # the line's value there is <= 0: no price rather than a negative one


def test_a_run_that_always_speculates_is_priced_by_the_verify_cost_model() -> None:
    """No plain step ever: the estimate comes from the verification steps' own cost line read at R = B, and the
    steps it prices count as modelled; a measured plain step then takes over."""
    recorder = SpecStatsRecorder(4)
    ids = ["x"]

    def verify_s(rows: int) -> float:  # an exact line: 10 ms + 2 ms per verified row
        return 0.010 + 0.002 * rows

    recorder.record_counts(ids, [4], [1], [2], _times(0.001, verify_s(5), 0.0))  # one row count: unpriced
    recorder.record_counts(ids, [2], [2], [3], _times(0.001, verify_s(3), 0.0))  # now a line: plain(1) = 12 ms
    recorder.record_counts(ids, [3], [0], [1], _times(0.001, verify_s(4), 0.0))
    speedup = recorder.snapshot().speedup
    assert (speedup.unestimated_decode_steps, speedup.modelled_decode_steps) == (1, 2)
    assert speedup.decode_s == pytest.approx(0.001 + verify_s(3) + 0.001 + verify_s(4))
    assert speedup.plain_decode_s == pytest.approx(0.012 * 3 + 0.012 * 1)
    line = parse_log_line(format_log_line(recorder.snapshot()))
    assert (line["modelled_decode_steps"], line["unestimated_decode_steps"]) == (2, 1)
    # A plain step measured at B = 1 (9 ms) prices what follows instead of the model.
    recorder.record_counts(ids, [0], [0], [1], _times(0.0, 0.009, 0.0), k0_causes=["no_match"])
    recorder.record_counts(ids, [2], [2], [3], _times(0.001, verify_s(3), 0.0))
    after = recorder.snapshot().speedup
    assert after.modelled_decode_steps == 2
    assert after.plain_decode_s == pytest.approx(0.012 * 3 + 0.012 * 1 + 0.009 * 1 + 0.009 * 3)


def test_a_run_with_one_verify_shape_and_no_plain_step_stays_unpriced() -> None:
    recorder = SpecStatsRecorder(4)
    for _ in range(5):
        recorder.record_counts(["x", "y"], [4, 4], [4, 1], [5, 2], _times(0.001, 0.030, 0.001))
    speedup = recorder.snapshot().speedup
    assert speedup.speedup_estimate is None and speedup.decode_s == 0.0
    assert (speedup.unestimated_decode_steps, speedup.modelled_decode_steps) == (5, 0)
