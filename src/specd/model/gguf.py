"""GGUF files: the header parser and the file's tensors under Hugging Face names, read one at a time.

Its own module so that both the checkpoint loader (weights) and the tokenizer (vocabulary in the metadata)
read GGUF without importing each other. llama.cpp stores q/k rows in its rotary layout; `GgufWeights` puts them
back, so every consumer sees one format. A tensor is read from the file when asked for (one read of its bytes,
never a mapping of the whole file that would count towards the process's memory), as floats or, for the block
types the native kernels run (model/gguf_blocks.py), as the kernels' weight with the file's values.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

import specd.kernels as kernels
from specd.errors import ModelLoadError
from specd.model.config import ModelArchConfig
from specd.model.gguf_blocks import KernelWeight, block_weight, decode_rows, kernel_kind
from specd.model.weights import LazyWeights

# ---------------------------------------------------------------------------------------------- GGUF file
_GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_DEFAULT_ALIGNMENT = 32
_READ_INTO_ROWS = 4096  # rows dequantized at once by read_into


class GgufTensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order (outermost first); GGUF lists dimensions innermost first
    ggml_type: gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GgufFile(NamedTuple):
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensorInfo]


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing `pos`."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buffer, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start, self.pos = self.pos, self.pos + length
        return self.buffer[start:self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type in _GGUF_SCALAR_FORMATS:
            return self.scalar(_GGUF_SCALAR_FORMATS[value_type])
        if value_type == _GGUF_STRING:
            return self.string()
        if value_type == _GGUF_ARRAY:
            element_type, count = self.scalar("I"), self.scalar("Q")
            if element_type in _GGUF_SCALAR_FORMATS:  # one unpack for the whole array
                code = f"{count}{_GGUF_SCALAR_FORMATS[element_type]}"
                values = list(struct.unpack_from("<" + code, self.buffer, self.pos))
                self.pos += struct.calcsize(code)
                return values
            return [self.value(element_type) for _ in range(count)]
        raise ModelLoadError(f"GGUF metadata value type {value_type} is unknown (corrupted file?)")


def read_gguf(path: Path) -> GgufFile:
    """Parse a GGUF header (metadata and tensor table) without reading tensor data.

    Our own parser because gguf.GGUFReader builds a numpy view per vocabulary string (~2.5 s for a
    49k vocabulary); this takes ~0.1 s.
    """
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            if buffer[:4] != b"GGUF":
                raise ModelLoadError(f"{path}: not a GGUF file (bad magic bytes)")
            cursor = _Cursor(buffer)
            cursor.pos = 4
            version = cursor.scalar("I")
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
            metadata: dict[str, Any] = {}
            for _ in range(num_fields):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.scalar("I"))
            table = []
            for _ in range(num_tensors):
                name = cursor.string()
                dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
                table.append((name, tuple(reversed(dims)), cursor.scalar("I"), cursor.scalar("Q")))
            alignment = int(metadata.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT))
            data_start = -(-cursor.pos // alignment) * alignment
            file_size = len(buffer)
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as exc:
        raise ModelLoadError(f"{path}: truncated or corrupted GGUF file ({exc})") from exc
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
    tensors: dict[str, GgufTensorInfo] = {}
    for name, shape, type_id, offset in table:
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {type_id}") from None
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        if shape[-1] % block_size:
            raise ModelLoadError(f"{path}: tensor {name} row length {shape[-1]} is not a multiple of "
                                 f"the {ggml_type.name} block size {block_size}")
        info = GgufTensorInfo(name, shape, ggml_type, data_start + offset, prod(shape) // block_size * block_bytes)
        if info.offset + info.num_bytes > file_size:
            raise ModelLoadError(f"{path}: tensor {name} extends past the end of the file (truncated?)")
        tensors[name] = info
    return GgufFile(path, metadata, tensors)


# ---------------------------------------------------------------------------------------------- GGUF weights
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Architectures whose llama.cpp converter reorders q/k rows for its adjacent-pair rotary kernels.
_ROTARY_PERMUTED_ARCHS = ("llama", "mistral")


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if gguf_name == "rope_freqs.weight":
        raise ModelLoadError("rope_freqs.weight: Llama-3.1-style RoPE scaling from GGUF is not supported; "
                             "load the Hugging Face safetensors checkpoint instead")
    raise ModelLoadError(f"{gguf_name}: GGUF tensor not supported by this Llama-family loader")


def _rotary_row_order(rows: int, num_heads: int) -> torch.Tensor:  # [rows] int64
    """Hugging Face row r is GGUF row order[r]: llama.cpp stores each head's rows interleaved (row j of the first
    rotary half, then row j of the second); Hugging Face keeps the two halves contiguous."""
    return torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)


def _dequantize(raw: np.ndarray, info: GgufTensorInfo) -> torch.Tensor:
    """The tensor as float32 (a fresh copy). raw: the tensor's bytes, uint8 [info.num_bytes]."""
    if info.ggml_type == gguf.GGMLQuantizationType.F32:
        values = raw.view(np.float32).copy()
    elif info.ggml_type == gguf.GGMLQuantizationType.F16:
        values = raw.view(np.float16).astype(np.float32)
    elif info.ggml_type == gguf.GGMLQuantizationType.BF16:  # numpy has no bfloat16; torch does
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float().reshape(info.shape)
    else:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[info.ggml_type]
        rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block_size * block_bytes)
        try:
            values = gguf.quants.dequantize(rows, info.ggml_type).astype(np.float32, copy=False)
        except NotImplementedError:
            raise ModelLoadError(f"{info.name}: ggml type {info.ggml_type.name} cannot be dequantized") from None
    return torch.from_numpy(values).reshape(info.shape)


class GgufWeights(LazyWeights):
    """A GGUF file's tensors under Hugging Face names (q/k rows in Hugging Face order), each read when asked for."""

    def __init__(self, gguf_file: GgufFile, config: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.path = gguf_file.path
        self._infos: dict[str, GgufTensorInfo] = {_hf_name(info.name): info for info in gguf_file.tensors.values()}
        permuted = config.model_type in _ROTARY_PERMUTED_ARCHS
        self._heads = {name: config.num_heads if ".q_proj." in name else config.num_kv_heads
                       for name in self._infos if permuted and (".q_proj." in name or ".k_proj." in name)}

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self._infos[name].shape

    def file_type(self, name: str) -> str:
        return self._infos[name].ggml_type.name

    def _raw(self, info: GgufTensorInfo) -> np.ndarray:  # [num_bytes] uint8, a fresh buffer
        buffer = bytearray(info.num_bytes)
        try:
            with self.path.open("rb", buffering=0) as handle:
                handle.seek(info.offset)
                view, done = memoryview(buffer), 0
                while done < info.num_bytes:
                    count = handle.readinto(view[done:])
                    if not count:
                        raise ModelLoadError(f"{self.path}: tensor {info.name} ends past the end of the file "
                                             "(truncated while loading?)")
                    done += count
        except OSError as exc:
            raise ModelLoadError(f"{self.path}: cannot read tensor {info.name}: {exc}") from exc
        return np.frombuffer(buffer, dtype=np.uint8)

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        heads = self._heads.get(name)
        return None if heads is None else _rotary_row_order(rows, heads)

    def read(self, name: str) -> torch.Tensor:
        info = self._infos[name]
        blocks = self.blocks(name)
        if blocks is not None:  # the same values as gguf's numpy dequantization, with far fewer temporaries
            return blocks.dequantize()
        tensor = _dequantize(self._raw(info), info)
        order = self._row_order(name, tensor.shape[0])
        return tensor if order is None else tensor[order]

    def read_into(self, name: str, out: torch.Tensor) -> None:
        info = self._infos[name]
        native = kernels.native()
        rows = _READ_INTO_ROWS
        if len(info.shape) == 2 and kernel_kind(info.ggml_type) is not None and name not in self._heads:
            raw = torch.from_numpy(self._raw(info)).view(info.shape[0], -1)
            for first in range(0, info.shape[0], rows):  # a few thousand rows at a time: float32 temporaries stay small
                target = out[first:first + rows]
                if native is not None and out.dtype in (torch.float32, torch.bfloat16):
                    native.dequantize_gguf(raw[first:first + rows], int(info.ggml_type), info.shape[1], target)
                else:
                    target.copy_(decode_rows(raw[first:first + rows], info.ggml_type, info.shape[1]).dequantize())
            return
        out.copy_(self.read(name))

    def blocks(self, name: str) -> KernelWeight | None:
        info = self._infos[name]
        if kernel_kind(info.ggml_type) is None or len(info.shape) != 2:
            return None  # nothing to read: the caller converts the floats
        return block_weight(torch.from_numpy(self._raw(info)), info.ggml_type, info.shape,
                            self._row_order(name, info.shape[0]))


def gguf_arch_config(gguf_file: GgufFile) -> ModelArchConfig:
    tensors = gguf_file.tensors
    return ModelArchConfig.from_gguf_metadata(
        gguf_file.metadata,
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
