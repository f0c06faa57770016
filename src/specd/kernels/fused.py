"""Fused per-layer ops for bfloat16 decoder layers (`fused_ops.cpp`), built on first use; torch's ops otherwise.

`fused_ops()` compiles `fused_ops.cpp` with torch.utils.cpp_extension into torch's extension cache (once per
machine and source version; later processes load the cached library in milliseconds), AVX2 + FMA intrinsics
where /proc/cpuinfo lists them, scalar loops otherwise. Unlike the quantised GEMM kernels (`specd.kernels`), the
fused ops are ON by default: SPECD_NATIVE_KERNELS=0 (or off/false/no) turns every native path off, =scalar
builds the scalar loops even on an AVX2 CPU. A failed build warns once and returns None: the decoder layer then
runs torch's composite ops, which compute the same values up to float32 summation order.

`for_dtype(dtype)` is what the model asks: the module for bfloat16 activations, None for float32/float64 (the
exact modes keep torch's ops, whose rounding the transformers parity tests pin down).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

from specd.kernels import ENV_VAR, cpu_has_avx2, load_extension

_SOURCE = Path(__file__).with_name("fused_ops.cpp")
_OFF = ("0", "off", "false", "no")


def build(isa: str) -> ModuleType:
    """Compile (or load from torch's cache) the fused ops for `isa` ("avx2" or "scalar"). Raises on failure."""
    if isa not in ("avx2", "scalar"):
        raise ValueError(f"isa: {isa!r} is not 'avx2' or 'scalar'")

    # -ffp-contract=off: the scalar arithmetic rounds where the source says, as torch's composite does.
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]
    flags += ["-mavx2", "-mfma"] if isa == "avx2" else ["-DSPECD_SCALAR"]
    return load_extension(f"specd_fused_ops_{isa}", _SOURCE, flags, ["-fopenmp"])


@functools.cache
def fused_ops() -> ModuleType | None:
    """The fused ops for this CPU, or None (SPECD_NATIVE_KERNELS=0, or the build failed)."""
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in _OFF:
        return None
    if setting not in ("", "1", "on", "scalar"):
        warnings.warn(f"{ENV_VAR}={setting!r} is not 0, 1 or scalar; fused ops off", stacklevel=2)
        return None
    isa = "scalar" if setting == "scalar" or not cpu_has_avx2() else "avx2"
    try:
        return build(isa)
    except Exception as exc:  # a missing compiler, ninja or header: torch's ops still work
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"specd's fused CPU ops could not be built ({first_line}); using torch's composite ops. "
                      f"Install a C++ compiler and `pip install ninja`, or set {ENV_VAR}=0 to silence this.",
                      RuntimeWarning, stacklevel=2)
        return None


def for_dtype(dtype: torch.dtype) -> ModuleType | None:
    """The fused ops when activations are `dtype` and they are available: bfloat16 only."""
    return fused_ops() if dtype == torch.bfloat16 else None
