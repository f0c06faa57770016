"""Cost of SpecStatsRecorder.record_step at batch 32, k = 8, with each sink and with all of them.

Run: .venv/bin/python bench/stats_overhead.py [--steps N] [--batch B] [--k K] [--dtype int4]
Prints CPU µs per record_step (median of repeats) and, side by side, the CPU time of the target forward such a
step verifies on the default model (batch sequences x (k + 1) tokens at 256 tokens of context, one thread), so
each cost is also shown as a share of the step (--no-model skips that). Both are CPU time on one thread
(time.process_time), so the share is a ratio of work, not of wall time on a loaded machine.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from specd.metrics.log_sink import PeriodicLogger
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.records import K0Cause
from specd.metrics.stats import SpecStatsRecorder, StatsSink, StepPhaseTimes
from specd.metrics.trace import TraceSink


def make_steps(num_steps: int, batch: int, k_max: int, seed: int = 0) -> list[torch.Tensor]:
    """Random [3, batch] count tensors: k_i in [0, k_max], a_i <= k_i, e_i = a_i + 1."""
    rng = random.Random(seed)
    steps = []
    for _ in range(num_steps):
        num_draft = [rng.randint(0, k_max) for _ in range(batch)]
        num_accepted = [rng.randint(0, k) for k in num_draft]
        steps.append(torch.tensor([num_draft, num_accepted, [a + 1 for a in num_accepted]], dtype=torch.int64))
    return steps


class StepClock:
    """A fake clock the bench moves by one step at a time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def time_config(
    make_sinks: Callable[[Path], list[StatsSink]],
    steps: list[torch.Tensor],
    k_max: int,
    tmp: Path,
    detail: str | None,
    periodic_log: bool,
    repeats: int,
) -> float:
    """Median over repeats of the mean µs per step (record_step + the log line, finishing requests periodically).

    The log line runs on its own timer thread in the engine; here its tick() runs inline on a fake 30 ms-step
    clock, so its cost (one interval taken and formatted every ~33 steps) is counted in the step's."""
    batch = steps[0].shape[1]
    results = []
    for _ in range(repeats):
        sinks = make_sinks(tmp)
        recorder = SpecStatsRecorder(k_max, sinks=sinks)
        clock = StepClock()
        logger = PeriodicLogger(recorder, interval_s=1.0, logger=logging.getLogger("bench"), clock=clock)
        times = StepPhaseTimes(0.002, 0.030, 0.001)
        request_ids = [f"req-{i}" for i in range(batch)]
        next_id = batch
        # What the engine hands over besides the counts: proposed tokens (one more than verified, the policy's
        # cut, where k_max allows), a k = 0 cause for every sequence, and a draft model's work (k_max batched
        # passes, one position more per sequence than it proposed: a confidence stop's drop).
        proposed = [[min(k + 1, k_max) for k in counts[0].tolist()] for counts in steps]
        computed = [sum(p) + batch for p in proposed]
        causes: list[K0Cause] = ["no_match"] * batch
        start = time.process_time()
        for index, counts in enumerate(steps):
            recorder.record_step(request_ids, counts, times, set(request_ids) if detail else frozenset(),
                                 num_proposed=proposed[index], k0_causes=causes, num_draft_forwards=k_max,
                                 num_computed_draft_tokens=computed[index])
            if periodic_log:
                clock.now = index * 0.03  # a 30 ms step: one log line every ~33 steps
                logger.tick()
            if index % 64 == 63:  # requests of ~64 steps: finish one slot's request, start a new one
                slot = (index // 64) % batch
                recorder.finish_request(request_ids[slot])
                request_ids[slot] = f"req-{next_id}"
                next_id += 1
        results.append((time.process_time() - start) / len(steps) * 1e6)
        for sink in sinks:
            if isinstance(sink, TraceSink):
                sink.close()
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="int4", choices=["float32", "bfloat16", "int4"],
                        help="the target's mode (default int4, the engine's default and fastest: the smallest step)")
    parser.add_argument("--no-model", action="store_true", help="skip timing the default model's forward")
    args = parser.parse_args()
    step_ms = None if args.no_model else target_step_ms(args.batch, args.k, args.dtype)
    steps = make_steps(args.steps, args.batch, args.k)
    logging.getLogger("bench").setLevel(logging.WARNING)  # format the line, don't print it

    def prometheus(_: Path) -> list[StatsSink]:
        return [PrometheusSink(CollectorRegistry(), model="m", proposer="ngram", k_policy="goodput", vllm_compat=True)]

    def trace(tmp: Path) -> list[StatsSink]:
        return [TraceSink(tmp / "trace.jsonl")]

    configs: list[tuple[str, Callable[[Path], list[StatsSink]], str | None, bool]] = [
        ("recorder only", lambda _: [], None, False),
        ("+ periodic log line", lambda _: [], None, True),
        ("+ prometheus sink", prometheus, None, False),
        ("+ trace sink (JSONL)", trace, None, False),
        ("all sinks + log line", lambda tmp: prometheus(tmp) + trace(tmp), None, True),
        ("all sinks + log + step detail for all", lambda tmp: prometheus(tmp) + trace(tmp), "all", True),
    ]
    print(f"record_step CPU cost, batch={args.batch}, k={args.k}, {args.steps} steps x {args.repeats} repeats")
    if step_ms is not None:
        print(f"target forward of the step ({args.dtype}, {args.batch} x {args.k + 1} tokens, 1 thread): "
              f"{step_ms:.1f} CPU ms")
    print(f"{'configuration':<40} {'CPU µs/step':>11} {'% of step':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, make_sinks, detail, periodic_log in configs:
            micros = time_config(make_sinks, steps, args.k, Path(tmp), detail, periodic_log, args.repeats)
            share = "" if step_ms is None else f"{100 * micros / 1000 / step_ms:>9.3f}%"
            print(f"{name:<40} {micros:>11.1f} {share:>10}")


def target_step_ms(batch: int, k: int, dtype: str, context: int = 256, repeats: int = 5) -> float:
    """Median CPU time (one thread) of one verification forward of `batch` sequences x (k + 1) new tokens on the
    default model."""
    from specd.config import EngineConfig
    from specd.model.attention import ForwardBatch
    from specd.model.llama import build_model
    from specd.model.loader import load_checkpoint

    config = EngineConfig(dtype=dtype, max_num_seqs=batch, max_model_len=context + k + 1)
    ckpt = load_checkpoint("default", torch.float32 if config.int4_weights else config.torch_dtype)
    model = build_model(ckpt.config, ckpt.state_dict, config.torch_dtype, int4=config.int4_weights)
    cache = model.make_cache(batch, context + k + 1)
    cache.reserve(context + k + 1)
    slots = [cache.allocate() for _ in range(batch)]
    for slot in slots:
        cache.set_len(slot, context)
    step = ForwardBatch.build([[7] * (k + 1)] * batch, slots, [context] * batch, [list(range(k + 1))] * batch)
    torch.set_num_threads(1)  # CPU time of one thread, comparable with the recorder's
    model(step, cache)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        model(step, cache)
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    main()
