"""Fused per-layer ops for bfloat16 decoder layers (`fused_ops.cpp`), built on first use; torch's ops otherwise.

`fused_ops()` compiles `fused_ops.cpp` with torch.utils.cpp_extension into torch's extension cache (once per
machine and source version; later processes load the cached library in milliseconds), AVX2 + FMA intrinsics
where /proc/cpuinfo lists them, scalar loops otherwise. Unlike the quantised GEMM kernels (`specd.kernels`), the
fused ops are ON by default: SPECD_NATIVE_KERNELS=0 (or off/false/no) turns every native path off, =scalar
builds the scalar loops even on an AVX2 CPU. A failed build warns once and returns None: the decoder layer then
runs torch's composite ops, which compute the same values up to float32 summation order.

`for_dtype(dtype)` is what the model asks: the module for bfloat16 activations, None for float32/float64 (the
exact modes keep torch's ops, whose rounding the transformers parity tests pin down).

For an int4 model with specd's q4 GEMM (`specd.kernels.native()`), `make_layer_stack` / `decoder_layers` run all
decoder layers in one call (LlamaForCausalLM.prepare_one_call_layers): the same ops and GEMM, the same bits.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from specd.kernels import ISA_FLAGS, build_or_fall_back, load_extension

_SOURCE = Path(__file__).with_name("fused_ops.cpp")


def build(isa: str) -> ModuleType:
    """Compile (or load from torch's cache) the fused ops for `isa` (a key of specd.kernels.ISA_FLAGS; the VNNI
    builds are the AVX2 one here: these ops have no integer dots). Raises on failure."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa: {isa!r} is not one of {', '.join(ISA_FLAGS)}")
    isa = "scalar" if isa == "scalar" else "avx2"

    # -ffp-contract=off: the scalar arithmetic rounds where the source says, as torch's composite does.
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]
    flags += ["-mavx2", "-mfma"] if isa == "avx2" else ["-DSPECD_SCALAR"]
    return load_extension(f"specd_fused_ops_{isa}", _SOURCE, flags, ["-fopenmp"])


@functools.cache
def fused_ops() -> ModuleType | None:
    """The fused ops for this CPU, or None (SPECD_NATIVE_KERNELS=0, or the build failed)."""
    return build_or_fall_back(build, "fused CPU ops", "torch's composite ops")


def for_dtype(dtype: torch.dtype) -> ModuleType | None:
    """The fused ops when activations are `dtype` and they are available: bfloat16 only."""
    return fused_ops() if dtype == torch.bfloat16 else None
