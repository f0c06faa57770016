"""The hybrid proposer routes each sequence by its n-gram match length, returns one distribution row per draft token
(one-hot for n-gram drafts, the model's own for model drafts), keeps the model fed with every step's features, and
is built from the registry with the shipped-head rules of eagle."""

from __future__ import annotations

import pytest
import torch

from specd.config import SpeculationConfig
from specd.errors import InvalidParameterError
from specd.sampling.params import SamplingParams
from specd.speculation.eagle import EagleProposer
from specd.speculation.hybrid import MODEL_BUCKET, HybridProposer
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.speculation.proposer import SequenceView
from specd.testing import random_draft_head

COPYING = [3, 4, 5, 6, 7, 9, 3, 4, 5]  # suffix [3, 4, 5] recurs: ngram drafts [6, 7, 9]
FRESH = [10, 11, 12, 13, 14]  # nothing recurs


def _views(params: SamplingParams) -> list[SequenceView]:
    return [SequenceView(seq_id=i, token_ids=t, params=params, generator=torch.Generator().manual_seed(i))
            for i, t in enumerate((COPYING, FRESH))]


def _hybrid(tiny_model, min_match: int) -> tuple[HybridProposer, EagleProposer]:
    eagle = EagleProposer(random_draft_head(tiny_model, 40), 4, 64)
    hybrid = HybridProposer(NgramProposer(NgramConfig(1, 4)), eagle, tiny_model.config.vocab_size, min_match)
    # The head drafts only for positions whose target features it was handed (the engine does this each step).
    hidden = tiny_model.config.hidden_size
    for i, tokens in enumerate((COPYING, FRESH)):
        hybrid.observe([i], [0], [torch.randn(len(tokens) - 1, hidden, generator=torch.Generator().manual_seed(i))])
    return hybrid, eagle


def test_long_matches_copy_and_the_rest_asks_the_model(tiny_model) -> None:
    hybrid, _ = _hybrid(tiny_model, min_match=3)
    proposal = hybrid.propose(_views(SamplingParams(temperature=0.8)), [3, 3])
    copied, modelled = proposal.draft_token_ids
    assert copied == [6, 7, 9]
    assert len(modelled) == 3
    assert proposal.draft_buckets == [3, MODEL_BUCKET]
    probs = proposal.draft_probs
    assert probs is not None and probs.shape == (6, tiny_model.config.vocab_size)
    # n-gram rows: one-hot at the draft token (a deterministic draft); model rows: a distribution over the head's
    # draft vocabulary, with the drafted token possible.
    assert torch.equal(probs[:3].argmax(-1), torch.tensor(copied)) and torch.all(probs[:3].sum(-1) == 1)
    assert torch.all(probs[:3].count_nonzero(-1) == 1)
    torch.testing.assert_close(probs[3:].sum(-1), torch.ones(3))
    assert all(probs[3 + j, t] > 0 for j, t in enumerate(modelled))


def test_a_short_match_is_not_trusted_and_k_zero_drafts_nothing(tiny_model) -> None:
    hybrid, _ = _hybrid(tiny_model, min_match=4)  # [3, 4, 5] is a 3-token match: too short
    proposal = hybrid.propose(_views(SamplingParams(temperature=0.0)), [2, 0])
    assert len(proposal.draft_token_ids[0]) == 2 and proposal.draft_token_ids[1] == []
    assert proposal.draft_buckets == [MODEL_BUCKET, MODEL_BUCKET]
    assert proposal.draft_probs is not None and proposal.draft_probs.shape[0] == 2


def test_only_ngram_drafts_carry_no_distribution(tiny_model) -> None:
    hybrid, _ = _hybrid(tiny_model, min_match=1)
    proposal = hybrid.propose(_views(SamplingParams(temperature=0.0))[:1], [2])
    assert proposal.draft_token_ids == [[6, 7]] and proposal.draft_probs is None


def test_features_reach_the_model_and_release_frees_both(tiny_model) -> None:
    hybrid, eagle = _hybrid(tiny_model, min_match=3)
    assert hybrid.hidden_layers == eagle.hidden_layers == (-1,)
    assert set(eagle._seqs) == {0, 1}
    hybrid.propose(_views(SamplingParams()), [2, 2])
    hybrid.release(0)
    assert 0 not in eagle._seqs and 0 not in hybrid.ngram._indexes


def test_config_validates_the_match_length() -> None:
    with pytest.raises(InvalidParameterError, match=r"speculation\.hybrid_min_match"):
        SpeculationConfig(method="hybrid", hybrid_min_match=0)
    with pytest.raises(InvalidParameterError, match=r"speculation.hybrid_min_match: must be <= .*ngram_max_match"):
        SpeculationConfig(method="hybrid", hybrid_min_match=5, ngram_max_match=4)
    with pytest.raises(InvalidParameterError, match="goodput"):
        SpeculationConfig(method="hybrid", k_policy="goodput")
