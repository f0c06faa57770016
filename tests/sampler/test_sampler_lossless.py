"""Statistical losslessness: tokens emitted by speculation are distributed exactly as the target's p.

Tiny vocabulary, prefix-independent targets p_1, p_2, p_3 and deliberately different draft distributions
q_1, q_2. Many sequences run in one batched call. A chi-square test (significance 0.001) checks the first
token against p_1 and the joint of the first two tokens against p_1 x p_2, where sequences that stopped
after one token are continued by a second step, as the engine would. A negative control with a wrong
residual must fail the same test, which shows the test has the power to catch such a bug.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specd.sampling import rejection
from specd.sampling.rejection import rejection_sample

VOCAB = 5
NUM_SEQS = 20_000
SIGNIFICANCE = 0.001
P_1 = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])
P_2 = torch.tensor([0.10, 0.15, 0.20, 0.25, 0.30])
P_3 = torch.tensor([0.30, 0.05, 0.30, 0.05, 0.30])
Q_1 = torch.tensor([0.10, 0.10, 0.20, 0.30, 0.30])
Q_2 = torch.tensor([0.35, 0.30, 0.15, 0.10, 0.10])


@pytest.fixture(autouse=True)
def _seeded_default_rng() -> Iterator[None]:
    # Unseeded sequences (generator None) use torch's default RNG: fix it here, restore it afterwards.
    with torch.random.fork_rng():
        torch.manual_seed(2024)
        yield


def _run_step(
    target_rows: list[torch.Tensor], draft_dists: list[torch.Tensor] | None, drafts: torch.Tensor
) -> rejection.RejectionResult:
    """One verification step for NUM_SEQS-like batches: every sequence has the same p_j and q_j.

    drafts: [num_seqs, k] int64. draft_dists None means a deterministic proposer.
    """
    num_seqs, num_draft = drafts.shape
    target_probs = torch.stack(target_rows).repeat(num_seqs, 1)  # [num_seqs * (k + 1), VOCAB]
    draft_probs = None if draft_dists is None else torch.stack(draft_dists).repeat(num_seqs, 1)
    return rejection_sample(target_probs, drafts.reshape(-1), draft_probs, [num_draft] * num_seqs, [None] * num_seqs)


def _sample_drafts(dists: list[torch.Tensor], num_seqs: int) -> torch.Tensor:
    """[num_seqs, len(dists)] int64, column j drawn from dists[j]."""
    columns = [torch.multinomial(dist, num_seqs, replacement=True) for dist in dists]
    return torch.stack(columns, dim=1)


def _first_two_tokens() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Emitted tokens 1 and 2 per sequence, plus whether token 2 came from the same (first) step."""
    step_1 = _run_step([P_1, P_2, P_3], [Q_1, Q_2], _sample_drafts([Q_1, Q_2], NUM_SEQS))
    first = np.array([tokens[0] for tokens in step_1.output_token_ids])
    second = np.full(NUM_SEQS, -1)
    from_first_step = np.array([len(tokens) >= 2 for tokens in step_1.output_token_ids])
    second[from_first_step] = [tokens[1] for tokens in step_1.output_token_ids if len(tokens) >= 2]
    # Sequences that emitted only a correction continue: the next step drafts from q_2 against p_2.
    num_continuing = int((~from_first_step).sum())
    step_2 = _run_step([P_2, P_3], [Q_2], _sample_drafts([Q_2], num_continuing))
    second[~from_first_step] = [tokens[0] for tokens in step_2.output_token_ids]
    return first, second, from_first_step


def _pvalue(tokens: np.ndarray, expected_probs: torch.Tensor) -> float:
    counts = np.bincount(tokens, minlength=expected_probs.numel())
    expected = expected_probs.double().numpy()
    # float32 products do not sum to exactly 1, and scipy insists the totals agree
    return float(chisquare(counts, expected / expected.sum() * len(tokens)).pvalue)


def test_first_token_follows_p() -> None:
    first, _, _ = _first_two_tokens()
    assert _pvalue(first, P_1) > SIGNIFICANCE


def test_first_two_tokens_follow_p1_times_p2() -> None:
    first, second, from_first_step = _first_two_tokens()
    joint = torch.outer(P_1, P_2).reshape(-1)  # [VOCAB * VOCAB]
    assert _pvalue(first * VOCAB + second, joint) > SIGNIFICANCE
    # Given d_1 was accepted, token 2 is d_2 or its correction and must still follow p_2.
    assert _pvalue(second[from_first_step], P_2) > SIGNIFICANCE
    # Both paths were exercised heavily (acceptance of d_1 is sum(min(p_1, q_1)) = 0.55).
    assert 0.4 < from_first_step.mean() < 0.7


def test_deterministic_proposer_is_lossless() -> None:
    # A fixed draft (q one-hot) must not bias the output either: accept w.p. p(d), else p without d.
    drafts = torch.tensor([[0, 3]]).repeat(NUM_SEQS, 1)
    result = _run_step([P_1, P_2, P_3], None, drafts)
    first = np.array([tokens[0] for tokens in result.output_token_ids])
    assert _pvalue(first, P_1) > SIGNIFICANCE
    second = np.array([tokens[1] for tokens in result.output_token_ids if len(tokens) >= 2])
    assert _pvalue(second, P_2) > SIGNIFICANCE


def test_negative_control_wrong_residual_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Correct corrections come from norm(max(0, p - q)); sampling them from p instead over-weights tokens
    # the draft already favours. The same chi-square test must reject that.
    def correction_from_p(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        return target_probs

    monkeypatch.setattr(rejection, "_correction_probs", correction_from_p)
    first, second, _ = _first_two_tokens()
    assert _pvalue(first, P_1) < SIGNIFICANCE
    assert _pvalue(first * VOCAB + second, torch.outer(P_1, P_2).reshape(-1)) < SIGNIFICANCE
