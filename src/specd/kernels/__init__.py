"""Native CPU kernels (a C++ torch extension), built on first use and cached; the torch path when unavailable.

`native()` compiles `quant_gemm.cpp` with torch.utils.cpp_extension (ninja and the system C++ compiler) into
torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), once per machine and
source version; later processes load the cached library in milliseconds. The instruction set is chosen at
build time from /proc/cpuinfo (`cpu_isa`): AVX2 + FMA + F16C intrinsics where all three are listed, with VNNI's
`dpbusd` for the integer dots where the CPU also has AVX-VNNI ("avxvnni") or AVX512-VNNI with AVX512VL
("avx512vnni"), and 4-column tiles with two columns per 512-bit vector where it has AVX-512 F, BW, VL, DQ and VNNI
("avx512": half the instructions per output, 6-28 % less time per GEMM at 4-16 rows on the default model; tiles
of 1-2 rows stay 256-bit); the scalar C++ loops otherwise. Each under its own extension name, so builds never
overwrite each other. All of them give the same bits: the integer dots are exact whichever instructions add them
up. Every build is compiled with OpenMP, so the kernels' column tiles run on torch's intra-op threads (without
-fopenmp, ATen's header-only `parallel_for` runs serially: the GEMMs would use one core of two, and an int4 decode
step was measured ~1.5x slower for it).

The kernels are ON by default wherever they build: SPECD_NATIVE_KERNELS=0 opts out (the model then keeps torch's
int4/int8 kernels), =scalar builds and uses the scalar loops even on an AVX2 CPU, =avx2 the AVX2 kernels without
VNNI or AVX-512 even where the CPU has them. A failed build warns once and
returns None: callers fall back to the torch path. (Greedy speculation token-identical to plain decoding with them on
depends on attention as much as on them: torch's bmm rounds a verified row differently from the same row decoded
alone, see model/attention.py.)
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

ENV_VAR = "SPECD_NATIVE_KERNELS"
_HERE = Path(__file__).parent
# The GEMMs and the GGUF repacking into their layout, one extension; the headers they share.
_SOURCES = (_HERE / "quant_gemm.cpp", _HERE / "gguf_repack.cpp")
_HEADERS = (_HERE / "group_order.h", _HERE / "gguf_repack.h")
_AVX2_FLAGS = ("avx2", "fma", "f16c")
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")  # the "avx512" build's, with AVX2's
# The builds, best first where the CPU has them, and their compiler flags.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
    "avxvnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    "avx512vnni": ("-mavx2", "-mfma", "-mf16c", "-mavx512vnni", "-mavx512vl"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "scalar": ("-DSPECD_SCALAR",),
}


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux: /proc/cpuinfo; elsewhere: none known)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_avx2() -> bool:
    """Whether this CPU has AVX2, FMA and F16C."""
    return all(flag in _cpu_flags() for flag in _AVX2_FLAGS)


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles with bfloat16 dot products (oneDNN runs bfloat16 GEMMs on them)."""
    return {"amx_bf16", "amx_tile"} <= _cpu_flags()


def cpu_isa() -> str:
    """The best build of ISA_FLAGS this CPU runs: "avx512", "avxvnni", "avx512vnni", "avx2" or "scalar"."""
    flags = _cpu_flags()
    if not all(flag in flags for flag in _AVX2_FLAGS):
        return "scalar"
    if set(_AVX512_FLAGS) <= flags:
        return "avx512"
    if "avx_vnni" in flags:
        return "avxvnni"
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "avx512vnni"
    return "avx2"


def build(isa: str) -> ModuleType:
    """Compile (or load from torch's cache) the extension for `isa` (a key of ISA_FLAGS). Raises on failure."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa: {isa!r} is not one of {', '.join(ISA_FLAGS)}")
    # -fopenmp: ATen's parallel_for (a header template) splits the columns over threads only when compiled with it
    return load_extension(f"specd_quant_gemm_{isa}", _SOURCES, ["-O3", "-fopenmp", *ISA_FLAGS[isa]], ["-fopenmp"],
                          headers=_HEADERS)


def build_directory(name: str) -> Path:
    """Where torch.utils.cpp_extension builds and caches extension `name` (TORCH_EXTENSIONS_DIR or its default)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def load_extension(name: str, sources: Path | Sequence[Path], cflags: list[str], ldflags: Sequence[str] = (),
                   headers: Sequence[Path] = ()) -> ModuleType:
    """cpp_extension.load under a lock the kernel releases when its holder dies.

    torch rebuilds a cached extension when its sources or flags change, not its headers: a digest of `headers` goes
    into the flags (a -D define), so a change to a header rebuilds too.

    torch's own build lock is a `lock` file in the build directory, removed by the process that made it: a build
    killed mid-way (a stopped test run, an OOM kill) leaves it behind, and every later process waits on it forever,
    so specd would hang at start-up. Here each specd process first takes an flock on a file of its own; the kernel
    drops it when the holder exits in any way. Holding it, no other specd build can be running, so a `lock` file
    found then was left by a dead build and is removed before torch looks at it.
    """
    import fcntl

    from torch.utils import cpp_extension

    source_list = [sources] if isinstance(sources, Path) else list(sources)
    if headers:
        digest = hashlib.sha256(b"".join(header.read_bytes() for header in headers)).hexdigest()[:16]
        cflags = [*cflags, f"-DSPECD_HEADERS_DIGEST={digest}"]
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "specd-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds; never for a dead one
        (directory / "lock").unlink(missing_ok=True)
        return cpp_extension.load(name=name, sources=[str(source) for source in source_list], extra_cflags=cflags,
                                  extra_ldflags=list(ldflags), verbose=False)


@functools.cache
def native() -> ModuleType | None:
    """The kernels module for this CPU, or None (SPECD_NATIVE_KERNELS=0, or the build failed)."""
    return build_or_fall_back(build, "native CPU kernels", "torch's slower int4/int8 kernels")


def build_or_fall_back(build_isa: Callable[[str], ModuleType], what: str, fallback: str) -> ModuleType | None:
    """`build_isa` for this CPU as SPECD_NATIVE_KERNELS says, or None: off, or the build failed (warned once by the
    caller's cache), so the caller runs `fallback`."""
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return None
    if setting not in ("", "1", "on", "scalar", "avx2"):
        warnings.warn(f"{ENV_VAR}={setting!r} is not 0, 1, avx2 or scalar; {what} off", stacklevel=3)
        return None
    best = cpu_isa()
    isa = "scalar" if setting == "scalar" or best == "scalar" else "avx2" if setting == "avx2" else best
    try:
        return build_isa(isa)
    except Exception as exc:  # a missing compiler, ninja or header: the torch path still works
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"specd's {what} could not be built ({first_line}); using {fallback}. "
                      f"Install a C++ compiler and `pip install ninja`, or set {ENV_VAR}=0 to silence this.",
                      RuntimeWarning, stacklevel=3)
        return None
