"""logits -> processed distribution (temperature, top-k, top-p, min-p, greedy) and seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from specd.sampling.params import SamplingParams
from specd.sampling.processing import build_sampling_batch, logits_to_probs, sample_from_probs
from specd.testing import generators_per_row, make_generator

CPU = torch.device("cpu")


def _probs_for(params: SamplingParams, logits: list[float]) -> torch.Tensor:
    batch = build_sampling_batch([params], [1], CPU)
    return logits_to_probs(torch.tensor([logits]), batch)[0]


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


BASE = [0.5, 0.3, 0.15, 0.05]  # logits = log(BASE), so at temperature 1 the probs are BASE


def test_temperature_scales_logits() -> None:
    logits = [0.0, 1.0, 2.0, -1.0]
    probs = _probs_for(SamplingParams(temperature=2.0), logits)
    expected = torch.softmax(torch.tensor(logits) / 2.0, dim=0)
    torch.testing.assert_close(probs, expected)
    assert probs.dtype == torch.float32


def test_top_k_keeps_k_largest_renormalised() -> None:
    probs = _probs_for(SamplingParams(top_k=2), _log(BASE))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_k_keeps_ties_at_cutoff_and_large_k_is_off() -> None:
    probs = _probs_for(SamplingParams(top_k=2), [3.0, 1.0, 1.0, 0.0])
    assert (probs > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(_probs_for(SamplingParams(top_k=100), _log(BASE)), torch.tensor(BASE))
    # a row whose k covers the vocabulary next to one that filters: each keeps its own semantics
    batch = build_sampling_batch([SamplingParams(top_k=100), SamplingParams(top_k=2)], [1, 1], CPU)
    probs = logits_to_probs(torch.tensor([_log(BASE), _log(BASE)]), batch)
    torch.testing.assert_close(probs, torch.tensor([BASE, [0.625, 0.375, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.45, [1.0, 0.0, 0.0, 0.0]),  # the top token alone already reaches 0.45
        (0.6, [0.625, 0.375, 0.0, 0.0]),  # 0.3 crosses the boundary and is kept
        (0.81, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (1.0, BASE),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, expected: list[float]) -> None:
    probs = _probs_for(SamplingParams(top_p=top_p), _log(BASE))
    torch.testing.assert_close(probs, torch.tensor(expected))


def test_min_p_is_relative_to_max_prob() -> None:
    # threshold 0.35 * 0.5 = 0.175: 0.15 and 0.05 go
    probs = _probs_for(SamplingParams(min_p=0.35), _log(BASE))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_p_is_measured_after_top_k() -> None:
    # Without top-k the mass above 0.15 is 0.8 < 0.83, so it is kept; after top-k=3 renormalises, the mass
    # above it is 0.8 / 0.95 = 0.842 >= 0.83, so it goes.
    only_p = _probs_for(SamplingParams(top_p=0.83), _log(BASE))
    assert (only_p > 0).tolist() == [True, True, True, False]
    k_then_p = _probs_for(SamplingParams(top_k=3, top_p=0.83), _log(BASE))
    torch.testing.assert_close(k_then_p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    all_three = _probs_for(SamplingParams(top_k=3, top_p=0.9, min_p=0.5), _log(BASE))
    torch.testing.assert_close(all_three, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_greedy_is_one_hot_with_lowest_index_tie_break() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0]], dtype=torch.bfloat16)
    batch = build_sampling_batch([SamplingParams(temperature=0.0, top_k=1, top_p=0.5)], [2], CPU)
    assert batch.all_greedy and not (batch.needs_top_k or batch.needs_top_p)
    probs = logits_to_probs(logits, batch)
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Straightforward one-row reference using a full sort."""
    if params.temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[0]).float()
    scaled = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = scaled.sort(descending=True).values[params.top_k - 1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=0)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_p < 1.0:
        sorted_probs = probs.sort(descending=True).values
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        num_kept = int((mass_before < params.top_p).sum())
        keep &= probs >= sorted_probs[num_kept - 1]
    keep &= probs >= params.min_p * probs.max()
    probs = probs * keep
    return probs / probs.sum()


def test_mixed_rows_honour_their_own_params_against_reference() -> None:
    # vocab 3000 with fairly flat logits: top_p 0.9 needs more than the first 256 candidates.
    torch.manual_seed(0)
    vocab_size = 3000
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=400, top_p=0.5, min_p=0.01),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, min_p=0.2),
        SamplingParams(temperature=2.0, top_p=0.99),
    ]
    rows_per_seq = [2, 1, 3, 1, 1, 2, 1]
    logits = torch.randn(sum(rows_per_seq), vocab_size) * 0.5
    batch = build_sampling_batch(params, rows_per_seq, CPU)
    assert batch.needs_top_k and batch.needs_top_p and batch.needs_min_p and batch.any_greedy
    probs = logits_to_probs(logits, batch)
    row_params = [p for p, n in zip(params, rows_per_seq) for _ in range(n)]
    for row, row_param in enumerate(row_params):
        expected = _reference_probs(logits[row], row_param)
        torch.testing.assert_close(probs[row], expected, rtol=1e-4, atol=1e-6)
        # the supports must match exactly, not just approximately
        assert torch.equal(probs[row] > 0, expected > 0), row
    # rows 3-5 are the top_p=0.9 sequence: its nucleus is wider than the first 256 candidates
    assert int((probs[3] > 0).sum()) > 256


def test_build_sampling_batch_flags_ignore_greedy_rows() -> None:
    batch = build_sampling_batch(
        [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3), SamplingParams(temperature=1e-7)],
        [3, 2],
        CPU,
    )
    assert batch.num_rows == 5 and batch.all_greedy
    assert not (batch.needs_top_k or batch.needs_top_p or batch.needs_min_p)
    with pytest.raises(ValueError, match="sequences"):
        build_sampling_batch([SamplingParams()], [1, 1], CPU)


def test_sample_from_probs_matches_distribution() -> None:
    probs_row = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.3])
    num_rows = 20_000
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        token_ids = sample_from_probs(probs_row.expand(num_rows, -1).contiguous(), [None] * num_rows)
    counts = torch.bincount(token_ids, minlength=5)
    assert counts[1] == 0  # zero-probability tokens are never drawn
    support = [0, 2, 3, 4]
    result = chisquare(counts[support].numpy(), (probs_row[support] * num_rows).numpy())
    assert result.pvalue > 0.001


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    vocab_size = 1000
    flat = torch.full((vocab_size,), 1.0 / vocab_size)
    greedy_row = torch.nn.functional.one_hot(torch.tensor(7), vocab_size).float()

    alone_gen = make_generator(42, CPU)
    alone = [int(sample_from_probs(flat.unsqueeze(0), [alone_gen])[0]) for _ in range(20)]

    batch_gen = make_generator(42, CPU)
    other_gen = make_generator(43, CPU)
    mixed: list[int] = []
    for _ in range(20):
        probs = torch.stack([flat, greedy_row, flat, flat])
        token_ids = sample_from_probs(probs, [other_gen, None, batch_gen, None])
        assert token_ids[1] == 7
        mixed.append(int(token_ids[2]))
    assert alone == mixed
    assert len(set(alone)) > 10  # it really is random, not a constant


def test_one_hot_rows_do_not_consume_randomness() -> None:
    generator = make_generator(5, CPU)
    assert generator is not None
    state = generator.get_state()
    one_hot = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert sample_from_probs(one_hot, [generator, generator]).tolist() == [2, 0]
    assert torch.equal(generator.get_state(), state)
    sample_from_probs(torch.tensor([[0.5, 0.5, 0.0]]), [generator])
    assert not torch.equal(generator.get_state(), state)


def test_generator_helpers() -> None:
    assert make_generator(None, CPU) is None
    first, second = make_generator(-(2**63), CPU), make_generator(-(2**63), CPU)
    assert first is not None and second is not None
    assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=second))
    assert generators_per_row([first, None], [2, 1]) == [first, first, None]
