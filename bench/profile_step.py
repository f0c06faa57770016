"""Where one plain decode step goes: GEMMs vs attention vs norms vs elementwise ops vs Python, per dtype.

    .venv/bin/python bench/profile_step.py [--dtypes float32 bfloat16 int4] [--batch 1 8] [--context 256] \
        [--steps 40]

Each --batch size: that many sequences, one new token each after a --context-token prompt, the default model.
For each dtype: the median wall and CPU time of a step without the profiler, then --steps steps under
torch.profiler, whose per-op self times are summed by category (a nested op's time counts once, in the op
that spent it). In the bfloat16 modes (int4, bfloat16), when specd's fused layer ops (`specd.kernels.fused`)
are built, each dtype gets several rows from the same process, their timed steps alternating: torch's composite
layer ops ("torch ops", the code before the fused ops), the fused ops called one by one from Python ("fused
ops"), and, where the layers qualify (int4 with the native GEMMs), all decoder layers in one native call
("one-call layers", the default path; its sub-steps are labelled from C++, so they land in the same categories):

- GEMM: the projections (specd's native q4 kernel, torch's int4 weight-only kernel, oneDNN and plain
  matmuls; the native calls are not torch ops, so the profiled steps wrap them in
  `record_function("specd::q4_linear")` / `"specd::q8_linear"`), and the LM head in float modes;
- LM head: the int4 mode's int8 LM head (specd's q8 kernel or torch's int8 weight-only kernel), 20% of the
  weights; the native GEMM calls include quantising their activation rows;
- attention: query x keys, softmax, probabilities x values (specd's fused decode attention included);
- norm: RMSNorm kernels and the ops of its composite path (specd's fused add + norm included);
- rope+KV: the rotary ops and the KV-cache write (specd's fused rotary + write included);
- elementwise/copies: SiLU x up, residual adds, casts, copies, embedding lookup, and the one-call layers' own
  time outside their labelled sub-steps (allocations, views);
- views: view/slice/select/reshape-style ops, which move no data: their time is dispatch;
- Python/gaps: the profiled step time not inside any op -- interpreter time between ops.

The profiler adds ~1-2 us per op, so the shares are of the profiled step; small ops look a little dearer
than they are. `ops/step` counts top-level operator calls: each one pays the dispatch cost. `CPU ms` is the
process CPU time of a step: on a machine other jobs share it moves far less than wall time, so with
OMP_NUM_THREADS=1 it is the figure to compare two versions of the code by (with more threads it includes
OpenMP's spin-waiting). The int4 rows say which GEMM kernels ran ("native" with SPECD_NATIVE_KERNELS=1, else
"torch"; SPECD_NATIVE_KERNELS=0 also leaves the fused ops unbuilt, so only the torch-ops row). --fused-only keeps
only the model's default path (one-call layers where they qualify, else the fused ops); --variants picks rows.
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
import specd.kernels.fused as fused_kernels
from common import markdown_table
from specd.kernels.blockquant import Q4Weight, Q8Weight
from specd.model.attention import ForwardBatch
from specd.model.kv_cache import KVCache
from specd.model.llama import LlamaForCausalLM

CATEGORIES = ("GEMM", "LM head", "attention", "norm", "rope+KV", "elementwise/copies", "views")
GEMM_OPS = {
    "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm", "mkldnn::_linear_pointwise", "aten::mm",
    "aten::addmm", "aten::linear", "specd::q4_linear",
}
LM_HEAD_OPS = {"aten::_weight_int8pack_mm", "specd::q8_linear"}
ATTENTION_OPS = {
    "aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax", "aten::matmul",
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_safe_softmax",
    "specd::attention",
}
NORM_OPS = {"aten::rms_norm", "aten::_fused_rms_norm", "aten::pow", "aten::mean", "aten::rsqrt", "aten::div_",
            "specd::rms_norm", "specd::add_rms_norm"}
ROPE_KV_OPS = {"aten::roll", "aten::addcmul", "aten::index_put_", "aten::_index_put_impl_", "specd::rope_write_kv"}
VIEW_OPS = {
    "aten::view", "aten::_unsafe_view", "aten::slice", "aten::select", "aten::as_strided", "aten::reshape",
    "aten::expand", "aten::transpose", "aten::unsqueeze", "aten::squeeze", "aten::chunk", "aten::split",
    "aten::t", "aten::detach", "aten::alias", "aten::narrow", "aten::permute", "aten::unbind",
    "aten::split_with_sizes", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::resize_",
}


def category(op_name: str) -> str:
    for name, ops in (("GEMM", GEMM_OPS), ("LM head", LM_HEAD_OPS), ("attention", ATTENTION_OPS), ("norm", NORM_OPS),
                      ("rope+KV", ROPE_KV_OPS), ("views", VIEW_OPS)):
        if op_name in ops:
            return name
    return "elementwise/copies"


FUSED_OPS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_write_kv", "attention", "decoder_layers")
VARIANTS = ("torch ops", "fused ops", "one-call layers")


@contextlib.contextmanager
def native_calls_labelled() -> Iterator[None]:
    """While profiling: the native kernel calls appear as `specd::q4_linear` / `specd::q8_linear` events, the
    fused ops as `specd::rms_norm`, `specd::attention`, ..."""
    originals = Q4Weight.linear, Q8Weight.linear
    fused = fused_kernels.fused_ops()
    fused_originals = {name: getattr(fused, name) for name in FUSED_OPS} if fused is not None else {}

    def labelled(name: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
            with record_function(name):
                return call(*args, **kwargs)
        return wrapper

    Q4Weight.linear = labelled("specd::q4_linear", originals[0])  # type: ignore[method-assign]
    Q8Weight.linear = labelled("specd::q8_linear", originals[1])  # type: ignore[method-assign]
    for name, call in fused_originals.items():
        setattr(fused, name, labelled(f"specd::{name}", call))
    try:
        yield
    finally:
        Q4Weight.linear, Q8Weight.linear = originals  # type: ignore[method-assign]
        for name, call in fused_originals.items():
            setattr(fused, name, call)


def load(dtype_name: str) -> LlamaForCausalLM:
    from specd.config import EngineConfig
    from specd.model.llama import build_model
    from specd.model.loader import load_checkpoint

    config = EngineConfig(dtype=dtype_name)
    checkpoint = load_checkpoint("default", torch.float32 if config.int4_weights else config.torch_dtype)
    return build_model(checkpoint.config, checkpoint.state_dict, config.torch_dtype, max_positions=4096,
                       int4=config.int4_weights)


def decode_step(model: LlamaForCausalLM, cache: KVCache, slots: list[int], position: int) -> None:
    batch = ForwardBatch.build([[1234 + s] for s in slots], slots, [position] * len(slots), [[0]] * len(slots))
    model(batch, cache).argmax(-1).tolist()  # the engine reads the greedy tokens back on the host too


@contextlib.contextmanager
def layer_ops(model: LlamaForCausalLM, variant: str) -> Iterator[None]:
    """The model's decoder layers run `variant` (VARIANTS) in this process: "torch ops" (the code before the fused
    ops), "fused ops" called one by one, or "one-call layers"; the one-call layers are restored afterwards."""
    original = fused_kernels.for_dtype
    if variant == "torch ops":
        fused_kernels.for_dtype = lambda dtype: None  # type: ignore[assignment]
    model.prepare_one_call_layers(variant == "one-call layers")
    try:
        yield
    finally:
        fused_kernels.for_dtype = original  # type: ignore[assignment]
        model.prepare_one_call_layers()


def profile_dtype(dtype_name: str, batch_size: int, context: int, steps: int, fused_only: bool = False,
                  wanted: tuple[str, ...] = VARIANTS) -> list[list[object]]:
    """One row per layer-op variant available here (and in `wanted`): torch's composite ops, then (bfloat16 modes,
    when built) the fused ops one by one and the one-call layers; fused_only: the default path's row alone.
    The variants' timed steps alternate, so a load change on a shared machine hits all alike."""
    model = load(dtype_name)
    cache = model.make_cache(batch_size, context + 16)
    slots = [cache.allocate() for _ in range(batch_size)]
    cache.reserve(context + 16)
    for slot in slots:
        prompt = [(7 * i + 13 * slot) % 40000 + 100 for i in range(context)]
        model(ForwardBatch.build([prompt], [slot], [0], [[context - 1]]), cache)
    position = context
    fused = fused_kernels.for_dtype(model.dtype) is not None
    one_call = fused and model.prepare_one_call_layers() > 0
    available = ["torch ops"] + (["fused ops"] if fused else []) + (["one-call layers"] if one_call else [])
    variants = available[-1:] if fused_only else [v for v in available if v in wanted]
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for step in range(5 + steps):  # every step rewrites the same position: the context length stays fixed
        for variant in variants:
            with layer_ops(model, variant):
                t0, c0 = time.perf_counter(), time.process_time()
                decode_step(model, cache, slots, position)
                if step >= 5:  # the first five are warm-up
                    wall[variant].append(time.perf_counter() - t0)
                    cpu[variant].append(time.process_time() - c0)
    rows: list[list[object]] = []
    for variant in variants:
        with layer_ops(model, variant), native_calls_labelled(), profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                decode_step(model, cache, slots, position)
            profiled = (time.perf_counter() - t0) / steps
        per_category = dict.fromkeys(CATEGORIES, 0.0)
        for event in prof.key_averages():
            if event.key.startswith(("aten::", "mkldnn::", "specd::")):
                per_category[category(event.key)] += event.self_cpu_time_total / 1e6 / steps
        top_level = sum(1 for e in prof.events()
                        if e.cpu_parent is None and e.name.startswith(("aten::", "mkldnn::", "specd::")))
        gaps = max(0.0, profiled - sum(per_category.values()))
        gemms = "native" if kernels.native() else "torch"
        label = f"{dtype_name} ({gemms} GEMMs)" if dtype_name == "int4" else dtype_name
        label += f", {variant}"
        row: list[object] = [label, batch_size, statistics.median(wall[variant]) * 1e3,
                             statistics.median(cpu[variant]) * 1e3, profiled * 1e3]
        row += [f"{per_category[c] * 1e3:.2f} ({100 * per_category[c] / profiled:.0f}%)" for c in CATEGORIES]
        row += [f"{gaps * 1e3:.2f} ({100 * gaps / profiled:.0f}%)", top_level // steps]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int4"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences per step (one table row each)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fused-only", action="store_true",
                    help="only the default path's row (one-call layers where they qualify, else the fused ops)")
    short_names = dict(zip(("torch", "fused", "one-call"), VARIANTS, strict=True))
    ap.add_argument("--variants", nargs="+", choices=short_names,
                    help="the layer-op variants to compare, where available (default: all)")
    args = ap.parse_args()
    if any(b < 1 for b in args.batch):
        ap.error("--batch: every size must be >= 1")
    if args.fused_only and args.variants:
        ap.error("--variants: not with --fused-only, which keeps only the default path's row")
    wanted = tuple(short_names[v] for v in args.variants or short_names)
    rows = [row for d in args.dtypes for b in args.batch
            for row in profile_dtype(d, b, args.context, args.steps, args.fused_only, wanted)]
    print(markdown_table(
        ["dtype", "batch", "step ms", "CPU ms", "profiled ms", *(f"{c} ms" for c in CATEGORIES), "Python/gaps ms",
         "ops/step"],
        rows,
    ))


if __name__ == "__main__":
    main()
