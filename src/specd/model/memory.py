"""How much memory a model will take before it is loaded, and the refusal when it will not fit.

The estimate is read from the checkpoint's header alone: each tensor's bytes in the format it will run in (the
quantized mode's block weights, model/block_load.py; or dense in the float modes), the KV cache at its largest
(`max_num_seqs` sequences of `max_model_len` tokens), the runtime (Python, torch, the tokenizer: ~300 MiB measured)
and the largest tensor's float32 copy that a load holds for a moment. It is compared with what the machine can give
the process (MemAvailable, and a cgroup's memory.max where one is set), so a model that cannot fit is refused with
the numbers and the flags that change them, instead of being killed by the OOM killer halfway through its load.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from pathlib import Path
from typing import NamedTuple

import gguf
import torch

from specd.errors import ModelLoadError
from specd.kernels.blockquant import BLOCK
from specd.model.config import ModelArchConfig
from specd.model.gguf_blocks import kernel_kind
from specd.model.weights import file_type_of, shape_of

RUNTIME_BYTES = 300 * 2**20  # python + torch + tokenizers + the server, measured on the default model
GIB = 2**30


class MemoryEstimate(NamedTuple):
    weights: int  # bytes of the weights in their compute format
    kv_cache: int  # bytes of the KV cache for max_num_seqs x max_model_len tokens
    runtime: int
    transient: int  # the largest tensor's float32 copy, held while it is converted

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.runtime + self.transient


def _block_bytes(kind: str, scales: str, numel: int) -> int:
    blocks = numel // BLOCK
    code_bytes = numel // 2 if kind == "q4" else numel
    if scales == "k":  # Q4_K's own 16 bytes per 8 blocks
        return code_bytes + blocks * 2
    if scales == "q6":  # Q6_K's six-bit codes (24 bytes per block) and its own 20 bytes of scales per 8 blocks
        return blocks * 24 + blocks // 8 * 20
    scale_bytes = 2 * blocks * (2 if kind == "q4" else 1)  # float16 per block (and q4's mins)
    return code_bytes + scale_bytes


def _quantized_bytes(file_type: str, numel: int, head: bool) -> int:
    """A 2-D tensor's bytes in the quantized mode, by the rule of model/block_load.py."""
    try:
        kind = kernel_kind(gguf.GGMLQuantizationType[file_type])
    except KeyError:  # a torch dtype name (safetensors) or an unknown type: converted from floats
        kind = None
    if kind == "q4":
        return _block_bytes("q4", "k" if file_type == "Q4_K" else "f16", numel)
    if kind == "q8":
        return _block_bytes("q8", "q6" if file_type == "Q6_K" else "f16", numel)
    float_file = file_type in ("F32", "F16", "BF16", "F64", "float32", "float16", "bfloat16", "float64")
    return _block_bytes("q4" if float_file and not head else "q8", "f16", numel)


def estimate_memory(weights: Mapping[str, torch.Tensor], config: ModelArchConfig, dtype: torch.dtype,
                    quantized: bool, max_num_seqs: int, max_model_len: int) -> MemoryEstimate:
    """What loading `weights` and serving max_num_seqs x max_model_len tokens will hold, from headers only."""
    item = torch.tensor([], dtype=dtype).element_size()
    total, largest = 0, 0
    for name in weights:
        shape = shape_of(weights, name)
        numel = prod(shape)
        largest = max(largest, numel)
        projection = len(shape) == 2 and shape[1] % BLOCK == 0 and name != "model.embed_tokens.weight"
        if quantized and projection:
            total += _quantized_bytes(file_type_of(weights, name), numel, head=name == "lm_head.weight")
        else:
            total += numel * item
        if quantized and config.tie_word_embeddings and name == "model.embed_tokens.weight" and shape[1] % BLOCK == 0:
            total += _quantized_bytes(file_type_of(weights, name), numel, head=True)  # the tied head's blocks
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * item * max_num_seqs * max_model_len
    return MemoryEstimate(total, kv, RUNTIME_BYTES, 4 * largest)


def available_memory() -> int | None:
    """Bytes this process can still get: MemAvailable, bounded by the cgroup's limit where one is set."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            candidates.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(candidates) if candidates else None


def check_fits(estimate: MemoryEstimate, available: int | None, source: str) -> None:
    """Raise ModelLoadError, with the numbers and the flags that change them, when the estimate exceeds `available`."""
    if available is None or estimate.total <= available:
        return
    raise ModelLoadError(
        f"model: {source} needs about {estimate.total / GIB:.1f} GiB (weights {estimate.weights / GIB:.1f}, "
        f"KV cache {estimate.kv_cache / GIB:.1f} for max_num_seqs x max_model_len tokens, runtime "
        f"{estimate.runtime / GIB:.1f}, {estimate.transient / GIB:.1f} while loading) but {available / GIB:.1f} GiB "
        "is available: lower --max-num-seqs or --max-model-len, use a smaller --dtype (int4) or a smaller file"
    )
