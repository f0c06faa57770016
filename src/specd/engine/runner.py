"""The model runner: one step's work -> one target forward over the KV cache.

It owns the target model and its KV cache and does what touches them: builds the ragged batch (prefill chunks,
and [last, d_1..d_k] for decoding sequences), reserves cache room, runs the forward (asking for hidden states only
when the proposer needs them), and later commits or rolls back each sequence's cached length. It also turns
logits rows into logprobs. It decides nothing: what to run comes from the scheduler and the proposer, what to
keep from verification and the stop rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from specd.engine.outputs import TokenLogprob
from specd.engine.scheduler import ScheduledSeq
from specd.model.attention import ForwardBatch
from specd.model.kv_cache import KVCache
from specd.model.llama import LlamaForCausalLM


class RunOutput(NamedTuple):
    """One forward's results, laid out by the step's scheduled entries (in scheduler order).

    logits: [num_logit_rows, vocab_size], the rows of the sampled entries back to back: a decoding entry's
        k_i + 1 rows, then one row for a prefill chunk that completes its prompt.
    hidden_states: [num_tokens, len(hidden_layers) * hidden_size] for every new token, or None when not asked.
    sampled: indices (into the scheduled entries) of the entries that have logits rows, in row order.
    rows_per_sampled: logits rows of each sampled entry.
    token_offsets: first flat token row of each scheduled entry (its rows in hidden_states).
    start_positions: the cached length (position of the first new token) of each scheduled entry.
    num_new_tokens: tokens the forward processed, all entries together.
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor | None
    sampled: list[int]
    rows_per_sampled: list[int]
    token_offsets: list[int]
    start_positions: list[int]
    num_new_tokens: int


class ModelRunner:
    """Runs the target for the engine. Not thread-safe: owned by the engine thread.

    hidden_layers: the residual streams to return with every forward (see LlamaForCausalLM.forward_with_hidden),
    or None to compute none (the default forward, which pays nothing for them).
    """

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, hidden_layers: tuple[int, ...] | None) -> None:
        self.model = model
        self.cache = cache
        self.hidden_layers = hidden_layers

    def run(self, scheduled: Sequence[ScheduledSeq], drafts: Mapping[int, list[int]]) -> RunOutput:
        """One forward over the step: prompt chunks, and the last token plus drafts[seq_id] of decoding entries.

        Writes the new tokens' KV at their positions (reserving room first); committed lengths are unchanged
        until `commit`. Assumes every scheduled sequence holds a slot.
        """
        new_tokens: list[list[int]] = []
        logit_rows: list[list[int]] = []
        sampled: list[int] = []
        for index, work in enumerate(scheduled):
            seq = work.seq
            if work.is_prefill:
                start = seq.num_computed
                new_tokens.append(seq.prompt_token_ids[start : start + work.num_prefill])
                completes = start + work.num_prefill == len(seq.prompt_token_ids)
                logit_rows.append([work.num_prefill - 1] if completes else [])
            else:
                draft = drafts.get(seq.seq_id, [])
                new_tokens.append([seq.last_token, *draft])
                logit_rows.append(list(range(len(draft) + 1)))
            if logit_rows[-1]:
                sampled.append(index)
        starts = [work.seq.num_computed for work in scheduled]
        batch = ForwardBatch.build(new_tokens, [work.seq.slot or 0 for work in scheduled], starts, logit_rows,
                                   [work.is_prefill for work in scheduled])
        self.cache.reserve(max(start + len(tokens) for start, tokens in zip(starts, new_tokens)))
        if self.hidden_layers is None:
            logits, hidden = self.model(batch, self.cache), None  # [num_logit_rows, vocab_size]
        else:
            logits, hidden = self.model.forward_with_hidden(batch, self.cache, hidden_layers=self.hidden_layers)
        offsets: list[int] = []
        total = 0
        for tokens in new_tokens:
            offsets.append(total)
            total += len(tokens)
        return RunOutput(
            logits=logits,
            hidden_states=hidden,
            sampled=sampled,
            rows_per_sampled=[len(logit_rows[index]) for index in sampled],
            token_offsets=offsets,
            start_positions=starts,
            num_new_tokens=total,
        )

    def commit(self, slot: int, length: int) -> None:
        """Keep the first `length` cached tokens of `slot` (commit, or roll back rejected drafts): O(1)."""
        self.cache.set_len(slot, length)

    @staticmethod
    def logprobs(
        logits: torch.Tensor,  # [num_logit_rows, vocab_size]
        first_row: int,
        tokens: Sequence[int],
        top_n: int | None,
    ) -> list[TokenLogprob] | None:
        """Log-softmax of the raw logits rows first_row.. for `tokens` (one per row), with the top-n alternatives
        when top_n > 0; None when top_n is None (the request asked for no logprobs)."""
        if top_n is None:
            return None
        lp = torch.log_softmax(logits[first_row : first_row + len(tokens)].float(), dim=-1)  # [num_tokens, vocab]
        chosen = lp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
        if top_n > 0:
            values, indices = lp.topk(top_n, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]
