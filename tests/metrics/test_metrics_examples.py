"""Hand-computed examples (the worked example of docs/metrics.md), stop truncation, validation, detail."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specd.metrics.records import SpecCounters, StepDetail
from specd.metrics.stats import SpecStatsRecorder, StepPhaseTimes

TIMES = StepPhaseTimes(0.001, 0.02, 0.0005)


def counts(*rows: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).T  # [3, num_seqs]


def worked_example() -> SpecStatsRecorder:
    """docs/metrics.md: request X drafts k=1 twice, request Y drafts k=4 twice then k=0 once; k_max = 4."""
    recorder = SpecStatsRecorder(k_max=4)
    recorder.record_step(["X", "Y"], counts((1, 1, 2), (4, 0, 1)), TIMES)
    recorder.record_step(["X", "Y"], counts((1, 1, 1), (4, 2, 3)), TIMES)  # X's accepted token was EOS
    recorder.record_step(["Y"], counts((0, 0, 1)), TIMES)
    recorder.finish_request("X")
    recorder.finish_request("Y")
    return recorder


def test_worked_example_counters() -> None:
    c = worked_example().snapshot().counters
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.emitted_tokens) == (4, 10, 4, 7)
    assert (c.nonspec_seq_steps, c.nonspec_tokens, c.target_forward_seq_steps) == (1, 1, 5)
    assert c.drafted_at == (4, 2, 2, 2)
    assert c.reached_at == (4, 1, 1, 0)
    assert c.accepted_at == (3, 1, 0, 0)
    assert c.accepted_length_hist == (1, 2, 1, 0, 0)
    assert c.joint_hist == ((0, 2, 0, 0, 0), (0,) * 5, (0,) * 5, (1, 0, 1, 0, 0))


def test_worked_example_derived_values_and_where_naive_formulas_fail() -> None:
    snapshot = worked_example().snapshot()
    c = snapshot.counters
    assert c.acceptance_rate == pytest.approx(0.4)
    assert c.accepted_tokens_per_draft == pytest.approx(1.0)
    assert c.mean_acceptance_length == pytest.approx(2.0)
    assert c.emitted_per_draft == pytest.approx(1.75)  # < tau: stop truncation ate a bonus token
    assert c.mean_proposed_length == pytest.approx(2.5)
    assert c.tokens_per_seq_step == pytest.approx(1.6)  # 8 tokens over 5 sequence-steps
    assert snapshot.tokens_per_target_forward == pytest.approx(8 / 3)  # over 3 forwards (steps)
    # Naive A/D from the configured k: k_max * A/T = 1.6, but the true A/D is 1.0.
    assert c.k_max * c.acceptance_rate == pytest.approx(1.6)
    assert c.k_max * c.acceptance_rate != pytest.approx(c.accepted_tokens_per_draft)
    # It only works with the mean proposed length T/D, which is not a configured k.
    assert c.mean_proposed_length * c.acceptance_rate == pytest.approx(c.accepted_tokens_per_draft)
    # Per position: dividing by all drafts understates position 2 (two drafts never proposed it).
    assert c.per_position_acceptance == pytest.approx((0.75, 0.5, 0.0, 0.0))
    assert [a / c.drafts for a in c.accepted_at] == pytest.approx([0.75, 0.25, 0.0, 0.0])
    assert c.conditional_acceptance[:3] == pytest.approx((0.75, 1.0, 0.0))
    assert c.conditional_acceptance[3] is None  # nobody reached position 4: undefined, not 0
    # Pooled vs mean of per-request values.
    assert snapshot.acceptance_rate_pooled == pytest.approx(0.4)
    assert snapshot.acceptance_rate_mean_per_request == pytest.approx((1.0 + 0.25) / 2)
    assert snapshot.mean_acceptance_length_mean_per_request == pytest.approx(2.0)
    assert snapshot.per_request.mean("tokens_per_seq_step") == pytest.approx((1.5 + 5 / 3) / 2)
    assert snapshot.step_totals.steps == 3 and snapshot.step_totals.spec_steps == 2


def test_to_dict_is_json_with_nulls_not_nan() -> None:
    data = worked_example().snapshot().to_dict()
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text)["derived"]["conditional_acceptance_pooled"][3] is None
    assert data["derived"]["acceptance_rate_pooled"] == pytest.approx(0.4)
    assert data["derived"]["acceptance_rate_mean_per_request"] == pytest.approx(0.625)
    assert data["counters"]["accepted_at"] == [3, 1, 0, 0]
    assert data["per_request"]["finished_requests"] == 2


def test_nothing_drafted_gives_none_everywhere_not_zero() -> None:
    recorder = SpecStatsRecorder(k_max=3)
    recorder.record_step(["a", "b"], counts((0, 0, 1), (0, 0, 1)), TIMES)
    c = recorder.snapshot().counters
    assert c.drafts == 0 and c.nonspec_seq_steps == 2
    for value in (
        c.acceptance_rate,
        c.accepted_tokens_per_draft,
        c.mean_acceptance_length,
        c.emitted_per_draft,
        c.mean_proposed_length,
        *c.per_position_acceptance,
        *c.conditional_acceptance,
    ):
        assert value is None
    assert c.tokens_per_seq_step == 1.0  # speculation off still has a tokens-per-sequence-step figure
    assert recorder.snapshot().tokens_per_target_forward == 2.0  # two sequences share the one forward
    assert recorder.snapshot().step_totals.spec_steps == 0
    empty = SpecCounters.zero(3)
    assert empty.tokens_per_seq_step is None
    assert SpecStatsRecorder(k_max=3).snapshot().tokens_per_target_forward is None


def test_eos_inside_accepted_run_counts_verifier_acceptance_and_emitted_tokens_separately() -> None:
    recorder = SpecStatsRecorder(k_max=4)
    # The verifier accepted 3 of 4 drafts, but the 2nd accepted token was EOS: 2 tokens emitted, no bonus.
    recorder.record_step(["r"], counts((4, 3, 2)), TIMES)
    stats = recorder.finish_request("r")
    assert stats.accepted_tokens == 3
    assert stats.emitted_tokens == 2
    assert stats.mean_acceptance_length == pytest.approx(4.0)
    assert stats.emitted_per_draft == pytest.approx(2.0)
    assert stats.counters.accepted_at == (1, 1, 1, 0)


def test_record_step_rejects_bad_input_and_changes_nothing() -> None:
    recorder = SpecStatsRecorder(k_max=2)
    recorder.record_step(["a"], counts((2, 1, 2)), TIMES)
    before = recorder.snapshot()
    bad = [
        (["a"], counts((2, 3, 1)), "a=3"),  # a > k
        (["a"], counts((2, 1, 3)), "e=3"),  # e > a + 1
        (["a"], counts((3, 0, 1)), "k_max=2"),  # k > k_max
        (["a"], counts((-1, 0, 1)), "k=-1"),
        (["a", "b"], counts((2, 1, 2)), "shape"),
        (["a"], counts((2, 1, 2)).float(), "integer"),
        ([], torch.zeros(3, 0, dtype=torch.int64), "at least one"),
    ]
    for request_ids, tensor, message in bad:
        with pytest.raises(ValueError, match=message):
            recorder.record_step(request_ids, tensor, TIMES)
    for prefill in (-1, True, 2.0):
        with pytest.raises(ValueError, match="num_prefill_tokens"):
            recorder.record_counts(["a"], [0], [0], [1], TIMES, num_prefill_tokens=prefill)  # type: ignore[arg-type]
    assert recorder.snapshot() == before
    assert recorder.request_stats("a").counters == before.counters


def test_prefill_only_step_counts_in_steps_and_prefill_totals_not_in_sequence_counters() -> None:
    recorder = SpecStatsRecorder(k_max=2)
    recorder.record_counts([], [], [], [], StepPhaseTimes(0.0, 0.0, 0.0, 0.04), num_prefill_tokens=64)
    recorder.record_counts(["a"], [0], [0], [1], StepPhaseTimes(0.001, 0.01, 0.001, 0.03), num_prefill_tokens=48)
    recorder.record_counts(["a"], [2], [1], [2], TIMES)
    snapshot = recorder.snapshot()
    totals = snapshot.step_totals
    assert (totals.steps, totals.prefill_steps, totals.prefill_only_steps, totals.prefill_tokens) == (3, 2, 1, 112)
    assert totals.prefill_s == pytest.approx(0.07)
    assert snapshot.counters.target_forward_seq_steps == 2 and snapshot.counters.nonspec_seq_steps == 1


@pytest.mark.parametrize("field", ["propose_s", "verify_s", "sample_s", "prefill_s"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_step_phase_times_validated(field: str, value: float) -> None:
    kwargs = {"propose_s": 0.0, "verify_s": 0.0, "sample_s": 0.0, "prefill_s": 0.0, field: value}
    with pytest.raises(ValueError, match=field):
        StepPhaseTimes(**kwargs)


def test_k_max_validated() -> None:
    with pytest.raises(ValueError, match="k_max"):
        SpecStatsRecorder(k_max=-1)


def test_step_detail_only_for_requested_ids() -> None:
    recorder = SpecStatsRecorder(k_max=3)
    recorder.record_step(
        ["always", "asked", "plain"], counts((3, 2, 3), (2, 0, 1), (1, 1, 2)), TIMES,
        detail_request_ids={"asked", "always"},
    )
    recorder.record_step(
        ["always", "asked", "plain"], counts((3, 3, 2), (2, 1, 2), (0, 0, 1)), TIMES, detail_request_ids={"always"}
    )
    assert recorder.request_stats("always").steps == (StepDetail(0, 3, 2, 3), StepDetail(1, 3, 3, 2))
    assert recorder.request_stats("asked").steps == (StepDetail(0, 2, 0, 1),)  # asked for step 0 only
    assert recorder.finish_request("plain").steps is None
    all_detail = SpecStatsRecorder(k_max=3)
    all_detail.record_step(["x"], counts((1, 0, 1)), TIMES, detail_request_ids={"x"})
    stats = all_detail.finish_request("x")
    assert stats.steps == (StepDetail(0, 1, 0, 1),)
    assert stats.to_dict()["steps"] == [{"step": 0, "k": 1, "accepted": 0, "emitted": 1}]


def test_request_stats_is_live_and_finish_pops() -> None:
    recorder = SpecStatsRecorder(k_max=2)
    assert recorder.request_stats("new").counters == SpecCounters.zero(2)
    recorder.record_step(["r"], counts((2, 1, 2)), TIMES)
    assert recorder.request_stats("r").accepted_tokens == 1
    recorder.record_step(["r"], counts((2, 2, 3)), TIMES)
    assert recorder.request_stats("r").accepted_tokens == 3
    assert recorder.finish_request("r").emitted_tokens == 5
    assert recorder.live_request_ids == ()
    assert recorder.request_stats("r").drafts == 0
    # A request aborted before any step is still a finished request, with nothing defined.
    recorder.finish_request("never-ran")
    snapshot = recorder.snapshot()
    assert snapshot.per_request.finished_requests == 2
    assert snapshot.acceptance_rate_mean_per_request == pytest.approx(0.75)


def test_take_interval_resets_window_but_not_cumulative() -> None:
    recorder = SpecStatsRecorder(k_max=2)
    recorder.record_step(["r"], counts((2, 1, 2)), TIMES)
    first = recorder.take_interval()
    recorder.record_step(["r"], counts((2, 0, 1)), TIMES)
    second = recorder.take_interval()
    assert (first.counters.accepted_tokens, second.counters.accepted_tokens) == (1, 0)
    assert second.step_totals.steps == 1
    assert recorder.take_interval().step_totals.steps == 0
    assert recorder.snapshot().counters == first.counters + second.counters
    assert recorder.snapshot().step_totals.verify_s == pytest.approx(2 * TIMES.verify_s)


def test_counters_of_different_k_max_do_not_add() -> None:
    with pytest.raises(ValueError, match="k_max"):
        SpecCounters.zero(2) + SpecCounters.zero(3)


def test_non_contiguous_transposed_tensor_is_accepted() -> None:
    recorder = SpecStatsRecorder(k_max=2)
    rows = torch.tensor([[2, 2, 3], [0, 0, 1]], dtype=torch.long)  # [num_seqs, 3] as the engine builds it
    recorder.record_step(["a", "b"], rows.T, TIMES)
    assert recorder.snapshot().counters.accepted_tokens == 2


def test_deprecated_aliases_equal_their_new_keys() -> None:
    """mean_accepted_length (A / D) is kept one release beside accepted_tokens_per_draft, always equal."""
    snapshot = worked_example().snapshot()
    derived = snapshot.to_dict()["derived"]
    for suffix in ("pooled", "mean_per_request"):
        assert derived[f"accepted_tokens_per_draft_{suffix}"] is not None
        assert derived[f"mean_accepted_length_{suffix}"] == derived[f"accepted_tokens_per_draft_{suffix}"]
    assert derived["mean_accepted_length_pooled"] == pytest.approx(1.0)
    recorder = SpecStatsRecorder(k_max=4)
    recorder.record_step(["Y"], counts((4, 0, 1)), TIMES)
    recorder.record_step(["Y"], counts((4, 1, 2)), TIMES)
    request = recorder.finish_request("Y")
    assert request.to_dict()["derived"]["mean_accepted_length"] == request.accepted_tokens_per_draft == 0.5
    assert request.mean_accepted_length == request.accepted_tokens_per_draft
