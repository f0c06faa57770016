"""The goodput k policy: what it keeps follows from its estimates, and its estimates from what it observed."""

from __future__ import annotations

import itertools
import math

import pytest

from specd.config import SpeculationConfig
from specd.errors import InvalidParameterError
from specd.sampling.params import SamplingParams, SpecOverride
from specd.speculation.policies.goodput import PROBE_INTERVAL, GoodputPlanner


def _planner_with_cost(slope_s: float, fixed_s: float = 0.01, tokens_per_s: float = 100.0) -> GoodputPlanner:
    planner = GoodputPlanner()
    for n in (1, 3, 5, 9, 2, 7):
        planner.observe_forward(n, fixed_s + slope_s * n)
    planner.observe_step(int(tokens_per_s), 1.0)
    return planner


def test_marginal_cost_is_the_local_slope_of_the_measured_forward_times() -> None:
    planner = _planner_with_cost(slope_s=0.002, fixed_s=0.015)
    assert planner.marginal_seconds(1, 8) == pytest.approx(0.002)
    # A cost that is flat up to 8 tokens and steep after it: the slope is read where the step is.
    kinked = GoodputPlanner()
    for n in range(1, 25):
        kinked.observe_forward(n, 0.02 + (0.0 if n <= 8 else 0.003 * (n - 8)))
    assert kinked.marginal_seconds(1, 6) == pytest.approx(0.0)
    assert kinked.marginal_seconds(10, 8) == pytest.approx(0.003)
    one_size = GoodputPlanner()
    one_size.observe_forward(4, 0.02)
    one_size.observe_forward(4, 0.03)
    assert one_size.marginal_seconds(4, 4) == 0.0  # one N seen: drafting looks free, so it gets measured
    assert one_size.snapshot()["forward_ms_by_new_tokens"] == {"4": 25.0}  # a mean over the first samples
    noisy = GoodputPlanner()
    for n, t in ((1, 0.03), (5, 0.02)):  # measured "cheaper with more tokens": slope clipped to 0
        noisy.observe_forward(n, t)
    assert noisy.marginal_seconds(1, 4) == 0.0
    # Outside the window's range the fit falls back to every measured size.
    assert planner.marginal_seconds(100, 4) == pytest.approx(0.002)


def test_rate_is_a_ratio_of_averages() -> None:
    planner = GoodputPlanner()
    assert planner.rate is None
    planner.observe_step(9, 0.03)
    planner.observe_step(1, 0.01)
    # EMA(tokens) / EMA(seconds) with weight 0.1: (9 + 0.1 * (1 - 9)) / (0.03 + 0.1 * (0.01 - 0.03))
    assert planner.rate == pytest.approx(8.2 / 0.028)


def test_acceptance_counts_reached_positions_only_and_shrinks_per_sequence_estimates() -> None:
    planner = GoodputPlanner()
    assert planner.accept_prob(0, 3, 0) == 0.5  # optimistic prior for an unseen bucket
    for _ in range(10):
        planner.observe_draft(seq_id=1, bucket=3, num_drafted=4, num_accepted=1)
    # Position 0 reached 10x, accepted 10x; position 1 reached 10x, accepted 0x; positions 2, 3 never reached.
    p0_global = (10 + 1) / (10 + 2)
    p1_global = (0 + 1) / (10 + 2)
    assert planner.accept_prob(99, 3, 0) == pytest.approx(p0_global)  # another sequence: engine-wide value
    assert planner.accept_prob(99, 3, 1) == pytest.approx(p1_global)
    assert planner.accept_prob(99, 3, 2) == 0.5
    assert planner.accept_prob(1, 3, 0) == pytest.approx((10 + 4 * p0_global) / (10 + 4))
    planner.release(1)
    assert planner.accept_prob(1, 3, 0) == pytest.approx(p0_global)


def test_plan_keeps_exactly_the_prefixes_worth_their_price() -> None:
    planner = _planner_with_cost(slope_s=0.002, tokens_per_s=100.0)  # price = 100 * 0.002 = 0.2 tokens
    for _ in range(50):
        planner.observe_draft(seq_id=1, bucket=4, num_drafted=8, num_accepted=8)  # long matches: always right
        planner.observe_draft(seq_id=2, bucket=1, num_drafted=8, num_accepted=0)  # 1-token matches: never
    plan = planner.plan([1, 2, 3], [4, 1, 1], [6, 5, 0], base_tokens=3)
    assert plan.price == pytest.approx(0.2)
    for row in plan.values:  # v_ij is a running product of probabilities: non-increasing along a draft
        assert all(later <= earlier for earlier, later in itertools.pairwise(row))
    expected = [sum(v > plan.price for v in row) for row in plan.values]
    assert plan.keep == expected
    assert plan.keep[0] == 6 and plan.keep[1] == 0 and plan.keep[2] == 0
    # The same drafts when verification is free (no slope): everything is kept.
    free = _planner_with_cost(slope_s=0.0)
    assert free.plan([1, 2], [4, 1], [6, 5], base_tokens=2).keep == [6, 5]


def test_plan_cuts_deeper_as_verification_gets_dearer() -> None:
    kept = []
    for slope in (0.0, 0.001, 0.004, 0.02):
        planner = _planner_with_cost(slope_s=slope)
        for _ in range(20):
            planner.observe_draft(seq_id=1, bucket=2, num_drafted=6, num_accepted=3)
        kept.append(planner.plan([1], [2], [6], base_tokens=1).keep[0])
    assert kept == sorted(kept, reverse=True) and kept[0] == 6 and kept[-1] < 6
    assert all(math.isfinite(v) for v in GoodputPlanner().plan([0], [0], [2], base_tokens=1).values[0])


def test_goodput_is_validated_where_it_is_chosen() -> None:
    with pytest.raises(InvalidParameterError, match=r"speculation\.k_policy"):
        SpeculationConfig(method="layerskip", k_policy="goodput")
    SpeculationConfig(method="ngram", k_policy="goodput")
    SamplingParams(speculation=SpecOverride(k_policy="goodput"))
    with pytest.raises(InvalidParameterError, match=r"speculation\.k_policy"):
        SpecOverride(k_policy="sometimes")


def test_a_sequence_cut_to_nothing_probes_one_token_every_interval() -> None:
    planner = _planner_with_cost(slope_s=0.002)
    for _ in range(30):
        planner.observe_draft(seq_id=1, bucket=1, num_drafted=4, num_accepted=0)  # bucket 1: never accepted
    kept = [planner.plan([1], [1], [4], base_tokens=1).keep[0] for _ in range(3 * PROBE_INTERVAL)]
    # Cut every step except one probe token per interval, so the bucket's estimate keeps being measured.
    assert kept == ([0] * (PROBE_INTERVAL - 1) + [1]) * 3
    planner.release(1)
    assert planner.plan([1], [1], [4], base_tokens=1).keep == [0]  # a released sequence starts a new interval


def test_weights_cannot_be_loaded_into_a_packed_model() -> None:
    import torch

    from specd.errors import ModelLoadError
    from specd.testing import hf_state_dict, tiny_specd_model

    model = tiny_specd_model(dtype=torch.float32)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: nothing is packed")
    with pytest.raises(ModelLoadError, match="before pack"):
        model.load_hf_state_dict(hf_state_dict(model))
