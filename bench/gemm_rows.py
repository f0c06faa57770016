"""specd's q4/q8 kernels per call by row count, against an earlier commit's kernels in the same process.

    .venv/bin/python bench/gemm_rows.py --baseline 1de80ee [--rows 1 2 4 8 16] [--isa avx2] [--clock wall|cpu]
        [--baseline-openmp]

The baseline commit's quant_gemm.cpp is built as its own extension (`specd_quant_gemm_baseline`) and its
blockquant.py lays out the weights it reads (the weight order has changed between versions); both kernels get the
same GGUF-style blocks. Time per call, the two kernels alternating, the minimum over --rounds; each cell is
"baseline / current (current / baseline)", and the row-count columns divide by the one-row time.

--clock wall (the default) times what a caller waits, on torch's threads (OMP_NUM_THREADS=1 for one core);
--clock cpu sums the CPU time of every thread (time.process_time), which on a loaded machine moves less but does
not show a split over threads. The baseline is compiled with the build's ISA flags only, as every revision before commit
16d3033 was (without -fopenmp its at::parallel_for runs serially); --baseline-openmp adds -fopenmp, to compare
the kernels' code alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import specd.kernels as kernels
from common import markdown_table
from specd.kernels.blockquant import Q8Weight, quantize_q4, quantize_q8

SHAPES = {"qkv 960x576 (q4)": (960, 576), "gate_up 3072x576 (q4)": (3072, 576), "down 576x1536 (q4)": (576, 1536),
          "o 576x576 (q4)": (576, 576), "lm_head 49152x576 (q8)": (49152, 576)}


def time_us(call: Callable[[], object], min_seconds: float, clock: Callable[[], float]) -> float:
    for _ in range(2):
        call()
    reps, start = 0, clock()
    while clock() - start < min_seconds:
        call()
        reps += 1
    return 1e6 * (clock() - start) / reps


def baseline_files(revision: str, directory: Path) -> tuple[Path, ModuleType]:
    """The kernel source and the blockquant module of `revision`, written into `directory`."""
    sources = {}
    for name in ("quant_gemm.cpp", "blockquant.py"):
        shown = subprocess.run(["git", "show", f"{revision}:src/specd/kernels/{name}"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent)
        if shown.returncode != 0:
            raise SystemExit(f"--baseline: {revision!r} has no src/specd/kernels/{name} ({shown.stderr.strip()})")
        sources[name] = directory / name
        sources[name].write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("baseline_blockquant", sources["blockquant.py"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sources["quant_gemm.cpp"], module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="the git revision whose kernels to compare with")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.15, help="seconds (of --clock) per measurement")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--baseline-openmp", action="store_true", help="compile the baseline with -fopenmp too")
    ap.add_argument("--isa", choices=list(kernels.ISA_FLAGS), default=None,
                    help="the build to compare, both kernels (default: the best this CPU runs, kernels.cpu_isa())")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows):
        ap.error("--rows: every count must be >= 1")
    isa = args.isa or kernels.cpu_isa()
    current = kernels.build(isa)
    flags = ["-O3", *kernels.ISA_FLAGS[isa]]  # the build's ISA flags (a source without VNNI code ignores them)
    openmp = ["-fopenmp"] if args.baseline_openmp else []
    with tempfile.TemporaryDirectory() as directory:
        source, old_layout = baseline_files(args.baseline, Path(directory))
        baseline = kernels.load_extension("specd_quant_gemm_baseline", source, flags + openmp, openmp)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.manual_seed(0)
    table: list[list[Any]] = []
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        q = quantize_q8(weight) if "q8" in name else quantize_q4(weight)
        old = old_layout.quantize_q8(weight) if "q8" in name else old_layout.quantize_q4(weight)
        row: list[Any] = [name]
        one_row: dict[str, float] = {}
        for num_rows in args.rows:
            x = torch.randn(num_rows, in_features).bfloat16()
            calls: dict[str, Callable[[], torch.Tensor]]
            if isinstance(q, Q8Weight):
                calls = {"baseline": partial(baseline.q8_linear, x, old.codes, old.scales, True),
                         "current": partial(current.q8_linear, x, q.codes, q.scales, True)}
            else:
                calls = {"baseline": partial(baseline.q4_linear, x, old.codes, old.scales, old.mins, True),
                         "current": partial(current.q4_linear, x, q.codes, q.scales, q.mins, True)}
            got, expected = calls["current"](), calls["baseline"]()
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-3 * expected.abs().max().item()):
                raise SystemExit(f"{name}, {num_rows} rows: the two kernels disagree")
            best = {label: min(time_us(call, args.seconds, clock) for _ in range(args.rounds))
                    for label, call in calls.items()}
            for label in best:
                one_row.setdefault(label, best[label])
            row.append(f"{best['baseline']:.0f} / {best['current']:.0f} ({best['current'] / best['baseline']:.2f})")
            row.append(f"{best['baseline'] / one_row['baseline']:.1f}x / {best['current'] / one_row['current']:.1f}x")
        table.append(row)
    headers = ["matrix"]
    for num_rows in args.rows:
        headers += [f"{num_rows} rows us", f"{num_rows} rows / 1 row"]
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
