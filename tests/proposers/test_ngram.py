"""The ngram proposer must always agree with a from-scratch search, while doing O(new tokens) index work."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.errors import InvalidParameterError
from specd.sampling.params import SamplingParams
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.speculation.proposer import SequenceView

_PARAMS = SamplingParams(temperature=0.0)


def _view(seq_id: int, token_ids: list[int] | tuple[int, ...]) -> SequenceView:
    return SequenceView(seq_id=seq_id, token_ids=token_ids, params=_PARAMS, generator=None)


def _reference(tokens: list[int], k: int, min_match: int, max_match: int) -> list[int]:
    """Brute force straight from the definition: longest n first, then the latest earlier start."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_match, min_match - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n :]
        # start + n <= length - 1: the occurrence is not the suffix itself and has a following token.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def _propose_one(proposer: NgramProposer, seq_id: int, tokens: list[int], k: int) -> list[int]:
    proposal = proposer.propose([_view(seq_id, tokens)], [k])
    assert proposal.draft_probs is None
    return proposal.draft_token_ids[0]


# ----------------------------------------------------------------------------- agreement with reference


@pytest.mark.parametrize("min_match,max_match", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_matches_reference_through_append_truncate_replace(min_match: int, max_match: int) -> None:
    rng = random.Random(1234 + 10 * min_match + max_match)
    proposer = NgramProposer(NgramConfig(min_match=min_match, max_match=max_match))
    seqs: dict[int, list[int]] = {seq_id: [rng.randrange(4)] for seq_id in range(3)}
    for _ in range(400):
        seq_id = rng.randrange(3)
        tokens = seqs[seq_id]
        action = rng.random()
        vocab = rng.choice([2, 3, 5])  # small vocabularies so matches of every length actually occur
        if action < 0.6:
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(0, 6)))
        elif action < 0.75 and len(tokens) > 1:
            del tokens[rng.randint(1, len(tokens) - 1) :]
        elif action < 0.85 and len(tokens) > 2:
            # Diverge in place at a random position but keep the length: a rollback followed by new tokens.
            tokens[rng.randrange(len(tokens))] = rng.randrange(vocab)
        else:
            seqs[seq_id] = tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        k = rng.randint(0, 6)
        got = _propose_one(proposer, seq_id, tokens, k)
        assert got == _reference(tokens, k, min_match, max_match), (tokens, k)


@settings(max_examples=150, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=1, max_size=8),
    k=st.integers(0, 5),
    min_match=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_incremental_growth_matches_reference(
    chunks: list[list[int]], k: int, min_match: int, extra: int
) -> None:
    max_match = min_match + extra
    proposer = NgramProposer(NgramConfig(min_match=min_match, max_match=max_match))
    tokens: list[int] = []
    for chunk in chunks:
        tokens = tokens + chunk  # a fresh list each call, as an engine building prompt + output would pass
        assert _propose_one(proposer, 0, tokens, k) == _reference(tokens, k, min_match, max_match)


def test_replaced_sequence_differing_only_in_middle_is_detected() -> None:
    # Same seq_id, longer new sequence, identical tail at the old length: only a full prefix check catches it.
    proposer = NgramProposer(NgramConfig(min_match=2, max_match=2))
    old = [7, 8, 1, 2, 3, 9, 9, 5, 6]
    assert _propose_one(proposer, 0, old, 3) == []
    new = [1, 2, 4, 4, 4, 9, 9, 5, 6, 1, 2]
    assert _propose_one(proposer, 0, new, 3) == _reference(new, 3, 2, 2) == [4, 4, 4]


def test_accepts_non_list_token_ids() -> None:
    proposer = NgramProposer(NgramConfig())
    tokens = (5, 6, 7, 1, 5, 6)
    assert _propose_one(proposer, 0, tokens, 4) == [7, 1, 5, 6]  # type: ignore[arg-type]
    assert _propose_one(proposer, 0, (*tokens, 7), 4) == [1, 5, 6, 7]  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- semantics


def test_respects_num_draft_tokens() -> None:
    proposer = NgramProposer(NgramConfig(min_match=1, max_match=2))
    tokens = [1, 2, 10, 11, 12, 13, 14, 3, 1, 2]
    assert _propose_one(proposer, 0, tokens, 0) == []
    assert _propose_one(proposer, 0, tokens, 1) == [10]
    assert _propose_one(proposer, 0, tokens, 4) == [10, 11, 12, 13]


def test_zero_draft_tokens_does_no_index_work() -> None:
    proposer = NgramProposer(NgramConfig())
    assert _propose_one(proposer, 0, [1, 2, 1, 2], 0) == []
    assert proposer.num_index_writes == 0


def test_short_continuation_proposes_fewer() -> None:
    proposer = NgramProposer(NgramConfig(min_match=1, max_match=3))
    # The only earlier [4, 5] is followed by [6, 4, 5] and then the sequence ends: 3 drafts though 8 asked.
    tokens = [4, 5, 6, 4, 5]
    assert _propose_one(proposer, 0, tokens, 8) == [6, 4, 5]
    # A run: the latest earlier [9] is one before the end, so the draft runs into the end after one token.
    assert _propose_one(proposer, 1, [9, 9, 9], 5) == [9]


def test_prefers_longer_match_over_more_recent_shorter_one() -> None:
    proposer = NgramProposer(NgramConfig(min_match=1, max_match=3))
    # [1, 2, 3] occurs early followed by 100; a bare [3] occurs later followed by 200.
    tokens = [1, 2, 3, 100, 0, 3, 200, 0, 1, 2, 3]
    assert _propose_one(proposer, 0, tokens, 1) == [100]
    # With max_match=1 the most recent [3] wins instead.
    assert _propose_one(NgramProposer(NgramConfig(1, 1)), 0, tokens, 1) == [200]


def test_prefers_most_recent_occurrence() -> None:
    proposer = NgramProposer(NgramConfig(min_match=2, max_match=2))
    tokens = [1, 2, 50, 51, 1, 2, 60, 61, 0, 1, 2]
    assert _propose_one(proposer, 0, tokens, 2) == [60, 61]


def test_min_match_excludes_shorter_matches() -> None:
    proposer = NgramProposer(NgramConfig(min_match=2, max_match=3))
    assert _propose_one(proposer, 0, [1, 5, 0, 1], 3) == []  # only a 1-gram [1] recurs
    assert _propose_one(proposer, 1, [1, 5, 1], 3) == []


def test_no_match_and_tiny_sequences() -> None:
    proposer = NgramProposer(NgramConfig())
    assert _propose_one(proposer, 0, [], 3) == []
    assert _propose_one(proposer, 1, [1], 3) == []
    assert _propose_one(proposer, 2, [1, 2, 3, 4], 3) == []
    assert _propose_one(proposer, 3, [1, 1], 3) == [1]


def test_mixed_batch() -> None:
    proposer = NgramProposer(NgramConfig(min_match=1, max_match=3))
    batch = [
        [1, 2, 3, 4, 1, 2],  # match of length 2 -> [3, 4, 1, 2]
        [9, 8, 7],  # no match
        [5, 6, 5, 6, 5],  # most recent [6, 5] -> [6, 5]
        [3, 3, 3, 3],  # asked for nothing
    ]
    num_draft = [3, 4, 5, 0]
    proposal = proposer.propose([_view(10 + i, t) for i, t in enumerate(batch)], num_draft)
    assert proposal.draft_probs is None
    assert proposal.draft_token_ids == [[3, 4, 1], [], [6, 5], []]
    assert proposal.draft_token_ids == [_reference(t, k, 1, 3) for t, k in zip(batch, num_draft)]


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError):
        NgramProposer(NgramConfig()).propose([_view(0, [1, 2])], [1, 2])


def test_release_drops_state_and_ignores_unknown_ids() -> None:
    proposer = NgramProposer(NgramConfig(min_match=1, max_match=1))
    tokens = [1, 2, 3, 1]
    assert _propose_one(proposer, 0, tokens, 2) == [2, 3]
    writes = proposer.num_index_writes
    assert _propose_one(proposer, 0, tokens, 2) == [2, 3]
    assert proposer.num_index_writes == writes  # unchanged sequence: nothing re-indexed
    proposer.release(0)
    proposer.release(12345)
    assert _propose_one(proposer, 0, tokens, 2) == [2, 3]
    assert proposer.num_index_writes == 2 * writes  # rebuilt from scratch after release


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"min_match": 0}, "ngram.min_match"),
        ({"max_match": 0}, "ngram.max_match"),
        ({"min_match": 3, "max_match": 2}, "ngram.min_match"),
        ({"min_match": True}, "ngram.min_match"),
        ({"max_match": 2.0}, "ngram.max_match"),
        ({"max_match": 1000}, "ngram.max_match"),
    ],
)
def test_config_validation_names_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        NgramConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
    assert field in str(err.value)


def test_config_is_frozen() -> None:
    config = NgramConfig()
    with pytest.raises(AttributeError):
        config.min_match = 2  # type: ignore[misc]


# ----------------------------------------------------------------------------- cost


def test_index_work_is_proportional_to_new_tokens_not_length() -> None:
    config = NgramConfig(min_match=1, max_match=4)
    num_lengths = config.max_match - config.min_match + 1
    proposer = NgramProposer(config)
    rng = random.Random(7)
    tokens = [rng.randrange(50) for _ in range(5000)]
    _propose_one(proposer, 0, tokens, 4)
    build_writes = proposer.num_index_writes
    assert build_writes <= num_lengths * len(tokens)

    for step in range(200):
        before = proposer.num_index_writes
        new_tokens = [rng.randrange(50) for _ in range(1 + step % 5)]
        tokens = tokens + new_tokens
        _propose_one(proposer, 0, tokens, 4)
        # Each new token completes exactly one n-gram per length: independent of the 5000-token history.
        assert proposer.num_index_writes - before == num_lengths * len(new_tokens)

    # A rollback (stop truncation) is the one case that pays for the whole sequence again.
    before = proposer.num_index_writes
    tokens = tokens[:-3]
    assert _propose_one(proposer, 0, tokens, 4) == _reference(tokens, 4, 1, 4)
    assert proposer.num_index_writes - before > len(tokens)


def test_draft_bucket_is_the_matched_suffix_length() -> None:
    proposer = NgramProposer(NgramConfig(min_match=1, max_match=3))
    tokens = [1, 2, 3, 100, 0, 3, 200, 0, 1, 2, 3]
    views = [_view(0, tokens), _view(1, [7, 8, 9]), _view(2, [5, 6, 5])]
    proposal = proposer.propose(views, [2, 2, 0])
    # [1, 2, 3] matched (n = 3); nothing recurs in [7, 8, 9] (0, no draft); k = 0 is not looked up (0).
    assert proposal.draft_token_ids == [[100, 0], [], []]
    assert proposal.draft_buckets == [3, 0, 0]
