"""specd's native q4/q8 GEMM kernels vs torch's int4/int8 weight-only kernels, per call, on the default
model's matrix shapes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/gemm_calls.py [--rows 1 8 64]

CPU time per call (time.process_time over repeated calls, after warm-up): on a machine that other jobs load
it moves far less than wall time. Random weights (the kernels' cost does not depend on the values);
`GB/s` is the quantized weight bytes read per second of CPU (int4 codes: half a byte per weight).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import specd.kernels as kernels
from common import markdown_table
from specd.kernels.blockquant import quantize_q4, quantize_q8
from specd.model.llama import INT4_GROUP, quantize_int4, quantize_int8

SHAPES = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}


def cpu_ms(call: Callable[[], object], min_seconds: float = 0.3) -> float:
    for _ in range(3):
        call()
    reps, start = 0, time.process_time()
    while time.process_time() - start < min_seconds:
        call()
        reps += 1
    return 1e3 * (time.process_time() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64])
    args = ap.parse_args()
    native = kernels.native()
    if native is None:
        raise SystemExit("specd's native kernels are not available here (see the warning)")
    rows_out: list[list[Any]] = []
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        q4, q8 = quantize_q4(weight), quantize_q8(weight)
        packed, scales_and_zeros = quantize_int4(weight)
        scales_and_zeros = scales_and_zeros.bfloat16()
        i8, s8 = quantize_int8(weight)
        s8 = s8.bfloat16()
        for num_rows in args.rows:
            x = torch.randn(num_rows, in_features).bfloat16()
            t_q4 = cpu_ms(partial(q4.linear, native, x))
            t_int4 = cpu_ms(partial(torch.ops.aten._weight_int4pack_mm_for_cpu, x, packed, INT4_GROUP,
                                    scales_and_zeros))
            t_q8 = cpu_ms(partial(q8.linear, native, x, float_out=True))
            t_int8 = cpu_ms(partial(torch.ops.aten._weight_int8pack_mm, x, i8, s8))
            int4_bytes, int8_bytes = out_features * in_features / 2, out_features * in_features
            rows_out.append([name, num_rows, t_q4, t_int4, t_int4 / t_q4, t_q8, t_int8, t_int8 / t_q8,
                             int4_bytes / t_q4 / 1e6, int8_bytes / t_q8 / 1e6])
    print(markdown_table(
        ["matrix", "rows", "q4 ms", "torch int4 ms", "q4 speed-up", "q8 ms", "torch int8 ms", "q8 speed-up",
         "q4 GB/s", "q8 GB/s"],
        rows_out,
    ))


if __name__ == "__main__":
    main()
