"""The `hybrid` proposer: prompt lookup where the text is being copied, a model-based proposer everywhere else.

Each step, for each sequence that may draft, the n-gram index is asked first. If its matched suffix is at least
`min_match` tokens long (a long match means the answer is copying its context, where prompt lookup's drafts are
both free and usually right), its draft is used; otherwise the model proposer (an eagle head by default) drafts.
The choice depends only on the committed tokens, never on a sampled value, so rejection sampling stays exact:
n-gram drafts carry a one-hot distribution at the draft token (what a deterministic draft is), model drafts the
distribution they were sampled from.

The model proposer sees every step's target features (`observe`) whichever proposer drafted, so it can draft
again at any step. A k policy's stop rule is honoured by the model proposer only: an n-gram draft has no
distribution to read a top probability from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specd.errors import InvalidParameterError
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.speculation.proposer import Proposal, Proposer, ProposerTraits, SequenceView

if TYPE_CHECKING:
    from specd.config import EngineConfig
    from specd.model.llama import LlamaForCausalLM
    from specd.model.tokenizer import Tokenizer

# A draft bucket for the model proposer's drafts; n-gram drafts use their match length (>= 1) as theirs.
MODEL_BUCKET = 0


class HybridProposer(Proposer):
    """n-gram drafts where the matched suffix is >= min_match tokens, the model proposer's elsewhere."""

    traits = ProposerTraits(stops_while_drafting=True)

    def __init__(self, ngram: NgramProposer, model: Proposer, vocab_size: int, min_match: int) -> None:
        if isinstance(min_match, bool) or not isinstance(min_match, int) or min_match < 1:
            raise InvalidParameterError("speculation.hybrid_min_match", f"must be an integer >= 1, got {min_match!r}")
        self.ngram = ngram
        self.model = model
        self.vocab_size = vocab_size
        self.min_match = min_match
        self.hidden_layers = model.hidden_layers

    def propose(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> Proposal:
        copied = self.ngram.propose(seqs, num_draft_tokens)
        match_lengths = copied.draft_buckets or [0] * len(seqs)
        use_ngram = [bool(d) and n >= self.min_match for d, n in zip(copied.draft_token_ids, match_lengths)]
        model_k = [0 if copy else k for copy, k in zip(use_ngram, num_draft_tokens)]
        modelled = self.model.propose(seqs, model_k) if any(model_k) else Proposal([[] for _ in seqs], None)
        drafts = [c if copy else m for copy, c, m in zip(use_ngram, copied.draft_token_ids, modelled.draft_token_ids)]
        buckets = [n if copy else MODEL_BUCKET for copy, n in zip(use_ngram, match_lengths)]
        # The lookup costs no forward: drafting work is the model proposer's alone.
        cost = (modelled.num_draft_forwards, modelled.num_computed_draft_tokens)
        if modelled.draft_probs is None:
            # Every draft is deterministic (n-gram drafts, or model drafts the model returned without q).
            return Proposal(drafts, None, buckets, *cost)
        rows: list[torch.Tensor] = []  # one [len(d_i), vocab_size] block per sequence, in order
        model_row = 0
        for copy, draft, model_draft in zip(use_ngram, drafts, modelled.draft_token_ids):
            if copy:
                one_hot = torch.zeros(len(draft), self.vocab_size, dtype=modelled.draft_probs.dtype)
                one_hot[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] = 1.0
                rows.append(one_hot)
            else:
                rows.append(modelled.draft_probs[model_row : model_row + len(model_draft)])
                model_row += len(model_draft)
        return Proposal(drafts, torch.cat(rows), buckets, *cost)

    def observe(self, seq_ids: Sequence[int], start_positions: Sequence[int],
                hidden_per_seq: Sequence[torch.Tensor]) -> None:
        if self.model.hidden_layers is not None:
            self.model.observe(seq_ids, start_positions, hidden_per_seq)

    def release(self, seq_id: int) -> None:
        self.ngram.release(seq_id)
        self.model.release(seq_id)


def build_hybrid(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> HybridProposer:
    """`hybrid`: prompt lookup (the configured suffix lengths) + the eagle head (`draft_model` or the shipped one)."""
    from specd.speculation.eagle import build_eagle

    spec = config.speculation
    ngram = NgramProposer(NgramConfig(min_match=spec.ngram_min_match, max_match=spec.ngram_max_match))
    return HybridProposer(ngram, build_eagle(config, target, tokenizer), target.config.vocab_size,
                          spec.hybrid_min_match)
