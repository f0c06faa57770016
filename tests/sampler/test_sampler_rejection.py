"""Hand-checked cases of the batched rejection sampler: acceptance, corrections, bonus, greedy, ragged k."""

from __future__ import annotations

import pytest
import torch

from specd.sampling.processing import is_one_hot, sample_from_probs
from specd.sampling.rejection import _correction_probs, rejection_sample
from specd.testing import make_generator

CPU = torch.device("cpu")
VOCAB = 4


def _one_hot(*token_ids: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token_ids), VOCAB).float()


def _gen(seed: int) -> torch.Generator:
    generator = make_generator(seed, CPU)
    assert generator is not None
    return generator


def test_deterministic_accepts_then_residual_correction() -> None:
    # d_1 = 1: p(1) = 0.5 >= q(1) = 0.5, accepted whatever the uniform.
    # d_2 = 2: p(2) = 0 -> rejected; residual max(0, p - q) = [0, 0.5, 0, 0] -> correction is token 1,
    # which sampling from p itself would give only half the time.
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.4, 0.5, 0.0, 0.1], [0.25, 0.25, 0.25, 0.25]])
    draft_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.4, 0.0, 0.5, 0.1]])
    for seed in range(10):
        result = rejection_sample(target_probs, torch.tensor([1, 2]), draft_probs, [2], [_gen(seed)])
        assert result.num_accepted == [1]
        assert result.output_token_ids == [[1, 1]]


def test_all_accepted_gives_bonus_from_last_row() -> None:
    # p(d) >= q(d) at both positions, so both drafts are accepted for any uniform; the bonus row is one-hot.
    target_probs = torch.cat([torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]), _one_hot(3)])
    draft_probs = torch.tensor([[0.0, 0.0, 0.3, 0.7], [0.4, 0.0, 0.6, 0.0]])
    for seed in range(10):
        result = rejection_sample(target_probs, torch.tensor([2, 0]), draft_probs, [2], [_gen(seed)])
        assert result.output_token_ids == [[2, 0, 3]] and result.num_accepted == [2]


@pytest.mark.parametrize("seed", range(40))
def test_forced_uniform_and_noise_follow_the_documented_draw_order(seed: int) -> None:
    # Accept probability of d_1 = 0 is p / q = 0.3 / 0.6 = 0.5. The sampler must draw k uniforms, then one
    # vocab-sized uniform vector (turned into exponential noise) for the final token, all from the
    # sequence's own generator; replaying that order with a twin generator predicts decision and token.
    p_1 = torch.tensor([0.3, 0.2, 0.1, 0.4])
    q_1 = torch.tensor([0.6, 0.1, 0.3, 0.0])
    p_2 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    result = rejection_sample(torch.stack([p_1, p_2]), torch.tensor([0]), q_1[None], [1], [_gen(seed)])

    twin = _gen(seed)
    uniform = torch.rand(1, generator=twin)
    accept = bool(uniform * 0.6 < 0.3)
    final = p_2 if accept else (p_1 - q_1).clamp_min(0) / (p_1 - q_1).clamp_min(0).sum()
    noise = -torch.log1p(-torch.rand(VOCAB, generator=twin))  # Exp(1) per token
    expected_token = int((final / noise).argmax())
    assert result.num_accepted == [int(accept)]
    assert result.output_token_ids == [[0, expected_token] if accept else [expected_token]]
    if not accept:
        assert expected_token in (1, 3)  # the residual [0, 0.1, 0, 0.4] has no mass on 0 or 2


def test_forced_uniforms_hit_both_outcomes() -> None:
    # Guards the parametrised test above against seeds that all fall on one side of 0.5.
    outcomes = {bool(torch.rand(1, generator=_gen(seed)) < 0.5) for seed in range(40)}
    assert outcomes == {True, False}


def test_greedy_first_reject_all_accept_and_no_randomness_consumed() -> None:
    # Three greedy sequences: argmax rows are [1, 2, 3 | 0] , [2, 2 | 1], [3 | 0].
    target_probs = torch.cat([_one_hot(1, 2, 3, 0), _one_hot(2, 2, 1), _one_hot(3, 0)])
    draft_token_ids = torch.tensor([1, 2, 3, 2, 1, 0])  # all right | second wrong | first wrong
    generators = [_gen(1), _gen(2), _gen(3)]
    states = [g.get_state() for g in generators]
    result = rejection_sample(target_probs, draft_token_ids, None, [3, 2, 1], generators)
    assert result.num_accepted == [3, 1, 0]
    assert result.output_token_ids == [[1, 2, 3, 0], [2, 2], [3]]
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states))


def test_greedy_target_with_a_sampled_draft_distribution() -> None:
    # q puts mass on the argmax too; the residual max(0, onehot(1) - q) is still one-hot at 1.
    target_probs = _one_hot(1, 0)
    draft_probs = torch.tensor([[0.2, 0.3, 0.5, 0.0]])
    generator = _gen(9)
    state = generator.get_state()
    result = rejection_sample(target_probs, torch.tensor([2]), draft_probs, [1], [generator])
    assert result.output_token_ids == [[1]] and result.num_accepted == [0]
    assert torch.equal(generator.get_state(), state)


def test_zero_draft_rows_mixed_with_four_draft_rows() -> None:
    sampled_row = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    target_probs = torch.cat(
        [
            _one_hot(3),  # k = 0, greedy
            _one_hot(0, 1, 2, 3, 0),  # k = 4, drafts all right -> bonus 0
            sampled_row,  # k = 0, sampled
            _one_hot(2, 1, 1, 1, 3),  # k = 4, third draft wrong
        ]
    )
    draft_token_ids = torch.tensor([0, 1, 2, 3, 2, 1, 0, 1])
    result = rejection_sample(target_probs, draft_token_ids, None, [0, 4, 0, 4], [_gen(s) for s in range(4)])
    assert result.num_accepted == [0, 4, 0, 2]
    assert result.output_token_ids[0] == [3]
    assert result.output_token_ids[1] == [0, 1, 2, 3, 0]
    assert result.output_token_ids[3] == [2, 1, 1]
    # a k = 0 sequence is plain sampling from its single row with its own generator
    assert result.output_token_ids[2] == sample_from_probs(sampled_row, [_gen(2)]).tolist()


def test_deterministic_proposer_equals_explicit_one_hot_q() -> None:
    torch.manual_seed(0)
    num_draft_tokens = [3, 0, 1, 4, 2] * 10
    num_drafts, num_seqs = sum(num_draft_tokens), len(num_draft_tokens)
    target_probs = torch.softmax(torch.randn(num_drafts + num_seqs, VOCAB) * 2, dim=-1)
    draft_token_ids = torch.randint(0, VOCAB, (num_drafts,))
    one_hot_q = torch.nn.functional.one_hot(draft_token_ids, VOCAB).float()
    implicit = rejection_sample(
        target_probs, draft_token_ids, None, num_draft_tokens, [_gen(s) for s in range(num_seqs)]
    )
    explicit = rejection_sample(
        target_probs, draft_token_ids, one_hot_q, num_draft_tokens, [_gen(s) for s in range(num_seqs)]
    )
    assert implicit == explicit
    assert 0 < sum(implicit.num_accepted) < num_drafts  # a mix of accepts and rejects was exercised


def test_seeded_result_does_not_depend_on_batch_neighbours() -> None:
    torch.manual_seed(1)
    rows = torch.softmax(torch.randn(4, VOCAB), dim=-1)  # one sequence with k = 3
    drafts = torch.tensor([0, 1, 2])
    q = torch.softmax(torch.randn(3, VOCAB), dim=-1)
    alone = rejection_sample(rows, drafts, q, [3], [_gen(77)])

    other_rows = torch.softmax(torch.randn(3 + 2, VOCAB), dim=-1)
    batched = rejection_sample(
        torch.cat([other_rows[:3], rows, other_rows[3:]]),
        torch.tensor([3, 3, 0, 1, 2, 1]),
        torch.cat([q[:1], q[:1], q, q[:1]]),
        [2, 3, 1],
        [None, _gen(77), _gen(5)],
    )
    assert batched.output_token_ids[1] == alone.output_token_ids[0]
    assert batched.num_accepted[1] == alone.num_accepted[0]


def test_zero_draft_probability_never_gives_nan() -> None:
    # q(d) = 0 < p(d): the ratio is infinite, so d is accepted.
    accepted = rejection_sample(
        torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]),
        torch.tensor([1]),
        torch.tensor([[1.0, 0.0, 0.0, 0.0]]),
        [1],
        [_gen(0)],
    )
    assert accepted.output_token_ids == [[1, 3]]
    # p = q with q(d) = p(d) = 0: rejected, the residual is all zero, so the correction comes from p.
    p_and_q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for seed in range(10):
        result = rejection_sample(torch.cat([p_and_q, _one_hot(3)]), torch.tensor([2]), p_and_q, [1], [_gen(seed)])
        assert result.num_accepted == [0] and result.output_token_ids[0][0] in (0, 1)


def test_correction_probs_residual_and_fallback() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]])
    corrected = _correction_probs(p, q)
    torch.testing.assert_close(corrected, torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]))
    assert not corrected.isnan().any()


def test_rejects_inconsistent_shapes() -> None:
    target_probs = torch.full((3, VOCAB), 0.25)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(target_probs, torch.tensor([0, 1, 2]), None, [3], [None])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(target_probs, torch.tensor([0, 1]), torch.ones(2, 5), [2], [None])
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(target_probs, torch.tensor([0, 1]), None, [2], [None, None])


def test_greedy_verify_equals_the_general_sampler_on_one_hot_distributions() -> None:
    from specd.sampling.params import SamplingParams
    from specd.sampling.processing import build_sampling_batch, logits_to_probs
    from specd.sampling.rejection import greedy_verify

    rng = torch.Generator().manual_seed(5)
    for trial in range(200):
        num_draft = torch.randint(0, 5, (int(torch.randint(1, 5, (1,), generator=rng)),), generator=rng).tolist()
        rows = sum(num_draft) + len(num_draft)
        # Small integer logits over a small vocabulary: ties and exact draft hits are frequent.
        logits = torch.randint(0, 3, (rows, VOCAB), generator=rng).float()
        argmax = logits.argmax(dim=-1).tolist()
        drafts: list[int] = []
        row = 0
        for k in num_draft:  # drafts that follow the target for a while, then (sometimes) deviate
            for j in range(k):
                hit = torch.rand(1, generator=rng).item() < 0.7
                drafts.append(argmax[row + j] if hit else int(torch.randint(0, VOCAB, (1,), generator=rng)))
            row += k + 1
        params = [SamplingParams(temperature=0.0)] * len(num_draft)
        probs = logits_to_probs(logits, build_sampling_batch(params, [k + 1 for k in num_draft], CPU))
        general = rejection_sample(probs, torch.tensor(drafts, dtype=torch.long), None, num_draft,
                                   [None] * len(num_draft))
        fast = greedy_verify(logits, drafts, num_draft)
        assert fast == general, (trial, num_draft, drafts, argmax)
    with pytest.raises(ValueError, match="shape"):
        greedy_verify(torch.zeros(3, VOCAB), [1], [1])


def test_near_one_hot_target_row_is_sampled_not_treated_as_greedy() -> None:
    # float32 softmax([20, 0]) rounds its top entry to exactly 1.0 while p(1) = 2e-9 remains: draft 1 under
    # q = [.5, .5] must be accepted with probability p(1) / q(1) ~ 4e-9, i.e. never in 100 tries.
    p = torch.softmax(torch.tensor([20.0, 0.0]), dim=-1)
    assert p[0] == 1.0 and 0 < p[1] < 1e-8
    target_probs = torch.stack([p, torch.tensor([0.5, 0.5])])
    draft_probs = torch.tensor([[0.5, 0.5]])
    accepted = sum(
        rejection_sample(target_probs, torch.tensor([1]), draft_probs, [1], [_gen(seed)]).num_accepted[0]
        for seed in range(100)
    )
    assert accepted == 0


def test_near_one_hot_row_with_deterministic_draft_on_a_large_vocabulary() -> None:
    # ngram-style drafts (q one-hot at the draft) on a 32k vocabulary: p(d) ~ 9e-14, so never accepted.
    logits = torch.zeros(32_000)
    logits[7] = 40.0
    p = torch.softmax(logits, dim=-1)
    assert p[7] == 1.0 and 0 < p[123] < 1e-12
    target_probs = torch.stack([p, p])
    accepted = sum(
        rejection_sample(target_probs, torch.tensor([123]), None, [1], [_gen(seed)]).num_accepted[0]
        for seed in range(100)
    )
    assert accepted == 0


def test_only_exactly_one_hot_rows_skip_randomness() -> None:
    saturated = torch.softmax(torch.tensor([[20.0, 0.0, 0.0, 0.0]]), dim=-1)
    assert is_one_hot(_one_hot(2)).tolist() == [True]
    assert is_one_hot(saturated).tolist() == [False]
    exact, near = _gen(1), _gen(1)
    before = exact.get_state()
    sample_from_probs(_one_hot(2), [exact])
    assert torch.equal(exact.get_state(), before)  # greedy: the generator is not advanced
    sample_from_probs(saturated, [near])
    assert not torch.equal(near.get_state(), before)  # saturated but not one-hot: really sampled


@pytest.mark.parametrize("with_q", [True, False])
def test_out_of_range_draft_ids_are_refused(with_q: bool) -> None:
    target_probs = torch.full((2, VOCAB), 1 / VOCAB)
    draft_probs = torch.full((1, VOCAB), 1 / VOCAB) if with_q else None
    for bad in (-1, VOCAB):
        with pytest.raises(ValueError, match=r"draft_token_ids must lie in \[0, 4\)"):
            rejection_sample(target_probs, torch.tensor([bad]), draft_probs, [1], [_gen(0)])
