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

import torch

from specd.model.attention import ForwardBatch
from specd.model.llama import LlamaForCausalLM
from specd.sampling.processing import build_sampling_batch, logits_to_probs, sample_from_probs
from specd.speculation.proposer import Proposal, SequenceView


def _common_prefix(a: list[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    """Drafts with `model` (first `num_layers` layers if given).

    confidence_threshold (the `confidence` k policy; None = never stop early): a sequence's draft stops before
    position j when the draft model's top probability at j -- softmax of its raw logits, before the request's
    temperature/top-k/top-p -- is below the threshold. The rule reads only the draft distribution q_j, never the
    token sampled from it, which is what keeps sampled speculation lossless: whether position j is verified then
    depends only on the accepted prefix, and given that prefix the target's rule emits exactly p_j either way.
    (Dropping a token because of its own sampled probability would hand the verifier a q that the token was not
    drawn from, and bias the output.) The raw distribution also gives greedy requests a signal, where q is one-hot.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_slots: int,
        max_len: int,
        num_layers: int | None = None,
        confidence_threshold: float | None = None,
    ) -> None:
        self.model = model
        self.num_layers = num_layers
        self.confidence_threshold = confidence_threshold
        self.cache = model.make_cache(max_slots, max_len, num_layers=num_layers)
        self._slots: dict[int, int] = {}
        self._cached: dict[int, list[int]] = {}  # tokens whose KV the draft cache holds, per seq_id

    def release(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self.cache.free(slot)
        self._cached.pop(seq_id, None)

    def propose(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> Proposal:
        active = [i for i, k in enumerate(num_draft_tokens) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs_per_seq: list[list[torch.Tensor]] = [[] for _ in seqs]
        if not active:
            return Proposal(drafts, None)
        for i in active:
            if seqs[i].seq_id not in self._slots:
                self._slots[seqs[i].seq_id] = self.cache.allocate()
                self._cached[seqs[i].seq_id] = []
        active.sort(key=lambda i: self._slots[seqs[i].seq_id])

        # First forward: catch up on everything not cached (at least the newest token), ragged.
        feed: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for i in active:
            tokens = seqs[i].token_ids
            cached = self._cached[seqs[i].seq_id]
            start = min(_common_prefix(cached, tokens), len(tokens) - 1)
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
            if self.confidence_threshold is not None:
                # Decided before sampling, from the draft's own distribution alone (see the class docstring).
                confident = torch.softmax(logits.float(), dim=-1).amax(dim=-1) >= self.confidence_threshold
                keep_rows = torch.nonzero(confident).squeeze(1).tolist()
                active = [active[r] for r in keep_rows]
                logits = logits[keep_rows]  # [num_confident, vocab_size]
                if not active:
                    break
            sampling = build_sampling_batch([seqs[i].params for i in active], [1] * len(active), logits.device)
            q = logits_to_probs(logits, sampling)  # [num_active, vocab_size]
            tokens = sample_from_probs(q, [seqs[i].generator for i in active]).tolist()
            still: list[int] = []
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                probs_per_seq[i].append(q[row])
                if len(drafts[i]) < num_draft_tokens[i]:
                    still.append(i)
                    starts[i] += len(feed[i])
                    feed[i] = [tokens[row]]
            active = still
        rows = [p for per_seq in probs_per_seq for p in per_seq]
        draft_probs = torch.stack(rows) if rows else None  # [total_drafts, vocab_size]
        return Proposal(drafts, draft_probs)
