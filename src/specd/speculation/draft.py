"""Model-based proposers: a separate draft model (`draft`) or the target's own first N layers (`layerskip`).

Both are the same mechanism: a Llama-family model run autoregressively for k_i steps, batched across
sequences, with its own KV cache. `layerskip` passes the target model itself and `num_layers=N`, so the
draft shares the target's weights (no extra weight memory) and only adds an N-layer KV cache.

State sync: for each sequence the proposer remembers which tokens its cache holds. At the next call it keeps
the longest common prefix with the committed tokens and recomputes from there, so rejected drafts, the
target's bonus/correction token and stop truncation are all caught up in the first (ragged) forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specd.errors import InvalidParameterError, ModelLoadError
from specd.model.attention import ForwardBatch
from specd.model.llama import LlamaForCausalLM, build_model
from specd.model.loader import load_checkpoint
from specd.model.tokenizer import Tokenizer
from specd.sampling.penalties import TokenHistory, adjust_logits
from specd.sampling.processing import build_sampling_batch, logits_to_probs
from specd.speculation.drafting import DraftLoop, common_prefix
from specd.speculation.proposer import Proposal, Proposer, ProposerTraits, SequenceView

if TYPE_CHECKING:
    from specd.config import EngineConfig


class DraftModelProposer(Proposer):
    """Drafts with `model` (first `num_layers` layers if given).

    A sequence whose view carries a `draft_stop` rule (the `confidence` k policy) is asked before each position j
    with the draft model's top probability at j -- softmax of its raw logits, before the request's
    temperature/top-k/top-p -- and read before sampling, so the rule can never depend on the token sampled at j
    (see DraftStop for why that keeps sampled speculation lossless). The raw distribution also gives greedy
    requests a signal, where the processed q is one-hot.
    """

    traits = ProposerTraits(stops_while_drafting=True)

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_slots: int,
        max_len: int,
        num_layers: int | None = None,
    ) -> None:
        self.model = model
        self.num_layers = num_layers
        self.cache = model.make_cache(max_slots, max_len, num_layers=num_layers)
        self._slots: dict[int, int] = {}
        self._cached: dict[int, list[int]] = {}  # tokens whose KV the draft cache holds, per seq_id

    def release(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self.cache.free(slot)
        self._cached.pop(seq_id, None)

    def propose(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> Proposal:
        loop = DraftLoop(seqs, num_draft_tokens)
        active = [i for i, k in enumerate(num_draft_tokens) if k > 0]
        if not active:
            return loop.proposal()
        for i in active:
            if seqs[i].seq_id not in self._slots:
                self._slots[seqs[i].seq_id] = self.cache.allocate()
                self._cached[seqs[i].seq_id] = []
        active.sort(key=lambda i: self._slots[seqs[i].seq_id])

        # First forward: catch up on everything not cached (at least the newest token), ragged.
        feed, starts = loop.feed, loop.starts
        for i in active:
            tokens = seqs[i].token_ids
            cached = self._cached[seqs[i].seq_id]
            start = min(common_prefix(cached, tokens), len(tokens) - 1)
            starts[i] = start
            feed[i] = list(tokens[start:])
            self._cached[seqs[i].seq_id] = list(tokens[:start])
        while active:
            batch = ForwardBatch.build(
                [feed[i] for i in active],
                [self._slots[seqs[i].seq_id] for i in active],
                [starts[i] for i in active],
                [[len(feed[i]) - 1] for i in active],
            )
            self.cache.reserve(max(starts[i] + len(feed[i]) for i in active))
            logits = self.model(batch, self.cache, num_layers=self.num_layers)  # [num_active, vocab_size]
            for i in active:
                sid = seqs[i].seq_id
                self._cached[sid].extend(feed[i])
                self.cache.set_len(self._slots[sid], len(self._cached[sid]))
            active, logits = loop.drop_stopped(active, logits)  # logits: [num_kept, vocab_size]
            if not active:
                break
            # The request's penalties and logit_bias shape q as they shape p (counting the drafts so far), so the
            # draft proposes from the distribution the target will verify against.
            logits = adjust_logits(
                logits, [seqs[i].params for i in active], [1] * len(active),
                [TokenHistory(seqs[i].token_ids[: seqs[i].num_prompt_tokens],
                              [*seqs[i].token_ids[seqs[i].num_prompt_tokens :], *loop.drafts[i]]) for i in active],
                [[] for _ in active],
            )
            sampling = build_sampling_batch([seqs[i].params for i in active], [1] * len(active), logits.device)
            active = loop.append(active, logits_to_probs(logits, sampling))  # q: [num_active, vocab_size]
        return loop.proposal()


def build_layerskip(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> DraftModelProposer:
    """`layerskip`: the target's first `draft_layers` layers (default: a quarter) + its final norm and LM head."""
    num_layers = config.speculation.draft_layers
    total = target.config.num_layers
    if num_layers is None:
        num_layers = max(1, total // 4)
    if num_layers >= total:
        raise InvalidParameterError("speculation.draft_layers", f"must be < the target's {total} layers")
    return DraftModelProposer(target, config.max_num_seqs, config.max_model_len, num_layers=num_layers)


def build_draft(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> DraftModelProposer:
    """`draft`: a separate checkpoint (`draft_model`) that must share the target's vocabulary."""
    # int4 quantizes from float32 weights, as for the target.
    checkpoint = load_checkpoint(config.speculation.draft_model or "", config.load_dtype)
    check_same_vocabulary(target, tokenizer, checkpoint.config.vocab_size, checkpoint.tokenizer)
    draft = build_model(
        checkpoint.config, checkpoint.state_dict, config.torch_dtype, max_positions=config.max_model_len,
        int4=config.int4_weights,
    )
    return DraftModelProposer(draft, config.max_num_seqs, config.max_model_len)


def check_same_vocabulary(
    target: LlamaForCausalLM, tokenizer: Tokenizer | None, draft_vocab_size: int, draft_tokenizer: Tokenizer | None
) -> None:
    """A draft model must share the target's vocabulary, or its token ids mean something else."""
    if draft_vocab_size != target.config.vocab_size:
        raise ModelLoadError(
            f"speculation.draft_model: vocabulary size {draft_vocab_size} differs from the target's "
            f"{target.config.vocab_size}; a draft model must share the target's tokenizer"
        )
    if tokenizer is not None and draft_tokenizer is not None:
        probe = "Hello, world! def f(x): return x ** 2  # ünïcødé 1234"
        if tokenizer.encode(probe, add_special_tokens=False) != draft_tokenizer.encode(probe, add_special_tokens=False):
            raise ModelLoadError("speculation.draft_model: its tokenizer encodes text differently from the target's")
