"""bench/load.py: the serving benchmark's workload, arrivals and statistics."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from load import MAX_TOKENS_CHOICES, RequestResult, build_workload, percentile, poisson_arrivals, summarize
from prompts import KINDS


def test_workload_mixes_every_kind_with_varied_lengths_and_is_reproducible() -> None:
    items = build_workload(64, seed=3)
    assert [item.kind for item in items[:8]] == [*KINDS, *KINDS]
    assert {item.kind for item in items} == set(KINDS)
    assert {item.max_tokens for item in items} <= set(MAX_TOKENS_CHOICES)
    assert len({item.max_tokens for item in items}) >= 4
    assert items == build_workload(64, seed=3)
    assert items != build_workload(64, seed=4)
    with pytest.raises(ValueError, match="num_requests"):
        build_workload(0, seed=0)


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = poisson_arrivals(4000, rate=8.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 1 / 8) < 5 * (1 / 8) / math.sqrt(len(gaps))  # mean 1/rate within 5 sigma
    assert abs(gaps.std() - 1 / 8) < 0.02  # exponential: std == mean
    assert poisson_arrivals(5, rate=math.inf, seed=1) == [0.0] * 5
    assert poisson_arrivals(10, 2.0, seed=7) == poisson_arrivals(10, 2.0, seed=7)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, rate=0.0, seed=0)


def test_percentile_is_numpys_linear_rule() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_summary_pools_acceptance_over_requests_and_skips_failures() -> None:
    results = [
        RequestResult(True, "chat", ttft_s=0.1, tpot_s=0.02, e2e_s=1.0, itl_s=(0.02, 0.04), completion_tokens=40,
                      drafts=10, draft_tokens=40, accepted_tokens=10),
        RequestResult(True, "code", ttft_s=0.3, tpot_s=0.01, e2e_s=2.0, itl_s=(0.01,), completion_tokens=60,
                      drafts=2, draft_tokens=2, accepted_tokens=2),
        RequestResult(False, "chat", error="HTTP 503"),
    ]
    point = summarize("goodput", "rate", 4.0, results, duration_s=4.0)
    assert (point.completed, point.failed) == (2, 1)
    assert point.request_throughput == 0.5 and point.output_throughput == 25.0
    assert point.acceptance_rate == 12 / 42  # pooled, not the mean of 0.25 and 1.0
    assert point.tau == 1 + 12 / 12
    assert point.ttft_ms[0] == pytest.approx(200.0)
    assert point.itl_ms[0] == pytest.approx(20.0)
