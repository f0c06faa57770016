"""A checkpoint's tensors under Hugging Face names, read one at a time.

`LazyWeights` is a read-only Mapping: `weights[name]` reads that tensor from the checkpoint and returns it as a
fresh float tensor in `dtype`, so a loader that takes one tensor at a time never holds the whole model in float.
`blocks(name)` gives a tensor in the native kernels' block format with the file's own values where the file stores
one the kernels run (GGUF Q4_0, Q4_1, Q4_K, Q8_0, Q6_K), None otherwise. A plain dict of tensors (tests) is
accepted wherever LazyWeights is: `block_weight_of` and `shape_of` treat it as a checkpoint with no blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specd.model.gguf_blocks import KernelWeight


class LazyWeights(Mapping[str, torch.Tensor], ABC):
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape (torch order), without reading it."""

    @abstractmethod
    def file_type(self, name: str) -> str:
        """How the file stores it: a ggml type name (Q4_K, F16, ...) or a torch dtype name (bfloat16, ...)."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The tensor's values as floats (any float dtype), a fresh tensor."""

    def blocks(self, name: str) -> KernelWeight | None:
        """The tensor as the native kernels' weight with the file's values, or None (no such format in the file)."""
        return None

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """The tensor's values into `out` (its shape, any float dtype), without a float32 copy of the whole tensor
        where the format allows (a large vocabulary's embedding table is a load's largest transient)."""
        out.copy_(self.read(name))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name).to(self.dtype)


def block_weight_of(weights: Mapping[str, torch.Tensor], name: str) -> KernelWeight | None:
    return weights.blocks(name) if isinstance(weights, LazyWeights) else None


def shape_of(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    return weights.shape(name) if isinstance(weights, LazyWeights) else tuple(weights[name].shape)


def file_type_of(weights: Mapping[str, torch.Tensor], name: str) -> str:
    if isinstance(weights, LazyWeights):
        return weights.file_type(name)
    return str(weights[name].dtype).removeprefix("torch.")
