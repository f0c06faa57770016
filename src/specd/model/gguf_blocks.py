"""GGUF quantized blocks -> the native kernels' weights, with the values the file stores, exactly.

| GGUF type | block (bytes)                                   | value                      | kernel weight          |
|-----------|-------------------------------------------------|----------------------------|------------------------|
| Q4_0      | 32 inputs: d f16, 16 bytes of nibbles (18)      | d * (q - 8)                | q4, float16 scale/min  |
| Q4_1      | 32 inputs: d, m f16, 16 bytes of nibbles (20)   | d * q + m                  | q4, float16 scale/min  |
| Q8_0      | 32 inputs: d f16, 32 int8 (34)                  | d * q                      | q8, float16 scale      |
| Q4_K      | 256 inputs: d, dmin f16, 12 bytes of 6-bit      | d * sc_j * q - dmin * m_j  | q4, the file's 16      |
|           | (sc, m) for 8 sub-blocks of 32, 128 bytes (144) |                            | bytes of d, dmin, sc, m|
| Q6_K      | 256 inputs: 128 bytes low nibbles, 64 bytes of  | d * sc_j * (q - 32)        | q8, six-bit codes, its |
|           | 2-bit highs, 16 int8 sc, d f16 (210)            |                            | own sc as bytes, d f32 |

Nibble order: Q4_0/Q4_1 byte i of a block holds inputs i (low) and i + 16 (high), the q4 kernel's own order.
Q4_K's 64-input chunks hold sub-block 2j in the low nibbles and 2j + 1 in the high ones (byte l: input l of
each), repacked here. Q4_K's d * sc and dmin * m are exact in float32 (an 11-bit significand times a 6-bit
integer) but not in float16: the kernel forms them from the file's own 16 bytes of d, dmin, sc and m per 256 inputs,
and Q6_K's d * sc likewise from its sc and d (20 bytes per 256 inputs); -8 * d for Q4_0 is exact in float16.
Q6_K's codes keep their six bits (24 bytes per 32 inputs, in the kernel's group order): 6.625 bits a weight as
the kernel reads it, against the file's 6.5625.

Every other type (float, Q5_*, Q2_K, Q3_K, IQ*) has no kernel here: `block_weight` returns None and the loader
converts its dequantized values, saying so.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch

import specd.kernels as kernels
from specd.kernels.blockquant import BLOCK, Q4Weight, Q8Weight

KernelWeight = Q4Weight | Q8Weight
T = gguf.GGMLQuantizationType


def _f16(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float16
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:  # [out, blocks, 32] uint8 0..15 -> [out, blocks * 16]
    """The q4 kernel's block order: byte i holds input i (low nibble) and input i + 16 (high)."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


def _q4_0(raw: torch.Tensor, out: int, blocks: int) -> KernelWeight:  # raw [out, blocks * 18]
    b = raw.view(out, blocks, 18)
    d = _f16(b[..., 0:2])  # [out, blocks]
    return Q4Weight.from_block_order(b[..., 2:].reshape(out, blocks * 16), d, d * -8)


def _q4_1(raw: torch.Tensor, out: int, blocks: int) -> KernelWeight:  # raw [out, blocks * 20]
    b = raw.view(out, blocks, 20)
    return Q4Weight.from_block_order(b[..., 4:].reshape(out, blocks * 16), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _q8_0(raw: torch.Tensor, out: int, blocks: int) -> KernelWeight:  # raw [out, blocks * 34]
    b = raw.view(out, blocks, 34)
    codes = b[..., 2:].contiguous().view(torch.int8).reshape(out, blocks * BLOCK)
    return Q8Weight.from_block_order(codes, _f16(b[..., 0:2]))


def _q4_k(raw: torch.Tensor, out: int, blocks: int) -> KernelWeight:  # raw [out, supers * 144]
    supers = blocks // 8
    b = raw.view(out, supers, 144)
    qs = b[..., 16:].reshape(out, supers, 4, 32)  # 4 chunks of 64 inputs
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(out, blocks, BLOCK)  # sub-block 2j, then 2j + 1
    scales = b[..., :16].reshape(out, supers * 16)  # d, dmin and the packed sc, m: the kernel reads them as they are
    return Q4Weight.from_block_order(_pack_nibbles(q), scales, torch.empty(out, 0, dtype=torch.uint8))


def _q6_k(raw: torch.Tensor, out: int, blocks: int) -> KernelWeight:  # raw [out, supers * 210]
    supers = blocks // 8
    b = raw.view(out, supers, 210)
    ql = b[..., 0:128].reshape(out, supers, 2, 2, 32)  # [half n, l // 32 of 64, l]
    qh = b[..., 128:192].reshape(out, supers, 2, 32)  # [half n, l]
    sc = b[..., 192:208].contiguous().view(torch.int8)  # [out, supers, 16]: one per 16 inputs
    d = _f16(b[..., 208:210]).float()  # [out, supers]
    # Within each 128-input half n, input 32 * k + l (k = 0..3) takes low nibbles of ql[l] (k = 0), ql[l + 32]
    # (k = 1), high nibbles of the same (k = 2, 3), and bits 2k, 2k + 1 of qh[l] as its top two bits.
    low = torch.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], dim=3)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high = (qh.unsqueeze(3) >> shifts) & 3  # [out, supers, 2, 4, 32]
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(out, blocks * BLOCK)
    return Q8Weight.six_bit_from_block_order(q, d, sc)


_DECODERS: dict[T, Callable[[torch.Tensor, int, int], KernelWeight]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q6_K: _q6_k,
}
KERNEL_TYPES = frozenset(_DECODERS)


def kernel_kind(ggml_type: T) -> str | None:
    """What a tensor of this type runs as: "q4", "q8", or None (no kernel: converted at load)."""
    if ggml_type not in _DECODERS:
        return None
    return "q8" if ggml_type in (T.Q8_0, T.Q6_K) else "q4"


_CHUNK_VALUES = 1 << 22  # weights decoded at once: the decoders' temporaries stay a few tens of MB


def block_weight(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...],
                 row_order: torch.Tensor | None = None) -> KernelWeight | None:
    """The kernel weight of a 2-D tensor's raw blocks (raw: [num_bytes] uint8, shape: [out, in] in torch order),
    or None where this type has no kernel. row_order: [out] int64, output row r from the file's row row_order[r]
    (None: as stored). With the native kernels built, their repack_gguf (gguf_repack.cpp) writes the fields in one
    pass on every thread; otherwise the torch decoders above run a few thousand rows at a time into the result's
    own tensors, so a large table (a 49k-token LM head) costs its result and little more. Both give the same
    bytes (tests/model/test_gguf_blocks.py)."""
    decode = _DECODERS.get(ggml_type)
    if decode is None or len(shape) != 2:
        return None
    out_features, in_features = shape
    rows = raw.view(out_features, -1)
    native = kernels.native()
    if native is not None:
        order = torch.empty(0, dtype=torch.long) if row_order is None else row_order.contiguous()
        fields = native.repack_gguf(rows, int(ggml_type), in_features, order)
        return (Q8Weight if kernel_kind(ggml_type) == "q8" else Q4Weight)(*fields)
    weight = decode_rows(rows, ggml_type, in_features)
    return weight if row_order is None else weight.rows(row_order)


def decode_rows(rows: torch.Tensor, ggml_type: T, in_features: int) -> KernelWeight:
    """rows: [out, bytes per row] uint8 of a kernel type -> its kernel weight, with torch ops (the reference)."""
    decode = _DECODERS[ggml_type]
    out_features = rows.shape[0]
    step = max(1, _CHUNK_VALUES // in_features)
    first = decode(rows[:step], min(step, out_features), in_features // BLOCK)
    if step >= out_features:
        return first
    fields = [torch.empty((out_features, *part.shape[1:]), dtype=part.dtype) for part in first]
    for field, part in zip(fields, first):
        field[:step] = part
    for start in range(step, out_features, step):
        chunk = decode(rows[start:start + step], min(step, out_features - start), in_features // BLOCK)
        for field, part in zip(fields, chunk):
            field[start:start + step] = part
    return type(first)(*fields)
