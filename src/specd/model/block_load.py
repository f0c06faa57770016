"""Which kernel weight each checkpoint tensor becomes in the quantized (`int4`) mode, and what that changes.

The rule: a tensor the file stores in a block type the native kernels run (GGUF Q4_0, Q4_1, Q4_K -> q4; Q8_0,
Q6_K -> q8; model/gguf_blocks.py) keeps its blocks and so its values. Anything else is converted from its
dequantized floats, and each conversion is reported once per load: float weights (F32/F16/BF16 files, Hugging
Face checkpoints) become 4-bit blocks in projections and 8-bit blocks in the LM head (the mode's contract); other
quantized types (Q5_*, Q2_K, Q3_K, IQ*) become 8-bit blocks, which hold their values closer than 4 bits would.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from specd.kernels.blockquant import Q4Weight, Q8Weight, fits, quantize_q4, quantize_q8
from specd.model.gguf_blocks import KernelWeight
from specd.model.weights import block_weight_of, file_type_of, shape_of

_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64", "float32", "float16", "bfloat16", "float64"})


class Conversions:
    """What the load changed, counted by (file type, what it became); `lines()` says each once."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def note(self, file_type: str, became: str) -> None:
        self.counts[(file_type, became)] += 1

    def lines(self) -> list[str]:
        def why(file_type: str) -> str:
            if file_type in _FLOAT_TYPES:
                return "the quantized mode's precision, not the file's"
            return f"specd has no {file_type} kernel"

        return [f"{count} tensor(s) stored as {file_type} run as {became}: their values change ({why(file_type)}); "
                "--dtype bfloat16 or float32 computes the file's values"
                for (file_type, became), count in sorted(self.counts.items())]


def _layout(weight: KernelWeight) -> tuple[type, torch.dtype]:
    return type(weight), weight.scales.dtype


def _concat(weights: Sequence[KernelWeight]) -> KernelWeight:  # the same layout each: their rows one after another
    first = weights[0]
    if isinstance(first, Q4Weight):
        return Q4Weight(*(torch.cat([getattr(w, f) for w in weights]) for f in Q4Weight._fields))
    return Q8Weight(*(torch.cat([getattr(w, f) for w in weights]) for f in Q8Weight._fields))


def merge_rows(weights: Sequence[KernelWeight]) -> list[KernelWeight]:
    """Consecutive parts of one layout joined into one weight (q, k, v of one type -> one qkv GEMM)."""
    merged: list[list[KernelWeight]] = []
    for weight in weights:
        if merged and _layout(merged[-1][0]) == _layout(weight):
            merged[-1].append(weight)
        else:
            merged.append([weight])
    return [run[0] if len(run) == 1 else _concat(run) for run in merged]


def kernel_weight(weights: Mapping[str, torch.Tensor], name: str, conversions: Conversions,
                  head: bool = False) -> KernelWeight | None:
    """`name` as a kernel weight by the rule above; None when its shape cannot be blocked (inputs not a multiple
    of 32: the caller keeps it dense). head: the LM head (float weights -> 8-bit)."""
    if not fits(shape_of(weights, name)):
        return None
    blocks = block_weight_of(weights, name)
    if blocks is not None:
        return blocks
    file_type = file_type_of(weights, name)
    dense = weights[name].float()
    if file_type in _FLOAT_TYPES and not head:
        conversions.note(file_type, "4-bit blocks (q4, float16 scales per 32)")
        return quantize_q4(dense)
    conversions.note(file_type, "8-bit blocks (q8, float16 scales per 32)")
    return quantize_q8(dense)
