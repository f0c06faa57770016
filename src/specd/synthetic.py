"""Llama-shaped GGUF files with random weights and the default model's tokenizer, for tests and bench/scale.py.

No model hub is reachable offline, so models of the sizes users run are made here: the shapes of Llama-3.2-1B/3B and
Llama-3.1-8B (with the default model's 49,152-token vocabulary), random weights, written with `gguf`'s GGUFWriter one
tensor at a time (an 8B F16 file never sits in memory whole). Their text is noise; their shapes, block types, speed,
memory and engine-vs-engine agreement are real. bench/scale.py then quantizes the F16 file with llama.cpp's own
quantizer, so specd and llama.cpp read the same bytes; tests write small files of every block type directly
(`gguf.quants` where it can quantize a type, random blocks with sane scales where it cannot, as for the K-quants).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

from specd.model.gguf import read_gguf
from specd.model.loader import default_model_path

T = gguf.GGMLQuantizationType


class LlamaShape(NamedTuple):
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tied: bool  # no output.weight: the LM head reads token_embd (as Llama-3.2 1B/3B)
    vocab_size: int = 49152  # the default model's tokenizer

    @property
    def num_parameters(self) -> int:
        h, f, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.hidden_size // self.num_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        return self.num_layers * per_layer + self.vocab_size * h * (1 if self.tied else 2) + h


SHAPES: dict[str, LlamaShape] = {
    "1b": LlamaShape(2048, 16, 32, 8, 8192, tied=True),
    "3b": LlamaShape(3072, 28, 24, 8, 8192, tied=True),
    "8b": LlamaShape(4096, 32, 32, 8, 14336, tied=False),
}

# Types `gguf.quants.quantize` implements; the others are written as random blocks (see random_blocks).
_QUANTIZABLE = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0})
# Where each randomly written type keeps its float16 scale fields (byte offsets within a block).
_F16_FIELDS: dict[T, tuple[int, ...]] = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _tensors(shape: LlamaShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, torch-order shape) of every tensor of the model, in file order."""
    h, f = shape.hidden_size, shape.intermediate_size
    kv = shape.num_kv_heads * (h // shape.num_heads)
    yield "token_embd.weight", (shape.vocab_size, h)
    for i in range(shape.num_layers):
        b = f"blk.{i}."
        yield from ((b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h)),
                    (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)),
                    (b + "ffn_norm.weight", (h,)), (b + "ffn_gate.weight", (f, h)), (b + "ffn_up.weight", (f, h)),
                    (b + "ffn_down.weight", (h, f)))
    yield "output_norm.weight", (h,)
    if not shape.tied:
        yield "output.weight", (shape.vocab_size, h)


def random_blocks(rng: np.random.Generator, ggml_type: T, shape: tuple[int, ...]) -> np.ndarray:
    """Random blocks of `ggml_type` for a [out, in] tensor: random bytes with the float16 scales set to small
    values (any bytes are valid codes). [out, in / block * bytes] uint8."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    out_features, in_features = shape
    raw = rng.integers(0, 256, size=(out_features, in_features // block_size, block_bytes), dtype=np.uint8)
    for offset in _F16_FIELDS[ggml_type]:
        scale = rng.uniform(0.0005, 0.002, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(out_features, -1)


def _tensor_data(rng: np.random.Generator, ggml_type: T, shape: tuple[int, ...], std: float) -> np.ndarray:
    if len(shape) == 1:  # norms: float32 around 1, as trained models have them
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if ggml_type not in _QUANTIZABLE:
        return random_blocks(rng, ggml_type, shape)
    values = (std * rng.standard_normal(shape, dtype=np.float32))
    if ggml_type == T.F32:
        return values
    if ggml_type == T.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, ggml_type)


def write_gguf(path: Path, shape: LlamaShape, tensor_type: T | Callable[[str], T] = T.F16, seed: int = 0,
               std: float = 0.02) -> Path:
    """Write a Llama GGUF of `shape` with random weights: each 2-D tensor in `tensor_type` (or tensor_type(name)),
    norms in F32; the default model's tokenizer and chat template. Returns `path`."""
    source = read_gguf(default_model_path()).metadata
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"synthetic llama {shape.num_parameters / 1e9:.2f}B")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.hidden_size // shape.num_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_tokenizer_model(source["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    writer.add_token_list(source["tokenizer.ggml.tokens"])
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(source["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(source["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(source["tokenizer.chat_template"])
    type_of = tensor_type if callable(tensor_type) else (lambda _name: tensor_type)
    layout = [(name, dims, T.F32 if len(dims) == 1 else type_of(name)) for name, dims in _tensors(shape)]
    for name, dims, ggml_type in layout:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        nbytes = int(np.prod(dims)) // block_size * block_bytes
        if ggml_type in (T.F32, T.F16):
            writer.add_tensor_info(name, dims, np.dtype(np.float32 if ggml_type == T.F32 else np.float16), nbytes)
        else:  # quantized (and BF16): the byte shape, as GGUFWriter takes raw blocks
            byte_shape = (*dims[:-1], dims[-1] // block_size * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=ggml_type)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, dims, ggml_type in layout:
        writer.write_tensor_data(_tensor_data(rng, ggml_type, dims, std))
    writer.close()
    return path
