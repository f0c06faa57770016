"""The models users bring: specd vs llama.cpp on the same 1B-8B GGUF files -- load, memory, speed and precision.

    .venv/bin/python bench/scale.py [--sizes 135m 1b 3b 8b] [--types Q4_K_M Q4_0 Q8_0] [--cache out/scale]
        [--rounds 2] [--max-tokens 64] [--prompt-lengths 100 1000] [--kl-sizes 135m 1b] [--kl-positions 96]
        [--json OUT]

`135m` is the default model's own file (SmolLM2-135M-Instruct Q4_1); `1b`, `3b` and `8b` are synthetic
(specd/synthetic.py: Llama-3.2-1B/3B and Llama-3.1-8B shapes, random weights, the default model's tokenizer),
written as F16 and quantized by llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`) into `--types`,
cached in `--cache`. Their text is noise; their speed, memory and engine-vs-engine agreement are real.

Each engine runs in its own worker process (bench/decode.py's runners), loaded once; the rounds interleave them.
Per file and engine:
- load s: the engine's load call, in a fresh process (specd: LLM(...) including its kernels' first use);
- RSS MiB: resident memory after load and one warm-up request, and the KV cache inside it (llama.cpp allocates
  its contexts' whole n_ctx at load: 2,048 tokens for batch 1 plus 8 x 2,048 for batch 8; specd's grows with the
  tokens in flight), so "RSS less KV" compares the engines' weights and runtime; peak: the high-water mark after
  the load;
- TTFT ms at each prompt length (max_tokens 1) and decode tok/s at batch 1 and 8 (greedy, EOS ignored);
- precision (`--kl-sizes`): teacher-forced next-token distributions over `--kl-positions` positions of a natural-text
  prompt, against specd's float32 mode (the file's values dequantized exactly): mean KL(float32 || engine) and top-1
  agreement. llama.cpp is measured the same way, so the two engines' distance to the file is compared directly.

llama-cpp-python is the `bench` extra; the build flags that run on the development VMs are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode
from common import default_gguf, markdown_table
from decode import LLAMA_CPP_INSTALL, LlamaCppRunner, RunTiming, SpecdRunner, quiet_llama_cpp
from prompts import prompts_of

SIZES = ("135m", "1b", "3b", "8b")
TYPES = {"Q4_K_M": 15, "Q4_0": 2, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* values
ENGINES = ("llama.cpp", "specd")


def memory_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


# ---------------------------------------------------------------------------------------------- model files
def model_file(size: str, file_type: str, cache: Path) -> Path:
    """The GGUF of `size` in `file_type`, made (and cached) when missing."""
    if size == "135m":
        return default_gguf()
    import llama_cpp

    from specd.synthetic import SHAPES, write_gguf

    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"llama-{size}-{file_type}.gguf"
    if target.exists():
        return target
    f16 = cache / f"llama-{size}-F16.gguf"
    if not f16.exists():
        print(f"writing {f16} (random weights)", file=sys.stderr)
        write_gguf(f16.with_suffix(".partial"), SHAPES[size]).rename(f16)
    print(f"quantizing {f16.name} -> {target.name} with llama.cpp's quantizer", file=sys.stderr)
    quiet_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = TYPES[file_type], os.cpu_count() or 1
    partial = target.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(partial).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {f16} to {file_type}")
    partial.rename(target)
    return target


def natural_tokens(count: int) -> list[int]:
    """`count` token ids of natural English text (bench/prompts.py's documents, repeated as needed)."""
    from specd.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_gguf())
    text = "\n\n".join(p.messages[0]["content"] for p in prompts_of("docqa"))
    ids = tokenizer.encode(text)
    return (ids * (count // len(ids) + 1))[:count]


# ---------------------------------------------------------------------------------------------- workers
def _teacher_forced_logits(runner: Any, engine: str, token_ids: list[int]) -> np.ndarray:  # [n - 1, vocab] float32
    if engine == "llama.cpp":
        return runner.all_logits(token_ids)
    import torch

    from specd.engine.scoring import prompt_logits

    return prompt_logits(runner.llm.model, token_ids).to(torch.float32).numpy()


def kv_cache_mib(runner: Any, engine: str) -> float:
    """The KV cache the engine holds now: llama.cpp allocates its contexts' whole n_ctx (f16 keys and values) at
    load; specd's cache grows with the tokens in flight."""
    if engine == "llama.cpp":
        lib = runner.lib
        n_layer, n_embd = lib.llama_model_n_layer(runner.model), lib.llama_model_n_embd(runner.model)
        n_head, n_head_kv = lib.llama_model_n_head(runner.model), lib.llama_model_n_head_kv(runner.model)
        per_token = 2 * n_layer * n_head_kv * (n_embd // n_head) * 2
        return sum(lib.llama_n_ctx(ctx) for ctx in runner.contexts.values()) * per_token / 2**20
    return sum(t.numel() * t.element_size() for t in runner.llm.engine.cache.kv) / 2**20


def serve_worker(engine: str, path: Path, dtype: str) -> None:
    """Worker process: load one engine, report load time and memory, then answer JSON requests on stdin."""
    start = time.perf_counter()
    runner: Any = (LlamaCppRunner(None, model_path=path) if engine == "llama.cpp"
                   else SpecdRunner(dtype, None, str(path)))
    load_s = time.perf_counter() - start
    _, load_peak = memory_mib()
    runner.run([[1, 2, 3]], 4)  # warm-up: first-call allocations and lazy initialisation
    rss, peak = memory_mib()
    print(json.dumps({"load_s": load_s, "rss_mib": rss, "peak_mib": peak, "load_peak_mib": load_peak,
                      "kv_mib": kv_cache_mib(runner, engine)}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "logits_of" in request:
            logits = _teacher_forced_logits(runner, engine, request["logits_of"])
            np.save(request["out"], logits)
            print(json.dumps({"saved": request["out"]}), flush=True)
            continue
        timing = runner.run(request["prompts"], request["max_tokens"])
        print(json.dumps(timing._asdict()), flush=True)


class Worker(decode.Worker):
    """bench/decode.py's worker protocol (a JSON line each way) over this file's worker: it reports its load first,
    and answers logits requests beside timing ones."""

    def __init__(self, engine: str, path: Path, dtype: str = "default") -> None:
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", engine, str(path), dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.loaded = self._read()

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def logits(self, token_ids: list[int], out: Path) -> np.ndarray:
        self.request({"logits_of": token_ids, "out": str(out)})
        return np.load(out)


# ---------------------------------------------------------------------------------------------- precision
def divergence(reference: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """(mean KL(reference || other) in nats, top-1 agreement) over rows of logits [positions, vocab]."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        shifted = x - x.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    ref, oth = log_softmax(reference), log_softmax(other)
    kl = (np.exp(ref) * (ref - oth)).sum(axis=1)
    return float(kl.mean()), float((reference.argmax(1) == other.argmax(1)).mean())


def measure_precision(path: Path, token_ids: list[int], engines: Sequence[str]) -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory() as scratch:
        reference_worker = Worker("specd", path, "float32")
        try:
            reference = reference_worker.logits(token_ids, Path(scratch) / "reference.npy")
        finally:
            reference_worker.close()
        out: dict[str, tuple[float, float]] = {}
        for engine in engines:
            worker = Worker(engine, path)
            try:
                out[engine] = divergence(reference, worker.logits(token_ids, Path(scratch) / f"{engine}.npy"))
            finally:
                worker.close()
    return out


# ---------------------------------------------------------------------------------------------- main
def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def measure_file(path: Path, engines: Sequence[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Load, memory and speed of each engine on one file, the engines' runs interleaved round by round."""
    text = natural_tokens(max(args.prompt_lengths) + 8 * 64)
    cases: list[tuple[str, list[list[int]], int]] = [(f"ttft{n}", [text[:n]], 1) for n in args.prompt_lengths]
    cases += [("decode_b1", [text[:100]], args.max_tokens),
              ("decode_b8", [text[64 * i: 64 * i + 100] for i in range(8)], args.max_tokens)]
    results: dict[str, dict[str, Any]] = {}
    workers = []
    for engine in engines:  # each loads alone, so its load time and peak are its own
        worker = Worker(engine, path)
        workers.append(worker)
        results[engine] = {"memory": worker.loaded, "runs": {name: [] for name, _, _ in cases}}
        print(f"{path.name} {engine}: loaded in {worker.loaded['load_s']:.2f} s, "
              f"RSS {worker.loaded['rss_mib']:.0f} MiB (peak {worker.loaded['peak_mib']:.0f})", file=sys.stderr)
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(workers)
            for name, prompts, max_tokens in cases:
                for worker in workers[shift:] + workers[:shift]:
                    timing = worker.run(prompts, max_tokens)
                    results[worker.engine]["runs"][name].append(timing._asdict())
    finally:
        for worker in workers:
            worker.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["135m", "1b"], choices=SIZES)
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--cache", type=Path, default=Path("out/scale"), help="where the synthetic GGUFs are kept")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--kl-sizes", nargs="*", default=["135m", "1b"], choices=SIZES)
    ap.add_argument("--kl-positions", type=int, default=96)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        engine, path, dtype = args.worker
        serve_worker(engine, Path(path), dtype)
        return
    for name in ("rounds", "max_tokens", "kl_positions"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be at least 1")
    if any(n < 2 for n in args.prompt_lengths):
        raise SystemExit("--prompt-lengths: each must be at least 2")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit(f"bench/scale.py needs llama.cpp to quantize its files: {LLAMA_CPP_INSTALL}") from None
    report: list[dict[str, Any]] = []
    for size in args.sizes:
        for file_type in (["Q4_1"] if size == "135m" else args.types):
            path = model_file(size, file_type, args.cache)
            entry: dict[str, Any] = {"size": size, "type": file_type, "file_mib": path.stat().st_size / 2**20,
                                     "engines": measure_file(path, args.engines, args)}
            if size in args.kl_sizes:
                entry["precision"] = measure_precision(path, natural_tokens(args.kl_positions + 1), args.engines)
            report.append(entry)
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))
    print(render(report, args))


def render(report: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = []
    for entry in report:
        for engine, result in entry["engines"].items():
            memory, runs = result["memory"], result["runs"]
            ttft = [spread([r["ttft_s"] * 1e3 for r in runs[f"ttft{n}"]], 0) for n in args.prompt_lengths]
            decode = [spread([RunTiming(**r).decode_rate for r in runs[name]]) for name in ("decode_b1", "decode_b8")]
            kl = entry.get("precision", {}).get(engine)
            rows.append([f"{entry['size']} {entry['type']}", f"{entry['file_mib']:.0f}", engine,
                         f"{memory['load_s']:.2f}", f"{memory['rss_mib']:.0f}", f"{memory['kv_mib']:.0f}",
                         f"{memory['rss_mib'] - memory['kv_mib']:.0f}", f"{memory['load_peak_mib']:.0f}",
                         *ttft, *decode, "-" if kl is None else f"{kl[0]:.4f} / {kl[1]:.3f}"])
    return markdown_table(["model", "file MiB", "engine", "load s", "RSS MiB", "of it KV MiB", "RSS less KV MiB",
                           "peak MiB (load)",
                           *(f"TTFT ms @{n}" for n in args.prompt_lengths), "decode tok/s b1", "decode tok/s b8",
                           "KL / top-1 vs float32"], rows)


if __name__ == "__main__":
    main()
