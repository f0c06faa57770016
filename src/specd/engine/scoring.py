"""Prompt logprobs (completions `echo` with `logprobs`): the log-probability of each prompt token given the ones
before it, from one forward over the prompt in a private one-slot KV cache.

This is one extra prefill per request (the engine's own prefill keeps only the last row's logits, and making it keep
every row would widen every step's bookkeeping for a rarely used feature). The forward is pure apart from the cache it
writes, which is its own, so it may run on a worker thread beside the engine thread (they share CPU time only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.engine.outputs import TokenLogprob
from specd.model.attention import ForwardBatch
from specd.model.llama import LlamaForCausalLM

_ROWS_PER_CHUNK = 256  # logits rows at once: 256 x a 49k vocabulary is 50 MB of float32


def _final_hidden(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:  # [len(ids), hidden_size]
    cache = model.make_cache(1, len(ids))
    slot = cache.allocate()
    cache.reserve(len(ids))
    batch = ForwardBatch.build([ids], [slot], [0], [[len(ids) - 1]])
    hidden = model.forward_with_hidden(batch, cache, hidden_layers=[-1]).hidden_states
    assert hidden is not None
    return hidden


@torch.inference_mode()
def prompt_logits(model: LlamaForCausalLM, token_ids: Sequence[int]) -> torch.Tensor:  # [len - 1, vocab] float32+
    """Row i: the logits of the token after tokens 0..i (teacher-forced next-token distributions, bench/scale.py)."""
    ids = [int(t) for t in token_ids]
    if len(ids) < 2:
        return torch.empty(0, model.config.vocab_size)
    hidden = _final_hidden(model, ids)
    return torch.cat([model.compute_logits(hidden[first:min(first + _ROWS_PER_CHUNK, len(ids) - 1)])
                      for first in range(0, len(ids) - 1, _ROWS_PER_CHUNK)])


@torch.inference_mode()
def prompt_logprobs(model: LlamaForCausalLM, token_ids: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """Entry i is token i + 1 given tokens 0..i (the first token has no logprob), with the top_n alternatives."""
    ids = [int(t) for t in token_ids]
    if len(ids) < 2:
        return []
    hidden = _final_hidden(model, ids)  # [len(ids), hidden_size]
    out: list[TokenLogprob] = []
    for first in range(0, len(ids) - 1, _ROWS_PER_CHUNK):
        last = min(first + _ROWS_PER_CHUNK, len(ids) - 1)
        logprobs = torch.log_softmax(model.compute_logits(hidden[first:last]).float(), dim=-1)  # [rows, vocab]
        targets = torch.tensor(ids[first + 1 : last + 1]).unsqueeze(1)  # [rows, 1]
        chosen = logprobs.gather(1, targets).squeeze(1).tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
        if top_n > 0:
            values, indices = logprobs.topk(top_n, dim=-1)  # [rows, top_n]
            tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        out += [TokenLogprob(t, c, top) for t, c, top in zip(ids[first + 1 : last + 1], chosen, tops)]
    return out
