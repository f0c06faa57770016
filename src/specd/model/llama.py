"""In-house Llama-family decoder (Llama, SmolLM/SmolLM2, Mistral, Qwen2 q/k/v bias, Qwen3 q/k norm).

q/k/v and gate/up projections are stored fused (`qkv_proj`, `gate_up_proj`) so a layer costs four GEMMs;
`load_hf_state_dict` maps Hugging Face parameter names one-to-one onto the fused rows. `forward` takes a ragged
`ForwardBatch` (prefill chunks, decode and multi-token verification mixed) and returns logits only for the rows
asked for. `num_layers` lets a caller run the
first N layers plus the final norm and LM head (self-speculation) with the same weights.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import specd.kernels as kernels
import specd.kernels.fused as fused_kernels
from specd.errors import ModelLoadError
from specd.kernels.blockquant import Q4Weight, Q8Weight, fits, quantize_q4, quantize_q8
from specd.model.attention import AttentionMetadata, ForwardBatch, attend, write_kv
from specd.model.block_load import Conversions, kernel_weight, merge_rows
from specd.model.config import ModelArchConfig, RopeScaling
from specd.model.gguf_blocks import KernelWeight
from specd.model.kv_cache import KVCache
from specd.model.weights import LazyWeights

INT4_GROUP = 32
PROMPT_ENV_VAR = "SPECD_INT4_PROMPT"
_NO_ROWS = torch.empty(0, dtype=torch.long)
logger = logging.getLogger("specd")


class RowSplit(NamedTuple):
    """A forward's rows by kind, for an int4 model with dense prompt weights (LlamaForCausalLM.set_dense_prompt_rows):
    prompt rows take the dense bfloat16 copies, the others the q4 kernel. Together every row once."""

    prompt: torch.Tensor  # [num_prompt_rows] int64, ascending
    other: torch.Tensor  # [num_other_rows] int64, ascending


def dense_prompt_rows() -> bool:
    """Whether an int4 model should run prompt rows through dense bfloat16 copies of its projections, as
    SPECD_INT4_PROMPT says: `bf16` yes, `q4` no, unset or `auto` where the CPU has AMX-BF16. There oneDNN's tiles
    make a prompt row ~10x cheaper than the q4 kernel (0.6-3 us against 9-30 us per row and projection at 32 rows,
    docs/benchmarks.md); without AMX the q4 kernel is as fast or faster and the copies (four times the int4 bytes)
    would buy nothing."""
    setting = os.environ.get(PROMPT_ENV_VAR, "").strip().lower()
    if setting in ("", "auto"):
        return kernels.cpu_has_amx_bf16()
    if setting in ("bf16", "bfloat16"):
        return True
    if setting == "q4":
        return False
    raise ModelLoadError(f"{PROMPT_ENV_VAR}: {setting!r} is not auto, bf16 or q4")


def quantize_int4(
    weight: torch.Tensor,  # [out, in] float, in % INT4_GROUP == 0, out % 16 == 0
) -> tuple[torch.Tensor, torch.Tensor]:  # packed int4 [out, in // 2] uint8, scales_and_zeros [in // 32, out, 2]
    """Asymmetric int4 per group of 32 inputs: w = scale * (q - 8) + zero, with q in 0..15.

    The codes are exact for weights dequantized from GGUF Q4_1 (each block spans q = 0..15, so its min and max
    lie on the grid); the caller stores the scales in bfloat16, a rounding comparable to a bfloat16 weight's.
    """
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low = groups.amin(-1, keepdim=True)  # [out, groups, 1]
    scale = ((groups.amax(-1, keepdim=True) - low) / 15).clamp_min(1e-10)
    q = ((groups - low) / scale).round_().clamp_(0, 15).to(torch.int32).view(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zeros = low + 8 * scale
    scales_and_zeros = torch.stack([scale.squeeze(-1).t(), zeros.squeeze(-1).t()], dim=-1).contiguous()
    return packed, scales_and_zeros


def quantize_int8(
    weight: torch.Tensor,  # [out, in] float
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 [out, in], float32 scales [out]
    """Symmetric int8 per output row: w = scale * q, q in -127..127 (the layout `_weight_int8pack_mm` reads).

    For the LM head: on the default model it is a GGUF Q8_0 matrix (int8 per block of 32), so this rounding is
    a second, per-row one; its logits stay about as close to float32 as a bfloat16 head's, where an int4 head
    flips the top-1 token on ~12% of positions (measured on the benchmark prompts).
    """
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-10)  # [out]
    q = (w / scales.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scales


def mkldnn_pack(weight: torch.Tensor) -> torch.Tensor | None:  # [out, in] -> opaque blocked copy, or None
    """oneDNN's pre-blocked copy of a float32/bfloat16 CPU weight, when oneDNN is available.

    Measured on a 2-core AVX-512 CPU, the pre-blocked GEMM is 1.6-2x faster than `F.linear` for 1-16 rows in
    bfloat16 (bit-identical results) and 1.4-4x faster in float32, where MKL's plain small-M GEMM is slowest.
    Decode and verification are small-M, so this layout decides whether a verification step is cheap.
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # a CPU without bfloat16 support in oneDNN keeps the dense weight and F.linear
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


PROMPT_TILE = 32  # rows per dense GEMM call of prompt_linear (fused_ops.cpp's kPromptTile)


def prompt_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [rows, in] bf16 -> [rows, out] bf16
    """Prompt rows through a dense bfloat16 weight (Linear.prompt_weight) in calls of exactly PROMPT_TILE rows, the
    last padded with zeros: oneDNN's result for a row depends on the call's row count (measured: a 576x1536 GEMM
    gives other bits at 32 rows than at 256), never on the other rows' values or the row's place in the call, so
    fixed-size calls make a prompt row's result independent of how the scheduler chunked and batched its prompt --
    which greedy speculation needs to stay token-identical to plain decoding. fused_ops' prompt_linear where the
    fused ops are built (the one-call layers use it), the same calls from torch otherwise."""
    ops = fused_kernels.fused_ops()
    if ops is not None:
        return ops.prompt_linear(x, weight)
    rows = x.shape[0]
    padded = -(-rows // PROMPT_TILE) * PROMPT_TILE
    tiles = F.pad(x, (0, 0, 0, padded - rows)).split(PROMPT_TILE)
    if weight.is_mkldnn:
        out = [torch.ops.mkldnn._linear_pointwise(t, weight, None, "none", [], "") for t in tiles]
    else:
        out = [F.linear(t, weight) for t in tiles]
    return torch.cat(out)[:rows]


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out, in] as in Hugging Face checkpoints until `pack()`.

    `pack()` (after loading and casting) replaces a float32/bfloat16 weight by oneDNN's pre-blocked copy (see
    `mkldnn_pack`); float64 (tests) keeps the dense weight. `hf_weight` gives the dense [out, in] weight either
    way. `add_int4()` (for bfloat16 models) replaces the weight by an int4 copy; `add_int8()` adds an int8
    copy beside it (the tied LM head, whose dense table the embedding lookup still reads). A quantized copy
    serves every row count, prefill included: the kernels compute each row independently of the others, so a
    token's logits do not depend on how many rows share its forward -- what keeps speculation lossless against
    plain decoding in this mode. (On the 2-core AVX2 development CPU the int4 kernel is also 1.7-3.5x faster
    than the dense bfloat16 GEMM from 1 to 256 rows, and int8 1.1-2.9x from 1 to 40.)

    Where specd's native kernels build (`specd.kernels.native()`), `add_int4()`/`add_int8()` store block
    copies for them instead (`q4`, `q8`: float16 block scales, int8-quantised activations, integer dot
    products; rows computed independently likewise); torch's kernels (`int4`, `int8`) are the fallback.
    """

    weight: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.q4: Q4Weight | None = None
        self.q8: Q8Weight | None = None
        # row blocks of different layouts (a qkv whose v is Q6_K and q, k Q4_K): one GEMM each, outputs joined
        self.parts: tuple[KernelWeight, ...] = ()
        self.float_out = False  # the LM head: float32 results straight from the kernel, no bfloat16 rounding
        # a dense bfloat16 copy of the q4 weight for prompt rows (oneDNN's blocked layout where it has one)
        self.prompt_weight: torch.Tensor | None = None

    @classmethod
    def sharing(cls, weight: nn.Parameter) -> Linear:
        """A bias-free Linear over an existing [out, in] weight (the tied LM head reads the embedding table)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.weight, linear.bias, linear.packed, linear.int4, linear.int8 = weight, None, None, None, None
        linear.q4, linear.q8, linear.prompt_weight, linear.parts, linear.float_out = None, None, None, (), False
        return linear

    def set_blocks(self, weights: Sequence[KernelWeight]) -> None:
        """Run this projection on the native kernels' block weights, `weights` being its output rows in order
        (q, k, v; gate, up; or one): parts of one layout are joined into one GEMM. Drops the dense weight."""
        merged = merge_rows(weights)
        self.weight, self.q4, self.q8, self.parts = None, None, None, ()
        if len(merged) > 1:
            self.parts = tuple(merged)
        elif isinstance(merged[0], Q4Weight):
            self.q4 = merged[0]
        else:
            self.q8 = merged[0]

    def set_prompt_weight(self, enabled: bool) -> None:
        """Keep (or drop) a dense bfloat16 copy of the q4 weight, the dequantized codes rounded once, for prompt
        rows (`forward` with a RowSplit). No-op without a q4 weight."""
        if not enabled or self.q4 is None:
            self.prompt_weight = None
            return
        dense = self.q4.dequantize().to(torch.bfloat16).contiguous()  # [out, in]
        self.prompt_weight = mkldnn_pack(dense)
        if self.prompt_weight is None:
            self.prompt_weight = dense

    def add_int4(self) -> None:
        """Quantize the current (ideally float32) weight into the int4 copy, which replaces it; its scales are
        bfloat16. A shape the int4 kernel cannot tile (inputs not a multiple of 32 or outputs of 16) keeps the
        dense weight."""
        out_features, in_features = self.hf_weight.shape
        if kernels.native() is not None and fits(self.hf_weight.shape):
            self.q4 = quantize_q4(self.hf_weight.detach())
            self.weight = None
            return
        if in_features % INT4_GROUP or out_features % 16:
            return
        packed, scales_and_zeros = quantize_int4(self.hf_weight.detach())
        self.int4 = (packed, scales_and_zeros.to(torch.bfloat16))
        self.weight = None

    def add_int8(self) -> None:
        """Quantize the current (ideally float32) weight into the int8 copy; its scales are bfloat16 (float16 per
        block of 32 for the native kernel, which recovers a GGUF Q8_0 matrix exactly)."""
        self.float_out = True
        if kernels.native() is not None and fits(self.hf_weight.shape):
            self.q8 = quantize_q8(self.hf_weight.detach())
            return
        q, scales = quantize_int8(self.hf_weight.detach())
        self.int8 = (q, scales.to(torch.bfloat16))

    def pack(self) -> None:
        if self.packed is not None or self.weight is None:
            return
        self.packed = mkldnn_pack(self.weight)
        if self.packed is not None:
            self.weight = None  # the blocked copy replaces it: no second copy of the weights in memory

    @property
    def hf_weight(self) -> torch.Tensor:  # [out_features, in_features]; once packed or int4, a read-only dense copy
        if self.weight is not None:
            return self.weight
        if self.parts:
            return torch.cat([part.dequantize() for part in self.parts]).to(torch.bfloat16)
        if self.q8 is not None:
            return self.q8.dequantize().to(torch.bfloat16)
        if self.q4 is not None:
            return self.q4.dequantize().to(torch.bfloat16)
        if self.int4 is not None:  # the identity through the kernel reads the dequantized weight back
            packed, scales_and_zeros = self.int4
            eye = torch.eye(packed.shape[1] * 2, dtype=scales_and_zeros.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, INT4_GROUP, scales_and_zeros).t()
        assert self.packed is not None
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        """rows: with a prompt weight, its prompt rows take the dense copy (prompt_linear), the rest the q4 kernel."""
        if rows is not None and self.prompt_weight is not None and rows.prompt.numel():
            prompt_out = prompt_linear(x.index_select(0, rows.prompt), self.prompt_weight)  # [num_prompt, out]
            if self.bias is not None:
                prompt_out = prompt_out + self.bias
            if not rows.other.numel():
                return prompt_out
            out = x.new_empty(x.shape[0], prompt_out.shape[1])
            out.index_copy_(0, rows.prompt, prompt_out)
            out.index_copy_(0, rows.other, self.forward(x.index_select(0, rows.other)))
            return out
        if self.q4 is not None or self.q8 is not None or self.parts:
            native = kernels.native()
            assert native is not None  # q4/q8 are only made when it is
            if self.parts:
                y = torch.cat([part.linear(native, x, self.float_out) for part in self.parts], dim=-1)
            else:
                block_weight = self.q4 if self.q4 is not None else self.q8
                assert block_weight is not None
                y = block_weight.linear(native, x, self.float_out)
            return y if self.bias is None else y + self.bias
        if self.int4 is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4[0], INT4_GROUP, self.int4[1])
            return y if self.bias is None else y + self.bias
        if self.int8 is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.int8[0], self.int8[1])
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.bfloat16:
            # One fused kernel (it accumulates in float32); the reference rounds once more, before the weight.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 like the reference implementation (even for float64), so results match its rounding.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:  # [head_dim // 2]
    # float32 on purpose: the reference implementation computes frequencies in float32, and matching its
    # rounding keeps float64 test models bit-comparable.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half convention).

    The sine table has the rotate-half sign folded in, so rotating is `x * cos + roll(x, d/2) * sin_signed`:
    three elementwise ops, applied once to the q and k heads together. The tables a forward uses carry the
    attention's softmax scale on the query heads' rows, so scaling the queries costs no op of its own.
    """

    def __init__(self, config: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], dim=-1), persistent=False)
        self.register_buffer("sin_signed", torch.cat([-freqs.sin(), freqs.sin()], dim=-1), persistent=False)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.query_scale = config.head_dim**-0.5

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype  # [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, num_heads + num_kv_heads, head_dim]
        """Computed once per forward and shared by all layers. Rows of the query heads are multiplied by
        head_dim ** -0.5 (exact when head_dim is a power of 4), the key heads' rows are not."""
        work = torch.promote_types(dtype, torch.float32)  # scale before rounding to a narrow dtype
        head_scale = torch.ones(self.num_heads + self.num_kv_heads, 1, dtype=work)  # [heads, 1]
        head_scale[: self.num_heads] = self.query_scale
        cos = self.cos[positions].to(work).unsqueeze(1) * head_scale  # [num_tokens, heads, head_dim]
        sin_signed = self.sin_signed[positions].to(work).unsqueeze(1) * head_scale
        return cos.to(dtype), sin_signed.to(dtype)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, num_heads or 1, head_dim]
    sin_signed: torch.Tensor,  # [num_tokens, num_heads or 1, head_dim]
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; may be x itself (rotate in place)
) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed, out=out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    @property
    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """qkv, o, gate_up, down: the order fused_ops' LayerStack keeps them in."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def one_call_weights(self) -> list[torch.Tensor] | None:
        """The tensors fused_ops' `decoder_layers` reads for this layer, when it can run it: all four projections
        are specd's q4 blocks, no biases, no q/k norms. None: the layer runs op by op."""
        projections = self.projections
        if self.q_norm is not None or any(p.q4 is None or p.bias is not None for p in projections):
            return None
        weights = [self.input_layernorm.weight]
        for i, projection in enumerate(projections):
            if i == 2:  # the post-attention norm sits between o_proj and gate_up_proj
                weights.append(self.post_attention_layernorm.weight)
            assert projection.q4 is not None
            weights += [projection.q4.codes, projection.q4.scales, projection.q4.mins]
        return weights

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rope: tuple[torch.Tensor, torch.Tensor],  # Rotary.tables: [num_tokens, num_heads + num_kv_heads, head_dim]
        cache: KVCache,
        meta: AttentionMetadata,
        rows: RowSplit | None = None,  # prompt rows vs the rest, for dense prompt weights (Linear.forward)
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        fused = fused_kernels.for_dtype(hidden.dtype)
        if fused is not None:
            return self._forward_fused(fused, hidden, rope, cache, meta, rows)
        num_tokens, num_qk_heads = hidden.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(self.input_layernorm(hidden), rows)  # [num_tokens, q_size + 2 * kv_size]
        heads = qkv.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)  # q heads, k heads, v heads
        qk = heads[:, :num_qk_heads]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        # Rotated (and, for queries, scaled) back into the projection's buffer, so each token's keys and values
        # stay side by side and reach the cache in one copy.
        apply_rotary(qk, *rope, out=heads[:, :num_qk_heads])
        write_kv(heads[:, self.num_heads :].view(num_tokens, 2, self.num_kv_heads, self.head_dim),
                 cache, self.index, meta)
        attn = attend(heads[:, : self.num_heads], cache, self.index, meta, scale=1.0)  # [num_tokens, q_size]
        hidden = hidden + self.o_proj(attn, rows)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden), rows).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up, rows)

    def _forward_fused(
        self,
        fused: ModuleType,  # specd.kernels.fused's ops
        hidden: torch.Tensor,  # [num_tokens, hidden_size] bfloat16
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        meta: AttentionMetadata,
        rows: RowSplit | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """`forward` in six native calls besides the four GEMMs: norm; rotary + KV write; attention; residual
        add + norm; SiLU x up; and the last residual add (torch's). Same roundings as the torch path.
        fused_ops' `decoder_layers` runs these same steps in C++ (LlamaForCausalLM.prepare_one_call_layers)."""
        num_tokens, num_qk_heads = hidden.shape[0], self.num_heads + self.num_kv_heads
        eps = self.input_layernorm.eps
        qkv = self.qkv_proj(fused.rms_norm(hidden, self.input_layernorm.weight, eps), rows)
        heads = qkv.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)  # q heads, k heads, v heads
        if self.q_norm is not None and self.k_norm is not None:
            qk = heads[:, :num_qk_heads]
            heads[:, :num_qk_heads] = torch.cat([self.q_norm(qk[:, : self.num_heads]),
                                                 self.k_norm(qk[:, self.num_heads :])], dim=1)
        fused.rope_write_kv(heads, rope[0], rope[1], cache.kv[self.index], meta.write_slots, meta.write_positions)
        attn = attend(heads[:, : self.num_heads], cache, self.index, meta, scale=1.0, fused=fused)
        hidden, normed = fused.add_rms_norm(hidden, self.o_proj(attn, rows), self.post_attention_layernorm.weight, eps)
        return hidden + self.down_proj(fused.silu_mul(self.gate_up_proj(normed, rows)), rows)


class ForwardOutput(NamedTuple):
    """logits: [num_logit_rows, vocab_size] (float32, float64 for float64 models). hidden_states: the residual
    streams asked for, for every new token in batch order: [num_tokens, len(hidden_layers) * hidden_size]; None
    when none were asked for."""

    logits: torch.Tensor
    hidden_states: torch.Tensor | None


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        # No init on the meta device (a checkpoint fills the table): most ops on meta tensors run torch._refs,
        # whose first use imports torch._dynamo, over a second of a load. Built for real (tests), it is the same
        # N(0, 1) draw nn.Embedding makes.
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        if not table.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        with torch.device("cpu"):  # its tables computed for real even under the meta device (see the table above)
            self.rotary = Rotary(config, max_positions or config.max_position_embeddings)
        self.tied_head: Linear | None = None  # the tied LM head over the embedding table, made by pack()
        # fused_ops' LayerStack of every decoder layer (prepare_one_call_layers); None: the layers run op by op
        self.one_call_stack: object | None = None
        # prompt rows through dense bfloat16 copies of the q4 projections (set_dense_prompt_rows)
        self.dense_prompt_rows = False

    def pack(self) -> None:
        """Lay weights out for fast small-M matmuls on CPU (see Linear.pack). Call after loading and casting.

        With tied embeddings the LM head is a Linear over the embedding table, packed like the others (its
        blocked copy is separate: the lookup table stays dense).
        """
        if self.lm_head is None and self.tied_head is None:
            self.tied_head = Linear.sharing(self.embed_tokens.weight)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.prepare_one_call_layers()

    def prepare_one_call_layers(self, enabled: bool = True) -> int:
        """Gather, once, what fused_ops' `decoder_layers` reads, so that a forward runs its decoder layers in one
        native call (or one per run between captured layers) instead of ~14 Python calls each: the same kernels in
        the same order as DecoderLayer._forward_fused, so the same bits. Only when every layer qualifies
        (DecoderLayer.one_call_weights: int4 with specd's native kernels, no biases, no q/k norms) and the fused
        ops are built. enabled=False: op by op (the A/B switch of the tests and benchmarks). Returns how many
        layers run in one call (0 or all).

        Assumes the weights stay as they are (pack() calls this last): the stack holds the tensors, not copies.
        """
        self.one_call_stack = None
        native, fused = kernels.native(), fused_kernels.for_dtype(self.dtype)
        if not enabled or native is None or fused is None:
            return 0
        weights = [layer.one_call_weights() for layer in self.layers]
        if not weights or any(w is None for w in weights):
            return 0
        dense = [[p.prompt_weight for p in layer.projections] for layer in self.layers]
        self.one_call_stack = fused.make_layer_stack(weights, dense if self.dense_prompt_rows else [],
                                                     self.config.rms_norm_eps, self.config.num_heads,
                                                     native.q4_linear_capsule())
        return len(weights)

    def set_dense_prompt_rows(self, enabled: bool) -> bool:
        """Give every q4 projection of the decoder layers a dense bfloat16 copy for prompt rows (enabled), or drop
        them. A forward then sends the rows ForwardBatch.prompt_rows names through the copies (prompt_linear) and
        the rest (decode and verification rows) through the q4 kernel, in the one-call layers and op by op alike.
        A prompt row's result depends only on its own inputs either way, so greedy speculation stays
        token-identical to plain decoding; the prompt's KV differs from the q4 kernel's by bfloat16 rounding.
        Only when every projection is q4 (an int4 model on specd's kernels); returns whether it is on."""
        projections = [p for layer in self.layers for p in layer.projections]
        on = enabled and bool(projections) and all(p.q4 is not None for p in projections)
        for projection in projections:
            projection.set_prompt_weight(on)
        self.dense_prompt_rows = on
        if self.one_call_stack is not None:
            self.prepare_one_call_layers()
        return on

    def _row_split(self, batch: ForwardBatch) -> RowSplit | None:
        """The batch's prompt rows and the rest, when the model has dense prompt weights and the batch prompt rows."""
        if not batch.prompt_rows.numel() or not self.dense_prompt_rows:
            return None
        is_other = torch.ones(batch.token_ids.shape[0], dtype=torch.bool)
        is_other[batch.prompt_rows] = False
        return RowSplit(batch.prompt_rows, is_other.nonzero().flatten())

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def make_cache(self, max_slots: int, max_len: int, num_layers: int | None = None,
                   budget_tokens: int | None = None) -> KVCache:
        c = self.config
        return KVCache(
            num_layers=num_layers or c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            max_slots=max_slots,
            max_len=max_len,
            dtype=self.dtype,
            device=self.embed_tokens.weight.device,
            budget_tokens=budget_tokens,
        )

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, cache: KVCache, num_layers: int | None = None
    ) -> torch.Tensor:  # [num_logit_rows, vocab_size] float32
        """Run the new tokens through the model, writing their KV into `cache` at their positions.

        Assumes cache capacity covers every position written (the caller reserves) and that the cache has
        at least `num_layers` layers. Does not change committed lengths: the caller commits or rolls back.
        """
        return self.forward_with_hidden(batch, cache, num_layers).logits

    @torch.inference_mode()
    def forward_with_hidden(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        num_layers: int | None = None,
        hidden_layers: Sequence[int] | None = None,
    ) -> ForwardOutput:
        """`forward`, plus hidden states of every new token when `hidden_layers` is given.

        hidden_layers: which residual streams to return, concatenated along the feature axis in the order
        given: layer index i (0-based) is the output of decoder layer i, and -1 the final normed hidden state
        that the LM head reads (EAGLE-1's feature; EAGLE-3 fuses a low, a middle and a high layer). None (the
        default) computes none of them, so callers that don't need features pay nothing.
        """
        # The fused attention needs no padding index or masks: it attends every row over its own keys.
        fused = fused_kernels.for_dtype(self.dtype)
        meta = AttentionMetadata.build(batch, masks=fused is None)
        hidden = self.embed_tokens(batch.token_ids)  # [num_tokens, hidden_size]
        rope = self.rotary.tables(batch.positions, hidden.dtype)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        wanted = tuple(hidden_layers or ())
        for i in wanted:
            if not -1 <= i < len(layers):
                raise ValueError(f"hidden_layers: {i} is not -1 or a layer index below {len(layers)}")
        captured: dict[int, torch.Tensor] = {}
        rows = self._row_split(batch)
        if fused is not None and self.one_call_stack is not None:
            # natively, in runs that end at each captured layer
            first = 0
            prompt_rows, other_rows = rows if rows is not None else (_NO_ROWS, _NO_ROWS)
            for end in sorted({i + 1 for i in wanted if i >= 0} | {len(layers)}):
                hidden = fused.decoder_layers(self.one_call_stack, first, end, hidden, rope[0], rope[1], cache.kv,
                                              meta.write_slots, meta.write_positions, meta.slot_index,
                                              meta.seq_starts, meta.cu_num_new, prompt_rows, other_rows)
                captured[end - 1], first = hidden, end
        else:
            for i, layer in enumerate(layers):
                hidden = layer(hidden, rope, cache, meta, rows)
                if i in wanted:
                    captured[i] = hidden
        features: torch.Tensor | None = None
        if wanted:
            if -1 in wanted:
                captured[-1] = self.norm(hidden)  # [num_tokens, hidden_size]
            features = torch.cat([captured[i] for i in wanted], dim=-1)  # [num_tokens, len(wanted) * hidden]
        last = self.norm(hidden[batch.logits_indices])  # [num_logit_rows, hidden_size]
        return ForwardOutput(self.compute_logits(last), features)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden_size] -> [rows, vocab] float32+
        """The LM head over final normed hidden states (a draft head that reuses the target's head calls this)."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        # F.linear only for a model used before pack()
        logits = head(hidden) if head is not None else F.linear(hidden, self.embed_tokens.weight)
        # float64 models (tests) keep float64 logits so near-ties cannot flip; others compute in float32.
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    # ------------------------------------------------------------ weights
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], projections: bool = True,
                           embedding: bool = True) -> None:
        """Load weights named as in Hugging Face checkpoints (model.layers.{i}.self_attn.q_proj.weight, ...),
        one tensor at a time (a LazyWeights reads each when taken). projections=False: all but the projections
        and a separate LM head; embedding=False: not the embedding table (load_blocks has loaded them)."""
        if any(isinstance(m, Linear) and m.packed is not None for m in self.modules()):
            # hf_weight of a packed layer is a dense copy: writing into it would silently load nothing.
            raise ModelLoadError("weights must be loaded before pack(); build the model with build_model()")
        c = self.config
        missing: list[str] = []

        def take(name: str) -> torch.Tensor:
            if name not in state_dict:
                missing.append(name)
                return torch.empty(0)
            return state_dict[name]

        with torch.no_grad():
            if embedding:
                self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if self.lm_head is not None and projections:
                self.lm_head.hf_weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                if projections:
                    qkv = [take(a + f"{n}_proj.weight") for n in "qkv"]
                    if not missing:
                        layer.qkv_proj.hf_weight.copy_(torch.cat(qkv, 0))
                if c.qkv_bias:
                    biases = [take(a + f"{n}_proj.bias") for n in "qkv"]
                    if not missing and layer.qkv_proj.bias is not None:
                        layer.qkv_proj.bias.copy_(torch.cat(biases, 0))
                if projections:
                    layer.o_proj.hf_weight.copy_(take(a + "o_proj.weight"))
                if layer.q_norm is not None and layer.k_norm is not None:
                    layer.q_norm.weight.copy_(take(a + "q_norm.weight"))
                    layer.k_norm.weight.copy_(take(a + "k_norm.weight"))
                if projections:
                    gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
                    if not missing:
                        layer.gate_up_proj.hf_weight.copy_(torch.cat([gate, up], 0))
                    layer.down_proj.hf_weight.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
                if missing:
                    break
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}")

    def block_linears(self) -> list[tuple[Linear, list[str]]]:
        """The projections that run on block weights in the quantized mode, with the HF tensors of their rows in
        order: every decoder layer's four, then a separate LM head."""
        out: list[tuple[Linear, list[str]]] = []
        for i, layer in enumerate(self.layers):
            a, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            out += [(layer.qkv_proj, [f"{a}{n}_proj.weight" for n in "qkv"]), (layer.o_proj, [f"{a}o_proj.weight"]),
                    (layer.gate_up_proj, [f"{p}gate_proj.weight", f"{p}up_proj.weight"]),
                    (layer.down_proj, [f"{p}down_proj.weight"])]
        if self.lm_head is not None:
            out.append((self.lm_head, ["lm_head.weight"]))
        return out

    def load_blocks(self, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
        """The quantized mode's load: each projection straight into block weights (model/block_load.py: the file's
        own blocks where the kernels run them), one tensor at a time, never a dense copy; the rest (embedding,
        norms, biases) as load_hf_state_dict does, into parameters already in the model's dtype. A tied LM head gets
        the embedding table's blocks. Assumes the projections' (and a separate head's) weights were dropped before
        the parameters were allocated (build_model). Returns what changed, a line per conversion."""
        conversions = Conversions()
        missing = [name for _, names in self.block_linears() for name in names if name not in state_dict]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}")
        for linear, names in self.block_linears():
            head = linear is self.lm_head
            blocks = [kernel_weight(state_dict, name, conversions, head=head) for name in names]
            if any(b is None for b in blocks):  # a shape the kernels cannot block: dense, as the float modes
                linear.weight = nn.Parameter(torch.cat([state_dict[name] for name in names]).to(self.dtype),
                                             requires_grad=False)
                continue
            linear.set_blocks([b for b in blocks if b is not None])
            linear.float_out = head
        # The embedding table straight from the checkpoint (from the file's blocks, a few thousand rows at a time,
        # where it has them: a float32 copy of a large vocabulary's table is the largest transient of a load); a
        # tied head takes the table's blocks (repacked only then).
        embed_name = "model.embed_tokens.weight"
        lazy = isinstance(state_dict, LazyWeights)
        if lazy:
            with torch.no_grad():
                state_dict.read_into(embed_name, self.embed_tokens.weight)
        self.load_hf_state_dict(state_dict, projections=False, embedding=not lazy)
        if self.lm_head is None:
            tied = kernel_weight(state_dict, embed_name, conversions, head=True)
            self.tied_head = Linear.sharing(self.embed_tokens.weight)
            if tied is not None:  # the head reads the blocks; the lookup table stays dense
                self.tied_head.set_blocks([tied])
                self.tied_head.float_out = True
        return conversions.lines()


def _materialize(module: nn.Module) -> None:
    """Every meta parameter and buffer as an uninitialised CPU tensor: `module.to_empty(device="cpu")` without
    torch._refs' empty_like, whose first use imports sympy (half a second of a load)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.is_meta:
                sub._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                     requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)


def build_model(
    config: ModelArchConfig,
    state_dict: Mapping[str, torch.Tensor] | None,
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    int4: bool = False,
) -> LlamaForCausalLM:
    """Build with `state_dict`'s HF-named weights (random init only when None), cast to dtype, pack. The
    weights are taken one tensor at a time (a LazyWeights reads each from the file only then).

    int4 (the quantized mode): the decoder layers' projections and the LM head run on the native kernels' block
    weights, each the file's own blocks where the kernels run its type (GGUF Q4_0, Q4_1, Q4_K, Q8_0, Q6_K), else
    quantized from its floats (4-bit projections, an 8-bit head; model/block_load.py, logged once per load);
    activations are bfloat16. Without the native kernels, torch's int4 (projections) and int8 (head) kernels run
    copies quantized from the float32 weights. Where
    `dense_prompt_rows()` says so (AMX CPUs, or SPECD_INT4_PROMPT=bf16), prompt rows run through dense bfloat16
    copies of the projections (LlamaForCausalLM.set_dense_prompt_rows).
    """
    if int4 and dtype != torch.bfloat16:
        raise ModelLoadError("dtype: int4 weights run with bfloat16 activations")
    # From a checkpoint with the native kernels: each projection straight from the file into block weights
    # (load_blocks); without them, torch's int4 kernels quantize the loaded dense weights (below).
    blockwise = int4 and state_dict is not None and kernels.native() is not None
    if state_dict is None:
        model = LlamaForCausalLM(config, max_positions)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, max_positions)
        if blockwise:  # parameters in their final dtype, and none at all for the projections
            model = model.to(dtype)
            for linear, _ in model.block_linears():
                linear.weight = None
        _materialize(model)
        model.rotary = Rotary(config, max_positions or config.max_position_embeddings)
        if blockwise:
            for line in model.load_blocks(state_dict):
                logger.warning("%s", line)
        else:
            model.load_hf_state_dict(state_dict)
    if int4 and not blockwise:
        for module in model.layers.modules():
            if isinstance(module, Linear):
                module.add_int4()
        head = model.lm_head
        if head is None:
            head = model.tied_head = Linear.sharing(model.embed_tokens.weight)
        head.add_int8()
    model = model.to(dtype).eval()
    if int4 and dense_prompt_rows():
        model.set_dense_prompt_rows(True)
    model.pack()
    return model
