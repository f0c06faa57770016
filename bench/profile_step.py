"""Where one plain decode step goes: GEMMs vs attention vs norms vs elementwise ops vs Python, per dtype.

    .venv/bin/python bench/profile_step.py [--dtypes float32 bfloat16 int4] [--context 256] [--steps 40]

Batch 1, one new token after a --context-token prompt, the default model. For each dtype: the median wall
time of a step without the profiler, then --steps steps under torch.profiler, whose per-op self times are
summed by category (a nested op's time counts once, in the op that spent it):

- GEMM: the projections and the LM head (specd's native q4/q8 kernels, torch's int4/int8 weight-only
  kernels, oneDNN and plain matmuls; the native calls are not torch ops, so the profiled steps wrap them in
  `record_function("specd::q4_linear")` / `"specd::q8_linear"`);
- attention: query x keys, softmax, probabilities x values, and the KV-cache write;
- norm: RMSNorm kernels and the ops of its composite path;
- elementwise/copies: rotary, SiLU, residual adds, casts, copies, embedding lookup;
- views: view/slice/select/reshape-style ops, which move no data: their time is dispatch;
- Python/gaps: the profiled step time not inside any op -- interpreter time between ops.

The profiler adds ~1-2 us per op, so the shares are of the profiled step; small ops look a little dearer
than they are. `ops/step` counts top-level operator calls: each one pays the dispatch cost. `CPU ms` is the
process CPU time of a step: on a machine other jobs share it moves far less than wall time, so with
OMP_NUM_THREADS=1 it is the figure to compare two versions of the code by (with more threads it includes
OpenMP's spin-waiting). The int4 row says which kernels ran ("int4 (native)" or "int4 (torch)"; run once more
with SPECD_NATIVE_KERNELS=0 for the torch row).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
import specd.kernels as kernels
from common import markdown_table
from specd.kernels.blockquant import Q4Weight, Q8Weight
from specd.model.attention import ForwardBatch
from specd.model.kv_cache import KVCache
from specd.model.llama import LlamaForCausalLM

CATEGORIES = ("GEMM", "attention", "norm", "elementwise/copies", "views")
GEMM_OPS = {
    "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm",
    "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear", "specd::q4_linear", "specd::q8_linear",
}
ATTENTION_OPS = {
    "aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax", "aten::matmul", "aten::index_put_",
    "aten::_index_put_impl_", "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_safe_softmax",
}
NORM_OPS = {"aten::rms_norm", "aten::_fused_rms_norm", "aten::pow", "aten::mean", "aten::rsqrt", "aten::div_"}
VIEW_OPS = {
    "aten::view", "aten::_unsafe_view", "aten::slice", "aten::select", "aten::as_strided", "aten::reshape",
    "aten::expand", "aten::transpose", "aten::unsqueeze", "aten::squeeze", "aten::chunk", "aten::split",
    "aten::t", "aten::detach", "aten::alias", "aten::narrow", "aten::permute", "aten::unbind",
    "aten::split_with_sizes", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::resize_",
}


def category(op_name: str) -> str:
    for name, ops in (("GEMM", GEMM_OPS), ("attention", ATTENTION_OPS), ("norm", NORM_OPS), ("views", VIEW_OPS)):
        if op_name in ops:
            return name
    return "elementwise/copies"


@contextlib.contextmanager
def native_calls_labelled() -> Iterator[None]:
    """While profiling: the native kernel calls appear as `specd::q4_linear` / `specd::q8_linear` events."""
    originals = Q4Weight.linear, Q8Weight.linear

    def labelled(name: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
            with record_function(name):
                return call(*args, **kwargs)
        return wrapper

    Q4Weight.linear = labelled("specd::q4_linear", originals[0])  # type: ignore[method-assign]
    Q8Weight.linear = labelled("specd::q8_linear", originals[1])  # type: ignore[method-assign]
    try:
        yield
    finally:
        Q4Weight.linear, Q8Weight.linear = originals  # type: ignore[method-assign]


def load(dtype_name: str) -> LlamaForCausalLM:
    from specd.config import EngineConfig
    from specd.model.llama import build_model
    from specd.model.loader import load_checkpoint

    config = EngineConfig(dtype=dtype_name)
    checkpoint = load_checkpoint("default", torch.float32 if config.int4_weights else config.torch_dtype)
    return build_model(checkpoint.config, checkpoint.state_dict, config.torch_dtype, max_positions=4096,
                       int4=config.int4_weights)


def decode_step(model: LlamaForCausalLM, cache: KVCache, slot: int, position: int) -> None:
    batch = ForwardBatch.build([[1234]], [slot], [position], [[0]])
    model(batch, cache).argmax(-1).item()  # the engine reads the greedy token back on the host too


def profile_dtype(dtype_name: str, context: int, steps: int) -> list[object]:
    model = load(dtype_name)
    cache = model.make_cache(1, context + 4 * steps + 16)
    slot = cache.allocate()
    cache.reserve(context + 4 * steps + 16)
    prompt = [(7 * i) % 40000 + 100 for i in range(context)]
    model(ForwardBatch.build([prompt], [slot], [0], [[context - 1]]), cache)
    position = context
    for _ in range(5):  # warm-up
        decode_step(model, cache, slot, position)
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(steps):  # every step rewrites the same position: the context length stays fixed
        t0, c0 = time.perf_counter(), time.process_time()
        decode_step(model, cache, slot, position)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    with native_calls_labelled(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            decode_step(model, cache, slot, position)
        profiled = (time.perf_counter() - t0) / steps
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "mkldnn::", "specd::")):
            per_category[category(event.key)] += event.self_cpu_time_total / 1e6 / steps
    top_level = sum(1 for e in prof.events()
                    if e.cpu_parent is None and e.name.startswith(("aten::", "mkldnn::", "specd::")))
    gaps = max(0.0, profiled - sum(per_category.values()))
    label = f"{dtype_name} ({'native' if kernels.native() else 'torch'})" if dtype_name == "int4" else dtype_name
    row: list[object] = [label, statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3, profiled * 1e3]
    row += [f"{per_category[c] * 1e3:.2f} ({100 * per_category[c] / profiled:.0f}%)" for c in CATEGORIES]
    row += [f"{gaps * 1e3:.2f} ({100 * gaps / profiled:.0f}%)", top_level // steps]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int4"])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    rows = [profile_dtype(d, args.context, args.steps) for d in args.dtypes]
    print(markdown_table(
        ["dtype", "step ms", "CPU ms", "profiled ms", *(f"{c} ms" for c in CATEGORIES), "Python/gaps ms", "ops/step"],
        rows,
    ))


if __name__ == "__main__":
    main()
