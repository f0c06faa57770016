"""The one interface every proposer implements; the engine never branches on which proposer it has.

A proposer is asked, once per step, for up to k_i draft tokens for each running sequence. It keeps its own
state (an n-gram index, a draft model's KV cache) and keeps it in step with what the target actually
committed by comparing against `SequenceView.token_ids` on the next call: whatever it cached beyond the
longest common prefix with the committed tokens is rolled back. So no explicit accept/rollback callback is
needed and stop truncation is handled the same way as rejection.

Two optional capabilities, both free for proposers that don't use them:
- a stop signal while drafting (`SequenceView.draft_stop`, set by the sequence's k policy), which a proposer
  that drafts one position at a time from a model distribution consults before each position;
- the target's hidden states: a proposer that sets `hidden_layers` gets, after every step, the residual streams
  of the rows the target kept (`observe`). Proposers that leave it None are never called and the target forward
  computes no features for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from specd.sampling.params import SamplingParams


class DraftStop(Protocol):
    """A k policy's rule for ending a draft early, consulted by model-based proposers before each position.

    Lossless by construction: its only input about position j is the draft's top probability there, read from
    the draft model's raw distribution (softmax of its logits, before the request's temperature and filters)
    *before* the draft token is sampled. Whether position j is drafted (and so verified) then depends only on the
    accepted prefix, never on the value sampled at j, and the rejection rule emits exactly the target's p_j either
    way. (A rule that looked at the sampled token's own probability would bias sampled output.)
    """

    def stop(self, position: int, top_prob: float) -> bool:
        """True to end the draft before `position` (0-based), whose raw top probability is `top_prob`."""
        ...


@dataclass(frozen=True, slots=True)
class SequenceView:
    """What a proposer may read about one running sequence (read-only).

    token_ids: prompt + every committed output token, in order. The last one has not been scored by the
    target yet; drafts continue after it.
    draft_stop: the sequence's k policy's stop-while-drafting rule, or None (draft all k_i).
    """

    seq_id: int
    token_ids: Sequence[int]
    params: SamplingParams
    generator: torch.Generator | None
    draft_stop: DraftStop | None = None
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt (penalties treat it apart)


class Proposal(NamedTuple):
    """Ragged draft tokens for one step.

    draft_token_ids[i] has at most the k_i asked for sequence i (fewer is allowed, zero too), each an id in
    [0, vocab_size): the engine refuses anything else with an error naming the proposer (no placeholders).
    draft_probs: [sum(len(d) for d in draft_token_ids), vocab_size] float32, the processed distribution
    each draft token was sampled from, flattened in sequence order; None for deterministic proposers
    (the rejection sampler then treats q as one-hot at the draft token).
    draft_buckets: optional per-sequence confidence class of the draft, from the proposer's own signal (ngram:
    the length of the matched suffix). The goodput k policy learns acceptance per bucket; None = one class.
    num_draft_forwards, num_computed_draft_tokens: what drafting cost, for the metrics (docs/metrics.md "Drafting
    work"): the model forward passes this call ran (batched: one pass over all its sequences counts once), and
    the draft positions whose next-token distribution they computed, one per sequence per pass, a position a
    stop rule (DraftStop) then dropped included. A proposer that runs no model (prompt lookup) leaves both 0.
    """

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None
    draft_buckets: list[int] | None = None
    num_draft_forwards: int = 0
    num_computed_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ProposerTraits:
    """Facts about a kind of proposer that k policies declare their compatibility against.

    stops_while_drafting: drafts one position at a time from a model distribution and honours
        `SequenceView.draft_stop` before each position.
    free_drafts: drafting costs (next to) nothing and draft tokens carry no distribution, so a draft can be cut
        after it was made without wasting work (prompt lookup).
    """

    stops_while_drafting: bool = False
    free_drafts: bool = False


class Proposer(Protocol):
    """Implemented by ngram, draft-model and layer-skip proposers.

    Subclass it to inherit the defaults of the optional parts: no hidden states (`hidden_layers = None`, and
    `observe` is then never called) and traits that promise nothing.
    """

    traits: ClassVar[ProposerTraits] = ProposerTraits()
    # Residual streams of the target this proposer needs (LlamaForCausalLM.forward_with_hidden's hidden_layers:
    # layer indices, -1 = the final normed hidden state), or None for none.
    hidden_layers: tuple[int, ...] | None = None

    def propose(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> Proposal:
        """Return at most num_draft_tokens[i] drafts for seqs[i]; k_i == 0 must return [] for it.

        Changes the proposer's own per-sequence state (caches, indices) only.
        """
        ...

    def observe(
        self,
        seq_ids: Sequence[int],
        start_positions: Sequence[int],
        hidden_per_seq: Sequence[torch.Tensor],  # each [num_kept_rows_i, len(hidden_layers) * hidden_size]
    ) -> None:
        """The target's hidden states of the rows it kept this step, called after verification and commit, only
        for proposers whose `hidden_layers` is not None, and only for sequences still running.

        Row r of hidden_per_seq[i] is the feature at position start_positions[i] + r, i.e. of the token the target
        read there, which produced the token at the next position. For a decode row [last, d_1..d_k] with a
        drafts accepted and nothing cut by a stop rule, the rows are 0..a (the features behind the accepted drafts
        and the bonus/correction token); a stop rule can only cut that shorter. For a prefill chunk, every row.
        """
        return None

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence and free whatever it held."""
        ...
