"""Repetition, presence and frequency penalties and logit_bias, applied so speculation stays exact.

A verification forward scores rows [last, d_1..d_k] of a sequence at once. Row j is the distribution of the token
that follows the committed tokens plus the drafts d_1..d_j, so its penalties must count those drafts as if they had
been generated -- exactly what plain decoding would have counted had it produced them. Applying the same rule to
the target's rows and to a draft model's rows keeps greedy speculation token-identical to plain decoding and
sampled speculation distributed as plain sampling (the verifier compares the adjusted p with the adjusted q).

Semantics follow OpenAI and vLLM:
- logit_bias: added to the logit of each listed token.
- presence_penalty: subtracted once from each token that appears in the output so far.
- frequency_penalty: subtracted once per occurrence in the output so far.
- repetition_penalty (vLLM/CTRL, 1 = off): for each token in the prompt or the output so far, a positive logit is
  divided by it and a negative one multiplied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specd.sampling.params import SamplingParams


class TokenHistory(NamedTuple):
    """What penalties look at for one sequence: its prompt and its committed output (drafts come separately)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def needs_adjustment(params: SamplingParams) -> bool:
    return bool(
        params.logit_bias or params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
    )


def adjust_logits(
    logits: Tensor,  # [sum(rows_per_seq), vocab_size]
    params: Sequence[SamplingParams],
    rows_per_seq: Sequence[int],
    histories: Sequence[TokenHistory],
    row_tokens: Sequence[Sequence[int]],  # per sequence, the tokens its rows 1.. add: drafts d_1..d_{rows - 1}
) -> Tensor:  # [sum(rows_per_seq), vocab_size] float32, or `logits` itself when no sequence adjusts anything
    """Row r (0-based) of sequence i scores the token after its history plus row_tokens[i][:r].

    Returns a new float32 tensor when some sequence asks for an adjustment; the input is never changed. Sequences
    that ask for none keep their rows bit for bit (as float32).
    """
    if not (len(params) == len(rows_per_seq) == len(histories) == len(row_tokens)):
        raise ValueError("params, rows_per_seq, histories and row_tokens must have one entry per sequence")
    if sum(rows_per_seq) != logits.shape[0]:
        raise ValueError(f"logits has {logits.shape[0]} rows for rows_per_seq {list(rows_per_seq)}")
    if not any(needs_adjustment(p) for p in params):
        return logits
    out = logits.float().clone()
    vocab_size = out.shape[1]
    start = 0
    for seq_params, num_rows, history, extra in zip(params, rows_per_seq, histories, row_tokens, strict=True):
        rows = slice(start, start + num_rows)
        start += num_rows
        if num_rows == 0 or not needs_adjustment(seq_params):
            continue
        if len(extra) < num_rows - 1:
            raise ValueError(f"row_tokens: {num_rows} rows need {num_rows - 1} tokens, got {len(extra)}")
        out[rows] = _adjust_one(out[rows], seq_params, history, list(extra[: num_rows - 1]), vocab_size)
    return out


def _adjust_one(
    logits: Tensor,  # [num_rows, vocab_size] float32
    params: SamplingParams,
    history: TokenHistory,
    extra: list[int],  # [num_rows - 1] tokens added before rows 1..
    vocab_size: int,
) -> Tensor:  # [num_rows, vocab_size]
    num_rows = logits.shape[0]
    device = logits.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        logits = logits.index_add(1, ids, bias.expand(num_rows, -1))
    uses_output = bool(params.presence_penalty or params.frequency_penalty)
    if not uses_output and params.repetition_penalty == 1.0:
        return logits
    # Occurrences in the output before each row: committed output, then the drafts of the earlier rows.
    output = torch.tensor(list(history.output_token_ids), dtype=torch.long, device=device)
    base = torch.bincount(output, minlength=vocab_size).to(torch.float32)  # [vocab_size]
    added = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)  # [num_rows, vocab_size]
    if extra:
        steps = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        rows = torch.arange(1, num_rows, device=device)
        steps[rows, torch.tensor(extra, dtype=torch.long, device=device)] = 1.0
        added = steps.cumsum(dim=0)
    counts = base.unsqueeze(0) + added  # [num_rows, vocab_size]
    if uses_output:
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.repetition_penalty != 1.0:
        prompt = torch.tensor(list(history.prompt_token_ids), dtype=torch.long, device=device)
        seen = counts > 0
        seen[:, prompt] = True  # [num_rows, vocab_size]
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    return logits
