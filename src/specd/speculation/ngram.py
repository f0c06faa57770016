"""Prompt-lookup (n-gram) proposer: draft by copying what followed the latest earlier copy of the suffix.

For a sequence t[0:L] and suffix length n (tried from max_match down to min_match), an earlier occurrence is
a start p with t[p:p+n] == t[L-n:L] and p + n <= L - 1, so at least one token follows it. The most recent
such p wins and the draft is t[p+n : p+n+k]; it is shorter than k when it runs into the end of the sequence.
The first n with any occurrence decides; no occurrence for any n means no draft.

Searching from scratch every step would cost O(L * max_match) Python work per sequence, far too slow for
thousands of tokens times a batch of 32 on a small CPU. Instead each sequence keeps, for every n, a dict
from n-gram to the end of its latest occurrence, updated only with the n-grams the newly committed tokens
complete. A step then costs O(new tokens * num_n + max_match) dict operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specd.errors import InvalidParameterError
from specd.speculation.proposer import Proposal, Proposer, ProposerTraits, SequenceView

if TYPE_CHECKING:
    from specd.config import EngineConfig
    from specd.model.llama import LlamaForCausalLM
    from specd.model.tokenizer import Tokenizer

# n-grams longer than this are never useful for prompt lookup and only multiply index memory.
_MAX_MATCH_LIMIT = 64


def check_match_lengths(min_match: object, max_match: object, min_field: str, max_field: str) -> None:
    """The suffix lengths prompt lookup accepts: integers in [1, 64], min <= max. Raises naming the field."""
    for name, value in ((min_field, min_match), (max_field, max_match)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidParameterError(name, f"must be an integer, got {type(value).__name__}")
        if value < 1 or value > _MAX_MATCH_LIMIT:
            raise InvalidParameterError(name, f"must be in [1, {_MAX_MATCH_LIMIT}], got {value}")
    if min_match > max_match:  # type: ignore[operator]
        raise InvalidParameterError(min_field, f"must be <= {max_field} ({max_match}), got {min_match}")


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """Which suffix lengths to look up.

    min_match: shortest suffix n-gram tried (1 <= min_match <= max_match).
    max_match: longest suffix n-gram, tried first; longer matches are more specific, so they win.
    Memory per sequence is about (max_match - min_match + 1) dict entries per token.
    """

    min_match: int = 1
    max_match: int = 4

    def __post_init__(self) -> None:
        check_match_lengths(self.min_match, self.max_match, "ngram.min_match", "ngram.max_match")


@dataclass(slots=True)
class _SeqIndex:
    """One sequence's index, valid for exactly `tokens`.

    tokens: the token ids the index was built from (our own copy, so a caller mutating its list in place
        cannot silently desync us).
    latest_end[n - min_match]: n-gram -> end (exclusive) of its most recent occurrence among those ending at
        or before len(tokens) - 1, i.e. those with at least one following token. Later writes overwrite
        earlier ones, which is what makes the stored occurrence the most recent.
    """

    tokens: list[int] = field(default_factory=list)
    latest_end: list[dict[tuple[int, ...], int]] = field(default_factory=list)


class NgramProposer(Proposer):
    """Deterministic drafts from an incremental n-gram index per sequence (draft_probs is always None)."""

    traits = ProposerTraits(free_drafts=True)

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self._indexes: dict[int, _SeqIndex] = {}
        # Dict writes done by index maintenance since construction. Exposed so tests can check that a step
        # touches O(new tokens) entries rather than O(sequence length); not a metric for users.
        self.num_index_writes = 0

    def propose(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> Proposal:
        """Return up to num_draft_tokens[i] drafts for each sequence; k_i == 0 gives [] and skips indexing.

        Changes only this proposer's per-sequence indexes: each one is brought in step with seqs[i].token_ids
        (extended with the new tokens, or rebuilt if the committed tokens no longer extend what it saw).
        """
        if len(seqs) != len(num_draft_tokens):
            raise ValueError(f"got {len(seqs)} sequences but {len(num_draft_tokens)} draft counts")
        drafts: list[list[int]] = []
        match_lengths: list[int] = []
        for seq, num_draft in zip(seqs, num_draft_tokens):
            if num_draft <= 0:
                # Skipping is safe: the next call that wants drafts indexes everything it missed.
                drafts.append([])
                match_lengths.append(0)
                continue
            index = self._sync(seq.seq_id, seq.token_ids)
            draft, match_length = self._lookup(index, num_draft)
            drafts.append(draft)
            match_lengths.append(match_length)
        # The matched suffix length is the draft's confidence class: longer matches are copied more reliably.
        return Proposal(draft_token_ids=drafts, draft_probs=None, draft_buckets=match_lengths)

    def release(self, seq_id: int) -> None:
        """Drop the sequence's index; unknown ids are ignored so abort paths need not check first."""
        self._indexes.pop(seq_id, None)

    def _sync(self, seq_id: int, token_ids: Sequence[int]) -> _SeqIndex:
        """Return seq_id's index made valid for token_ids, reusing what still holds."""
        current = token_ids if isinstance(token_ids, list) else list(token_ids)
        index = self._indexes.get(seq_id)
        num_indexed = len(index.tokens) if index is not None else 0
        # The full prefix compare is one C-level list comparison (pointer-equal ints short-circuit), a few
        # microseconds for thousands of tokens; a tail-only check would miss a reused seq_id whose new
        # prompt differs only in the middle, and then drafts would silently disagree with a fresh search.
        if index is None or len(current) < num_indexed or current[:num_indexed] != index.tokens:
            index = _SeqIndex(latest_end=[{} for _ in self._match_lengths()])
            self._indexes[seq_id] = index
            num_indexed = 0
        if len(current) > num_indexed:
            index.tokens.extend(current[num_indexed:])
            self._index_ends(index, num_indexed, len(current))
        return index

    def _index_ends(self, index: _SeqIndex, old_len: int, new_len: int) -> None:
        """Record the n-grams that became eligible when the sequence grew from old_len to new_len tokens.

        An n-gram ending at `end` (exclusive) is eligible once token `end` exists, i.e. end <= len - 1, so
        growth adds exactly the ends in [old_len, new_len - 1].
        """
        tokens = index.tokens
        for offset, latest_end in enumerate(index.latest_end):
            n = self.config.min_match + offset
            first_end = max(old_len, n)
            if first_end >= new_len:
                continue
            # zip builds the n-gram tuples in C, which matters when a fresh prompt of thousands of tokens is
            # indexed at once; dict.update keeps the last write per key, i.e. the most recent occurrence.
            window = tokens[first_end - n : new_len - 1]
            grams = zip(*(window[shift:] for shift in range(n)))
            latest_end.update(zip(grams, range(first_end, new_len)))
            self.num_index_writes += new_len - first_end

    def _lookup(self, index: _SeqIndex, num_draft: int) -> tuple[list[int], int]:
        """Continuation of the most recent earlier copy of the longest matching suffix (at most num_draft
        tokens) and the suffix length n that matched (0: no match, no draft)."""
        tokens = index.tokens
        length = len(tokens)
        for n in reversed(self._match_lengths()):
            if n >= length:
                continue  # an earlier occurrence needs n tokens plus one following token before the suffix
            end = index.latest_end[n - self.config.min_match].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + num_draft], n
        return [], 0

    def _match_lengths(self) -> range:
        return range(self.config.min_match, self.config.max_match + 1)


def build_ngram(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> NgramProposer:
    """`ngram`: prompt lookup with the configured suffix lengths."""
    spec = config.speculation
    return NgramProposer(NgramConfig(min_match=spec.ngram_min_match, max_match=spec.ngram_max_match))
