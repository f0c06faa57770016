"""Block-quantised weights for the native kernels (blocks of 32 inputs).

q4: w = scale * q + min with q in 0..15; q8: w = scale * q with q in -127..127. Scales come in five layouts
(quant_gemm.cpp): float16 per block (GGUF Q4_0, Q4_1, Q8_0 store exactly these), float32 per block, GGUF Q4_K's own
compact form (the file's 16 bytes per 256 inputs: d and dmin as float16, 8 six-bit scales and mins packed in 12;
`scales` uint8, `mins` empty),
and, for q8, float32 per 16 inputs in the kernel's lane order, or GGUF Q6_K's own form (per 256 inputs: 16 int8
sub-block scales in lane order, then d as float32; `scales` uint8). q8 codes are one int8 per input, or, with
Q6_K's scales, Q6_K's six bits (`codes` uint8, 24 bytes per 32 inputs: `pack_six_bit`).
model/gguf_blocks.py builds them from a file's blocks without a float round trip.
`Q4Weight.linear` / `Q8Weight.linear` run the native kernel, which also quantises each
activation row per block of 32 to int8; `reference_linear` is the same arithmetic in float64 for tests.

The codes are stored in the kernel's group order (quant_gemm.cpp): blocks are grouped by four (then a two, then a
one), and within a group the inputs are interleaved so that one 32-byte vector holds a few inputs of each of its
blocks, which lets the kernel reduce a group with vertical adds. `block_codes()` gives the codes back in block order.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch

BLOCK = 32
GROUP_BLOCKS = 4  # blocks per group of the kernel's input order
K_SUPER_BLOCKS, K_SUPER_BYTES = 8, 16  # Q4_K's own scales: 8 blocks of 32 share the file's 16 bytes
Q6_SUPER_BYTES = 20  # Q6_K's scales: 16 int8 sub-block scales and d (float32) per 256 inputs
SIX_BIT_VECTOR_BYTES = 24  # six-bit codes: 32 inputs in 24 bytes


def k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins. packed: [..., 12] uint8 -> 2 x [..., 8]."""
    low, high = packed[..., 0:4], packed[..., 4:8]  # sub-blocks 0..3: six bits each of byte j (sc) and j + 4 (m)
    tail = packed[..., 8:12]  # sub-blocks 4..7: four bits here, the top two from bits 6-7 of bytes j and j + 4
    scales = torch.cat([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=-1)
    return scales, mins


def unpack_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # -> scales, mins [out, blocks] f32
    """The per-block scale d * sc and min -(dmin * m) of KBlocks scales (the file's 16 bytes per 256 inputs: d, dmin
    float16, 12 bytes of six-bit sc, m), as float32 (the kernel's own products)."""
    out_features = packed.shape[0]
    supers = packed.view(out_features, -1, K_SUPER_BYTES)
    d = supers[..., 0:2].contiguous().view(torch.float16).float()  # [out, supers, 1]
    dmin = supers[..., 2:4].contiguous().view(torch.float16).float()
    sc, m = k_scales_and_mins(supers[..., 4:16])
    scales = (d * sc.float()).reshape(out_features, -1)
    mins = (-(dmin * m.float())).reshape(out_features, -1)
    return scales, mins


def pack_six_bit(grouped: torch.Tensor) -> torch.Tensor:  # [out, in] int8 -32..31, group order -> [out, in // 32 * 24]
    """Six-bit codes (SixBitCodes): per 32 codes of the group order, 16 bytes holding codes j (low nibble) and
    16 + j (high nibble) of q + 32, then 8 bytes holding the top two bits, code b + 8e in bits 2e, 2e + 1 of
    byte b."""
    out_features = grouped.shape[0]
    u = (grouped.to(torch.int16) + 32).to(torch.uint8).view(out_features, -1, BLOCK)  # [out, vectors, 32] 0..63
    nibbles = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)
    top = (u >> 4).view(out_features, -1, 4, 8)  # [out, vectors, e, b]: code b + 8e
    highs = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return torch.cat([nibbles, highs], dim=-1).reshape(out_features, -1)


def unpack_six_bit(packed: torch.Tensor) -> torch.Tensor:  # [out, in // 32 * 24] uint8 -> [out, in] int8, group order
    out_features = packed.shape[0]
    v = packed.view(out_features, -1, SIX_BIT_VECTOR_BYTES)
    low = torch.cat([v[..., :16] & 0x0F, v[..., :16] >> 4], dim=-1)  # [out, vectors, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    top = ((v[..., 16:].unsqueeze(2) >> shifts) & 3).reshape(out_features, -1, BLOCK)  # code 8e + b at [.., 8e + b]
    return ((low | (top << 4)).to(torch.int16) - 32).to(torch.int8).reshape(out_features, -1)


# Q6_K's 16 sub-block scales of a super-block (sub-block j = half j % 2 of block j // 2) in lane order: lane
# gi * 8 + h * 4 + i holds half h of block gi * 4 + i (F32Lanes' order for the super-block's two groups).
_Q6_LANES = torch.tensor([(gi * 4 + i) * 2 + h for gi in range(2) for h in range(2) for i in range(4)])


def pack_q6_scales(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """d: [out, supers] float32; sc: [out, supers, 16] int8 per sub-block of 16 -> [out, supers * 20] uint8."""
    out_features, supers = d.shape
    lanes = sc.to(torch.int8)[..., _Q6_LANES].contiguous().view(torch.uint8)
    d_bytes = d.float().contiguous().view(torch.uint8).view(out_features, supers, 4)
    return torch.cat([lanes, d_bytes], dim=-1).reshape(out_features, supers * Q6_SUPER_BYTES)


def unpack_q6_scales(packed: torch.Tensor) -> torch.Tensor:  # [out, supers * 20] uint8 -> [out, groups * 8] f32
    """The per-16 scales d * sc of Q6Lanes in F32Lanes' order, as float32 (the kernel's own products)."""
    out_features = packed.shape[0]
    supers = packed.view(out_features, -1, Q6_SUPER_BYTES)
    d = supers[..., 16:20].contiguous().view(torch.float32)  # [out, supers, 1]
    return (d * supers[..., :16].contiguous().view(torch.int8).float()).reshape(out_features, -1)


def _group_of(block: int, blocks: int) -> tuple[int, int]:
    """The first block and the size (4, 2 or 1) of the group `block` falls in: fours, then a two, then a one."""
    full = blocks // GROUP_BLOCKS * GROUP_BLOCKS
    if block < full:
        return block // GROUP_BLOCKS * GROUP_BLOCKS, GROUP_BLOCKS
    if blocks - full >= 2 and block < full + 2:
        return full, 2
    return block, 1


@functools.cache
def _group_positions(in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q8, q4) maps from block order to group order: position p in block order moves to position map[p].

    In a group of S blocks, input h*16 + 4u + e of block b is in vector t = u // (4 / S), lane
    i = (u % (4 / S)) * S + b, byte e: int8 codes at t*32 + h*16 + i*4 + e, q4 bytes (inputs p and p + 16 share one)
    at t*16 + i*4 + e, both from the group's start (quant_gemm.cpp's input_position and q4_byte_position)."""
    blocks = in_features // BLOCK
    q8 = torch.empty(in_features, dtype=torch.long)
    q4 = torch.empty(in_features // 2, dtype=torch.long)
    for block in range(blocks):
        first, size = _group_of(block, blocks)
        per_lane = GROUP_BLOCKS // size
        for p in range(16):
            u, e = p // 4, p % 4
            t, i = u // per_lane, (u % per_lane) * size + (block - first)
            for h in range(2):
                q8[block * BLOCK + h * 16 + p] = first * BLOCK + t * 32 + h * 16 + i * 4 + e
            q4[block * 16 + p] = first * 16 + t * 16 + i * 4 + e
    return q8, q4


@functools.cache
def _lane_maps(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_lanes, to_halves) for per-16 scales: lanes[:, j] = halves[:, to_lanes[j]] with halves [out, blocks * 2]
    (block b's half h at b * 2 + h) and lanes [out, groups * 8] (group g's lane (h, i) at g * 8 + h * 4 + i, the
    scale of half h of block first + i % S); halves[:, i] = lanes[:, to_halves[i]] back."""
    to_lanes: list[int] = []
    to_halves = [0] * (blocks * 2)
    block = 0
    while block < blocks:
        first, size = _group_of(block, blocks)
        group = len(to_lanes) // 8
        for h in range(2):
            for i in range(4):
                to_lanes.append((first + i % size) * 2 + h)
            for b in range(size):
                to_halves[(first + b) * 2 + h] = group * 8 + h * 4 + b
        block = first + size
    return torch.tensor(to_lanes), torch.tensor(to_halves)


def halves_to_lanes(halves: torch.Tensor) -> torch.Tensor:  # [out, blocks, 2] float32 -> [out, groups * 8]
    """Per-16 scales (half h of block b at [:, b, h]) in the q8 kernel's lane order (F32Lanes)."""
    out_features, blocks, _ = halves.shape
    return halves.reshape(out_features, blocks * 2)[:, _lane_maps(blocks)[0]].contiguous()


def lanes_to_halves(lanes: torch.Tensor, blocks: int) -> torch.Tensor:  # [out, groups * 8] -> [out, blocks, 2]
    return lanes[:, _lane_maps(blocks)[1]].view(lanes.shape[0], blocks, 2)


# Within a whole group of four blocks the group order is a transpose: q8 code (block b, half h, u, e) moves to
# (u, h, b, e), and q4 byte (b, u, e) to (u, b, e) (_group_positions with S = 4). Whole groups take these views (one
# copy); only a row's tail (a group of two, or of one) goes through the position map.
_GROUP_SHAPE = {True: (4, 2, 4, 4), False: (4, 4, 4)}  # q8, q4: the axes of one group after [rows, groups]
_GROUP_SWAP = {True: (0, 1, 4, 3, 2, 5), False: (0, 1, 3, 2, 4)}


def _reorder(codes: torch.Tensor, q8: bool, to_group: bool) -> torch.Tensor:  # [out, n] -> [out, n]
    out_features, width = codes.shape
    in_features = width if q8 else width * 2
    per_group = (BLOCK if q8 else BLOCK // 2) * GROUP_BLOCKS
    whole = width // per_group * per_group
    shape, swap = _GROUP_SHAPE[q8], _GROUP_SWAP[q8]
    result = torch.empty_like(codes)
    if whole:
        if to_group:
            grouped = codes[:, :whole].reshape(out_features, -1, *shape).permute(*swap)
        else:  # the grouped axes read back in block order
            grouped_shape = tuple(shape[axis - 2] for axis in swap[2:])
            inverse = tuple(swap.index(axis) for axis in range(len(swap)))
            grouped = codes[:, :whole].reshape(out_features, -1, *grouped_shape).permute(*inverse)
        result[:, :whole] = grouped.reshape(out_features, whole)
    if whole < width:
        tail = _group_positions(in_features)[0 if q8 else 1][whole:]
        if to_group:
            result[:, tail] = codes[:, whole:]
        else:
            result[:, whole:] = codes[:, tail]
    return result


def _to_group_order(codes: torch.Tensor, q8: bool) -> torch.Tensor:  # [out, n] block order -> group order
    return _reorder(codes, q8, to_group=True)


def _to_block_order(codes: torch.Tensor, q8: bool) -> torch.Tensor:  # [out, n] group order -> block order
    return _reorder(codes, q8, to_group=False)


class Q4Weight(NamedTuple):
    codes: torch.Tensor  # [out, in // 2] uint8 in group order; in block order byte i of a block holds inputs i
    # (low nibble) and i + 16 (high)
    scales: torch.Tensor  # [out, in // 32] float16, or float32 (both the same dtype)
    mins: torch.Tensor  # [out, in // 32] float16, or float32

    @classmethod
    def from_block_order(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4Weight:
        """codes: [out, in // 2] uint8 in block order (GGUF Q4_1's nibble order); scales, mins: [out, in // 32]."""
        grouped = _to_group_order(codes, q8=False)
        return cls(grouped, scales.contiguous(), mins.contiguous())

    def rows(self, index: torch.Tensor | slice) -> Q4Weight:  # index: [n] int64 or a slice -> those output rows
        return Q4Weight(self.codes[index], self.scales[index], self.mins[index])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    def block_scales(self) -> tuple[torch.Tensor, torch.Tensor]:  # scales, mins: [out, in // 32], float
        """Each block's scale and min, whatever the layout (the K-quant form unpacked)."""
        if self.scales.dtype == torch.uint8:
            return unpack_k_scales(self.scales)
        return self.scales, self.mins

    def block_codes(self) -> torch.Tensor:  # [out, in // 2] uint8 in block order (GGUF Q4_1's)
        return _to_block_order(self.codes, q8=False)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        out_features, half = self.codes.shape
        blocks = self.block_codes().view(out_features, -1, BLOCK // 2)  # [out, blocks, 16]
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).float()  # [out, blocks, 32]
        scales, mins = self.block_scales()
        w = q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
        return w.view(out_features, half * 2)

    def linear(self, kernels: ModuleType, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        # [rows, in] float32/bfloat16 -> [rows, out] in x's dtype (float32 when float_out)
        return kernels.q4_linear(x.contiguous(), self.codes, self.scales, self.mins, float_out)


class Q8Weight(NamedTuple):
    codes: torch.Tensor  # [out, in] int8 in group order, or [out, in // 32 * 24] uint8 six-bit codes (Q6_K's)
    scales: torch.Tensor  # [out, in // 32] float16, [out, groups * 8] float32 per 16 inputs in lane order, or
    # [out, in // 256 * 20] uint8 (Q6_K's own, with six-bit codes)

    @classmethod
    def from_block_order(cls, codes: torch.Tensor, scales: torch.Tensor) -> Q8Weight:
        """codes: [out, in] int8 in block order; scales: [out, in // 32] float16, or per-16 float32 scales as
        [out, in // 32, 2] (half h of block b at [:, b, h]), stored in lane order."""
        grouped = _to_group_order(codes, q8=True)
        return cls(grouped, halves_to_lanes(scales) if scales.dim() == 3 else scales.contiguous())

    @classmethod
    def six_bit_from_block_order(cls, codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> Q8Weight:
        """GGUF Q6_K's values: codes [out, in] int8 -32..31 in block order, d [out, in // 256] float32, sc
        [out, in // 256, 16] int8 (a scale per 16 inputs) -> six-bit codes with Q6_K's own scales."""
        return cls(pack_six_bit(_to_group_order(codes, q8=True)), pack_q6_scales(d, sc))

    @property
    def six_bit(self) -> bool:
        """Whether the codes are Q6_K's six bits (with its compact scales)."""
        return self.codes.dtype == torch.uint8

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // SIX_BIT_VECTOR_BYTES * BLOCK if self.six_bit else self.codes.shape[1]

    @property
    def per_half(self) -> bool:
        """Whether each 16 inputs of a block have their own scale."""
        return self.scales.dtype in (torch.float32, torch.uint8)

    def lane_scales(self) -> torch.Tensor:  # [out, groups * 8] float32 (per-16 layouts only)
        return unpack_q6_scales(self.scales) if self.six_bit else self.scales

    def half_scales(self) -> torch.Tensor:  # [out, in // 32, 2] float32: the scale of each 16 inputs
        blocks = self.in_features // BLOCK
        if self.per_half:
            return lanes_to_halves(self.lane_scales(), blocks)
        return self.scales.float().unsqueeze(-1).expand(-1, -1, 2)

    def grouped_codes(self) -> torch.Tensor:  # [out, in] int8 in group order (six-bit codes unpacked)
        return unpack_six_bit(self.codes) if self.six_bit else self.codes

    def rows(self, index: torch.Tensor | slice) -> Q8Weight:  # index: [n] int64 or a slice -> those output rows
        return Q8Weight(self.codes[index], self.scales[index])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    def block_codes(self) -> torch.Tensor:  # [out, in] int8 in block order (GGUF Q8_0's)
        return _to_block_order(self.grouped_codes(), q8=True)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        out_features, in_features = self.codes.shape[0], self.in_features
        halves = self.block_codes().view(out_features, -1, 2, BLOCK // 2).float()  # [out, blocks, 2, 16]
        return (halves * self.half_scales().unsqueeze(-1)).view(out_features, in_features)

    def linear(self, kernels: ModuleType, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        return kernels.q8_linear(x.contiguous(), self.codes, self.scales, float_out)


def fits(weight_shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether a [out, in] weight can be block-quantised (inputs a multiple of 32)."""
    return len(weight_shape) == 2 and weight_shape[1] % BLOCK == 0 and weight_shape[1] > 0


def quantize_q4(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> Q4Weight:  # [out, in], in % 32 == 0
    """Asymmetric 4-bit per block of 32: min = the block's minimum, scale = (max - min) / 15, both scale_dtype
    (float16, or float32: the layout GGUF Q4_K blocks load into)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // BLOCK, BLOCK)
    low = groups.amin(-1).to(scale_dtype)  # [out, blocks]
    scale = ((groups.amax(-1) - low.float()) / 15).to(scale_dtype)
    # codes against the float16-rounded scale and min, the values the kernel multiplies by
    safe = scale.float().clamp_min(1e-30).unsqueeze(-1)
    q = ((groups - low.float().unsqueeze(-1)) / safe).round_().clamp_(0, 15).to(torch.uint8)  # [out, blocks, 32]
    codes = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    grouped = _to_group_order(codes.reshape(out_features, in_features // 2), q8=False)
    return Q4Weight(grouped, scale.contiguous(), low.contiguous())


def quantize_q8(weight: torch.Tensor) -> Q8Weight:  # [out, in] float, in % 32 == 0
    """Symmetric 8-bit per block of 32: scale = max |w| / 127 in float16."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // BLOCK, BLOCK)
    scale = (groups.abs().amax(-1) / 127).half()  # [out, blocks]
    safe = scale.float().clamp_min(1e-30).unsqueeze(-1)
    q = (groups / safe).round_().clamp_(-127, 127).to(torch.int8)
    return Q8Weight(_to_group_order(q.view(out_features, in_features), q8=True),
                    scale.contiguous())


def quantize_q8_halves(weight: torch.Tensor) -> Q8Weight:  # [out, in] float, in % 32 == 0
    """Symmetric 8-bit per 16 inputs, float32 scales (the layout GGUF Q6_K blocks load into)."""
    out_features, in_features = weight.shape
    halves = weight.float().view(out_features, in_features // BLOCK, 2, BLOCK // 2)
    scale = halves.abs().amax(-1) / 127  # [out, blocks, 2]
    q = (halves / scale.clamp_min(1e-30).unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return Q8Weight.from_block_order(q.view(out_features, in_features), scale)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, in] float64, as the kernel sees x
    """Each row per block of 32: q = round(x * (127 / max|x|)) in float32, times max|x| / 127 (the kernel's
    int8 activations; the same float32 operations, so the same codes)."""
    rows, in_features = x.shape
    groups = x.float().view(rows, in_features // BLOCK, BLOCK)
    amax = groups.abs().amax(-1, keepdim=True)  # [rows, blocks, 1]
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))  # not 127 / amax: torch
    # computes that as reciprocal(amax) * 127, two roundings where the kernel has one
    q = (groups * inv).round().clamp(-127, 127)
    return (q.double() * (amax / 127).double()).view(rows, in_features)


def reference_linear(weight: Q4Weight | Q8Weight, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out] f64
    """The kernel's maths in float64: int8 activations times the dequantized weight (q4's min term included: it
    reads the quantised activations' block sums, as the kernel does)."""
    return quantize_activations(x) @ weight.dequantize().double().t()
