"""Ragged-batch attention over the slot KV cache.

One forward serves prefill chunks, single-token decode and multi-token verification: sequence i contributes
n_i >= 1 new tokens at positions p_i .. p_i + n_i - 1 (p_i = its cached length) and attends causally to
its own cached tokens plus the new ones. The metadata below is built once per forward and shared by all
layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from specd.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The new tokens of one forward, flattened sequence-major.

    token_ids / positions: [num_tokens] int64. slot_ids, start_positions, num_new_tokens: one entry per
    sequence. logits_indices: [num_logit_rows] indices into the flat tokens whose logits are wanted.
    prompt_rows: [num_prompt_rows] int64, the flat rows that are prompt tokens (a prefill chunk), ascending; an
    int4 model may run them through other weights than the rest (LlamaForCausalLM.set_dense_prompt_rows).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: Sequence[int]
    start_positions: Sequence[int]
    num_new_tokens: Sequence[int]
    logits_indices: torch.Tensor
    prompt_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @staticmethod
    def build(
        new_token_ids: Sequence[Sequence[int]],
        slot_ids: Sequence[int],
        start_positions: Sequence[int],
        logits_rows: Sequence[Sequence[int]],
        is_prompt: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """logits_rows[i] are offsets within sequence i's new tokens whose logits are wanted; is_prompt[i]: whether
        sequence i's new tokens are a prompt chunk (None: none are)."""
        flat: list[int] = []
        positions: list[int] = []
        logit_idx: list[int] = []
        prompt_idx: list[int] = []
        prompts = [False] * len(new_token_ids) if is_prompt is None else is_prompt
        for toks, start, rows, prompt in zip(new_token_ids, start_positions, logits_rows, prompts, strict=True):
            base = len(flat)
            flat.extend(toks)
            positions.extend(range(start, start + len(toks)))
            logit_idx.extend(base + r for r in rows)
            if prompt:
                prompt_idx.extend(range(base, base + len(toks)))
        return ForwardBatch(
            token_ids=torch.tensor(flat, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_ids=list(slot_ids),
            start_positions=list(start_positions),
            num_new_tokens=[len(t) for t in new_token_ids],
            logits_indices=torch.tensor(logit_idx, dtype=torch.long),
            prompt_rows=torch.tensor(prompt_idx, dtype=torch.long),
        )


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Indices and mask shared by every layer of one forward."""

    write_slots: torch.Tensor  # [num_tokens] slot of each new token
    write_positions: torch.Tensor  # [num_tokens] cache position of each new token
    slot_range: tuple[int, int] | None  # (lo, hi) when the batch's slots are lo..hi-1 in order: read a view
    slot_index: torch.Tensor  # [num_seqs] slots, for the gather path
    seq_starts: torch.Tensor  # [num_seqs] each sequence's first new position (its cached length)
    cu_num_new: torch.Tensor  # [num_seqs + 1] sequence i's new tokens are flat rows cu[i] .. cu[i + 1] - 1
    kv_len: int  # keys read per sequence (max total length in the batch)
    max_new: int  # padded query length
    pad_index: torch.Tensor | None  # [num_tokens] flat index into [num_seqs * max_new]; None if no padding
    mask: torch.Tensor | None  # [num_seqs, 1, max_new, kv_len] bool, True = attend; None = attend all
    additive_mask: torch.Tensor | None  # [num_seqs, 1, 1, max_new, kv_len] float32, 0 or -inf (grouped path)
    # A batch mixing decode/verification rows with long prefill chunks attends in two parts, so that decode rows
    # are not padded to the chunk's length: (flat token rows [n_part], that part's metadata) each. Empty otherwise.
    parts: tuple[tuple[torch.Tensor, AttentionMetadata], ...] = ()
    masked: bool = True  # False: built for the fused kernel (no padding or masks): torch's paths cannot read it

    @staticmethod
    def build(batch: ForwardBatch, masks: bool = True) -> AttentionMetadata:
        """masks=False: for a forward whose attention runs the fused kernel (`attend(..., fused=...)`), which reads
        only seq_starts/cu_num_new and attends every row, prefill chunk or not, over exactly its own keys: no
        padding index, no masks, no parts. Only then is a prompt row's result independent of how the scheduler
        chunked the prompt, which greedy speculation needs to stay token-identical to plain decoding (the two
        chunk the same prompt differently when verification rows take part of the step's token budget)."""
        num_new = list(batch.num_new_tokens)
        if not masks:
            return AttentionMetadata._build(list(batch.slot_ids), list(batch.start_positions), num_new,
                                            batch.positions, masks=False)
        short = [i for i, n in enumerate(num_new) if n <= GROUPED_MAX_NEW]
        if not short or len(short) == len(num_new):
            return AttentionMetadata._build(list(batch.slot_ids), list(batch.start_positions), num_new,
                                            batch.positions, masks)
        # Padding every sequence to the longest chunk would cost num_seqs x chunk query rows in every layer.
        offsets = [0]
        for n in num_new:
            offsets.append(offsets[-1] + n)
        parts: list[tuple[torch.Tensor, AttentionMetadata]] = []
        for members in (short, [i for i, n in enumerate(num_new) if n > GROUPED_MAX_NEW]):
            rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in members])
            part = AttentionMetadata._build([batch.slot_ids[i] for i in members],
                                            [batch.start_positions[i] for i in members],
                                            [num_new[i] for i in members], batch.positions[rows], masks)
            parts.append((rows, part))
        # The whole batch's metadata serves only write_kv (one indexed copy); attention reads the parts, so the
        # padded whole-batch mask is never built.
        slots = torch.tensor(list(batch.slot_ids), dtype=torch.long)
        return AttentionMetadata(
            write_slots=torch.repeat_interleave(slots, torch.tensor(num_new, dtype=torch.long)),
            write_positions=batch.positions,
            slot_range=None,
            slot_index=slots,
            seq_starts=torch.tensor(list(batch.start_positions), dtype=torch.long),
            cu_num_new=torch.tensor(offsets, dtype=torch.long),
            kv_len=max(s + n for s, n in zip(batch.start_positions, num_new)),
            max_new=max(num_new),
            pad_index=None,
            mask=None,
            additive_mask=None,
            parts=tuple(parts),
        )

    @staticmethod
    def _build(slots: list[int], starts: list[int], num_new: list[int], positions: torch.Tensor,
               masks: bool = True) -> AttentionMetadata:
        num_seqs = len(slots)
        max_new = max(num_new)
        cu_num_new = [0]
        for n in num_new:
            cu_num_new.append(cu_num_new[-1] + n)
        totals = [s + n for s, n in zip(starts, num_new)]
        kv_len = max(totals)
        write_slots = torch.repeat_interleave(
            torch.tensor(slots, dtype=torch.long), torch.tensor(num_new, dtype=torch.long)
        )
        lo = slots[0]
        contiguous = slots == list(range(lo, lo + num_seqs))
        pad_index: torch.Tensor | None = None
        if masks and max_new > 1 and any(n != max_new for n in num_new):
            pad_index = torch.cat(
                [torch.arange(i * max_new, i * max_new + n) for i, n in enumerate(num_new)]
            )
        mask: torch.Tensor | None = None
        if masks and (max_new > 1 or any(t != kv_len for t in totals)):
            key_pos = torch.arange(kv_len)  # [kv_len]
            query_pos = torch.tensor(starts).unsqueeze(1) + torch.arange(max_new).unsqueeze(0)  # [num_seqs, max_new]
            # Padded query rows (t >= n_i) get query_pos past the end; they attend to a valid prefix and are
            # dropped afterwards, so no row is fully masked (which would give NaN).
            limit = torch.minimum(query_pos, torch.tensor(totals).unsqueeze(1) - 1)  # [num_seqs, max_new]
            mask = (key_pos.view(1, 1, kv_len) <= limit.unsqueeze(2)).unsqueeze(1)
        additive_mask = None
        if mask is not None and max_new <= GROUPED_MAX_NEW:
            additive_mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
            additive_mask = additive_mask.unsqueeze(1)
        return AttentionMetadata(
            write_slots=write_slots,
            write_positions=positions,
            slot_range=(lo, lo + num_seqs) if contiguous else None,
            slot_index=torch.tensor(slots, dtype=torch.long),
            seq_starts=torch.tensor(starts, dtype=torch.long),
            cu_num_new=torch.tensor(cu_num_new, dtype=torch.long),
            kv_len=kv_len,
            max_new=max_new,
            pad_index=pad_index,
            mask=mask,
            additive_mask=additive_mask,
            masked=masks,
        )


# Up to this many new tokens per sequence (decode, verification) attention runs as two batched matmuls with the
# query heads grouped per KV head; torch's CPU flash kernel has a large fixed cost for a handful of queries.
# Longer prefill chunks use scaled_dot_product_attention.
GROUPED_MAX_NEW = 32


def _grouped_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, max_new, head_dim], already multiplied by the softmax scale
    keys: torch.Tensor,  # [num_seqs, num_kv_heads, kv_len, head_dim], slot-major (slots and heads merge as a view)
    values: torch.Tensor,  # [num_seqs, num_kv_heads, kv_len, head_dim]
    additive_mask: torch.Tensor | None,  # [num_seqs, 1, 1, max_new, kv_len] float32
) -> torch.Tensor:  # [num_seqs, max_new, num_heads, head_dim]
    num_seqs, num_heads, max_new, head_dim = q.shape
    num_kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    batch, rows = num_seqs * num_kv_heads, group * max_new
    # Head h reads KV head h // group (the repeat_kv convention), so heads are grouped contiguously. Plain bmm
    # on 3-d views: matmul on 4-d operands costs several more dispatches per call, paid 2 x num_layers per step.
    # Both products run in float64, whatever the model's dtype. A query row must get the same bits alone (plain
    # decoding: kv_len = its own length) as among a verification's rows (kv_len = the last row's length, the rest
    # masked to 0): greedy speculation is lossless only then. Torch's bfloat16 and float32 bmm kernels block the
    # kv_len reduction by its size, so the masked zeros move the rounding (float32: most rows; bfloat16: ~1 row
    # in 200, enough to flip a token of the default model every few dozen). In float64 the products of bfloat16
    # or float32 inputs are exact and the sums carry ~29 bits more than the result keeps, so the one rounding to
    # the output dtype sees the same value either way. On AVX2 CPUs without bfloat16 units it is also 1.6-6x
    # faster than the bfloat16 bmm (docs/benchmarks.md).
    qg = q.reshape(batch, rows, head_dim).double()
    scores = torch.bmm(qg, keys.reshape(batch, kv_len, head_dim).double().transpose(1, 2))  # [batch, rows, kv_len]
    scores = scores.to(torch.promote_types(q.dtype, torch.float32))
    if additive_mask is not None:
        masked = torch.add(additive_mask, scores.view(num_seqs, num_kv_heads, group, max_new, kv_len))
        probs = torch.softmax(masked, dim=-1)
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs.view(batch, rows, kv_len).double(), values.reshape(batch, kv_len, head_dim).double())
    return out.to(values.dtype).view(num_seqs, num_heads, max_new, head_dim).transpose(1, 2)


def write_kv(
    key_value: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim]: each new token's keys, then its values
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
) -> None:
    """Store the new tokens' keys and values at their slots and positions: one indexed copy per layer."""
    cache.kv[layer][:, meta.write_slots, :, meta.write_positions] = key_value


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float | None = None,
    fused: ModuleType | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """Attention of the new tokens over each sequence's cached prefix, their own keys included (so `write_kv`
    comes first). scale: the softmax scale, head_dim ** -0.5 when None; 1.0 for queries already scaled.
    fused: specd.kernels.fused's ops (bfloat16): every row, decode, verification or prefill chunk, then attends in
    one call over exactly its own keys (no padding, no mask), so its bits do not depend on the rest of the batch
    or on how its prompt was chunked."""
    if fused is not None:
        softmax_scale = query.shape[-1] ** -0.5 if scale is None else scale
        return fused.attention(query, cache.kv[layer], meta.slot_index, meta.seq_starts, meta.cu_num_new,
                               softmax_scale)
    if not meta.masked:
        raise ValueError("attend: metadata built with masks=False is for the fused kernel; pass fused=")
    if meta.parts:
        num_tokens, num_heads, head_dim = query.shape
        out = query.new_empty(num_tokens, num_heads * head_dim)
        for rows, part in meta.parts:
            out[rows] = attend(query[rows], cache, layer, part, scale, fused)
        return out
    k_cache = cache.keys[layer]  # [num_slots, num_kv_heads, capacity, head_dim]
    v_cache = cache.values[layer]
    if meta.slot_range is not None:
        lo, hi = meta.slot_range
        keys = k_cache[lo:hi, :, : meta.kv_len]  # [num_seqs, num_kv_heads, kv_len, head_dim] (view)
        values = v_cache[lo:hi, :, : meta.kv_len]
    else:
        keys = k_cache.index_select(0, meta.slot_index)[:, :, : meta.kv_len]
        values = v_cache.index_select(0, meta.slot_index)[:, :, : meta.kv_len]
    _, num_heads, head_dim = query.shape
    if scale is not None and scale != 1.0:
        query = query * scale
    elif scale is None:
        query = query * head_dim**-0.5
    num_seqs = meta.slot_index.shape[0]
    if meta.pad_index is None:
        q = query.view(num_seqs, meta.max_new, num_heads, head_dim).transpose(1, 2)
    else:
        padded = query.new_zeros(num_seqs * meta.max_new, num_heads, head_dim)
        padded[meta.pad_index] = query
        q = padded.view(num_seqs, meta.max_new, num_heads, head_dim).transpose(1, 2)
    # q: [num_seqs, num_heads, max_new, head_dim]
    if meta.max_new <= GROUPED_MAX_NEW:
        out = _grouped_attention(q, keys, values, meta.additive_mask)  # [num_seqs, max_new, num_heads, head_dim]
        out = out.reshape(num_seqs * meta.max_new, num_heads * head_dim)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.mask, enable_gqa=True, scale=1.0)
        out = out.transpose(1, 2).reshape(num_seqs * meta.max_new, num_heads * head_dim)
    if meta.pad_index is not None:
        out = out[meta.pad_index]
    return out


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """Write the new keys/values into the cache, then attend over each sequence's cached prefix (queries not
    yet scaled). The decoder layer calls `write_kv` and `attend` itself, on its projection's buffer."""
    write_kv(torch.stack([key, value], dim=1), cache, layer, meta)
    return attend(query, cache, layer, meta)
