"""Plain decoding end to end: specd vs llama.cpp on the same GGUF, side by side in one run.

    .venv/bin/python bench/decode.py [--engines llama.cpp specd:default specd:float32 specd-torch:default
        transformers:bfloat16]
        [--kinds chat code rewrite docqa long] [--max-tokens 128] [--rounds 3] [--batch8-kind rewrite]
        [--json OUT]

Every engine reads the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) and gets the same prompt token ids:
chat-templated conversations from bench/prompts.py (the template adds the model's default system prompt),
one per kind at batch 1, and eight different prompts of `--batch8-kind` at batch 8; `long` is one question
over all nine documents of the docqa kind (~900 tokens). Greedy, EOS ignored, `--max-tokens` new tokens per
sequence. Each engine runs in its own worker process (no two OpenMP pools share the cores) and stays loaded;
the rounds interleave the engines (the starting engine rotates), and each figure is the median over rounds
with the range beside it.

- TTFT: request start to its first token (prefill plus one sampled token).
- decode tok/s: tokens after the first ones / time after them (for batch 8: after the last sequence's first
  token, all sequences in lockstep).
- e2e tok/s: every generated token / the whole request time.
- CPU ms/token: the worker's CPU time per decode token (batch 8: per 8 tokens' step / 8). On a machine that
  other jobs load, wall times move with the load while this moves far less; with --threads 1 neither engine
  spin-waits, so it is the work each engine does per token.

llama.cpp runs through llama-cpp-python's low-level bindings (`llama_decode` on a batch, greedy argmax over
the logits in numpy), with one sequence per KV stream at batch 8, so both engines pay only their own step.
The llama.cpp rows are skipped, with the install command, when `llama_cpp` is not importable.
`specd-torch:<dtype>` is specd with its native kernels off (SPECD_NATIVE_KERNELS=0 in that worker: torch's
int4/int8 kernels), for before/after rows in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_gguf, markdown_table
from prompts import prompts_of

LLAMA_CPP_INSTALL = (  # the `bench` extra of pyproject.toml; builds llama.cpp from source (minutes)
    'CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" '
    ".venv/bin/pip install 'llama-cpp-python==0.3.36'"
)
KINDS = ("chat", "code", "rewrite", "docqa", "long")
NUM_LONG_DOCUMENTS = 9


class RunTiming(NamedTuple):
    """One generation of a batch, from the moment its requests were handed to the engine."""

    ttft_s: float  # median over sequences of request start -> that sequence's first token
    first_all_s: float  # request start -> the last sequence's first token
    total_s: float  # request start -> last token
    num_tokens: int  # generated tokens, all sequences
    num_decode_tokens: int  # tokens emitted after first_all_s
    decode_cpu_s: float  # the worker's CPU time (all its threads) after first_all_s

    @property
    def decode_cpu_ms_per_token(self) -> float:
        return 1e3 * self.decode_cpu_s / max(self.num_decode_tokens, 1)

    @property
    def decode_rate(self) -> float:
        return self.num_decode_tokens / max(self.total_s - self.first_all_s, 1e-9)

    @property
    def e2e_rate(self) -> float:
        return self.num_tokens / self.total_s


class TokenClock:
    """Emission times of every sequence's tokens, turned into a RunTiming."""

    def __init__(self, num_seqs: int) -> None:
        self.start = time.perf_counter()
        self.first: list[float | None] = [None] * num_seqs
        self.cpu_after_first = 0.0
        self.events: list[tuple[float, int]] = []  # (seconds since start, tokens emitted then)

    def emit(self, seq_index: int, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.perf_counter() - self.start
        if self.first[seq_index] is None:
            self.first[seq_index] = now
            self.cpu_after_first = time.process_time()
        self.events.append((now, num_tokens))

    def result(self) -> RunTiming:
        total = time.perf_counter() - self.start
        firsts = [f for f in self.first if f is not None]
        if len(firsts) != len(self.first):
            raise RuntimeError("a sequence produced no token")
        first_all = max(firsts)
        return RunTiming(
            ttft_s=statistics.median(firsts),
            first_all_s=first_all,
            total_s=total,
            num_tokens=sum(n for _, n in self.events),
            num_decode_tokens=sum(n for t, n in self.events if t > first_all),
            decode_cpu_s=time.process_time() - self.cpu_after_first,
        )


class Runner(Protocol):
    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming: ...


class SpecdRunner:
    def __init__(self, dtype: str, threads: int | None, model: str = "default", thread_policy: str = "adaptive"
                 ) -> None:
        from specd.llm import LLM

        kwargs: dict[str, Any] = {} if dtype == "default" else {"dtype": dtype}
        self.llm = LLM(model, max_num_seqs=8, num_threads=threads, thread_policy=thread_policy, **kwargs)

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        from specd.sampling.params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        clock = TokenClock(len(prompts))
        index = {self.llm.add_request(None, params, list(p)): i for i, p in enumerate(prompts)}
        remaining = len(index)
        while remaining:
            for delta in self.llm.step():
                clock.emit(index[delta.request_id], len(delta.new_token_ids))
                remaining -= delta.finished
        return clock.result()


_QUIET: list[Any] = []  # the ctypes callback must outlive every llama.cpp call


def quiet_llama_cpp() -> None:
    """Route llama.cpp's own log lines (a line per tensor while loading or quantizing) to nowhere."""
    import llama_cpp

    if not _QUIET:
        _QUIET.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
        llama_cpp.llama_log_set(_QUIET[0], None)


class LlamaCppRunner:
    """llama.cpp's own decode loop, driven from Python: one `llama_decode` per step for the whole batch."""

    def __init__(self, threads: int | None, n_ctx_per_seq: int = 2048, max_batch: int = 8,
                 model_path: Path | None = None) -> None:
        import llama_cpp
        import numpy as np

        self.lib, self.np = llama_cpp, np
        quiet_llama_cpp()
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            str(model_path or default_gguf()).encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path or default_gguf()}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = 512
        threads = threads or os.cpu_count() or 1
        self.contexts = {}
        for num_seqs in (1, max_batch):  # batch 1 gets a context of its own, sized like any single-user run
            params = llama_cpp.llama_context_default_params()
            params.n_ctx = n_ctx_per_seq * num_seqs
            params.n_batch = params.n_ubatch = self.n_batch
            params.n_seq_max = num_seqs
            params.n_threads = params.n_threads_batch = threads
            self.contexts[num_seqs] = llama_cpp.llama_init_from_model(self.model, params)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, max_batch)

    def _decode(self, ctx: Any, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if self.lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, ctx: Any, row: int) -> int:
        logits = self.np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
        return int(logits.argmax())

    def all_logits(self, token_ids: Sequence[int]) -> Any:  # [len - 1, vocab] float32 numpy
        """Row i: the logits after tokens 0..i, from one prefill that keeps every row (bench/scale.py)."""
        ctx = self.contexts[1]
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        ids = list(token_ids)[: self.n_batch]
        self._decode(ctx, [(t, j, 0, True) for j, t in enumerate(ids)])
        return self.np.stack([self.np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, j), shape=(self.n_vocab,))
                              for j in range(len(ids) - 1)]).astype(self.np.float32)

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        ctx = self.contexts[1 if len(prompts) == 1 else max(self.contexts)]
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        clock = TokenClock(len(prompts))
        last: list[int] = []
        for seq, prompt in enumerate(prompts):  # prefill one sequence at a time, in n_batch chunks
            for lo in range(0, len(prompt), self.n_batch):
                chunk = prompt[lo : lo + self.n_batch]
                is_last = lo + len(chunk) == len(prompt)
                self._decode(ctx, [(t, lo + j, seq, is_last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
            last.append(self._argmax(ctx, len(chunk) - 1))
            clock.emit(seq, 1)
        for step in range(1, max_tokens):
            self._decode(ctx, [(last[s], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s in range(len(prompts)):
                last[s] = self._argmax(ctx, s)
                clock.emit(s, 1)
        return clock.result()


class TransformersRunner:
    """transformers `generate` on the same GGUF; a streamer timestamps every step."""

    def __init__(self, dtype: str, threads: int | None) -> None:
        import torch

        from common import load_transformers

        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.model, self.tokenizer = load_transformers(getattr(torch, dtype))

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.eos_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])  # left padding
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = TokenClock(len(prompts))

        class Stamp(BaseStreamer):
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # the first call hands over the prompt
                    self.prompt_seen = True
                    return
                for s in range(len(prompts)):
                    clock.emit(s, 1)

            def end(self) -> None:
                pass

        with torch.inference_mode():
            self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens,
                min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, streamer=Stamp(),
            )
        return clock.result()


def make_runner(engine: str, threads: int | None, thread_policy: str = "adaptive") -> Runner:
    name, _, option = engine.partition(":")
    if name in ("specd", "specd-torch"):  # the worker's environment already chose the kernels
        return SpecdRunner(option or "default", threads, thread_policy=thread_policy)
    if name == "llama.cpp":
        return LlamaCppRunner(threads)
    if name == "transformers":
        return TransformersRunner(option or "bfloat16", threads)
    raise SystemExit(
        f"--engines: unknown engine {engine!r} (specd[:dtype], specd-torch[:dtype], llama.cpp, transformers[:dtype])"
    )


def serve_worker(engine: str, threads: int | None, thread_policy: str = "adaptive") -> None:
    """Worker process: load one engine, then answer one JSON request per stdin line on stdout."""
    runner = make_runner(engine, threads, thread_policy)
    runner.run([[1, 2, 3]], 4)  # warm-up: first-call allocations and lazy initialisation
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        timing = runner.run(request["prompts"], request["max_tokens"])
        print(json.dumps(timing._asdict()), flush=True)


class Worker:
    """One engine in its own process (bench/decode.py --worker); `thread_policy` is specd's (llama.cpp ignores it)."""

    def __init__(self, engine: str, threads: int | None, thread_policy: str = "adaptive") -> None:
        self.engine = engine
        thread_args = ["--threads", str(threads)] if threads else []
        thread_args += ["--thread-policy", thread_policy]
        env = os.environ.copy()
        if engine.partition(":")[0] == "specd-torch":
            env["SPECD_NATIVE_KERNELS"] = "0"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", engine, *thread_args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.engine} exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": [list(p) for p in prompts], "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return RunTiming(**self._read())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def without_missing_llama_cpp(names: Sequence[str]) -> list[str]:
    """`names` less "llama.cpp" when llama_cpp is not importable (saying so, with the install command)."""
    names = list(names)
    if "llama.cpp" in names:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print(f"llama.cpp rows skipped: llama_cpp is not installed. Install it with:\n  {LLAMA_CPP_INSTALL}",
                  file=sys.stderr)
            names.remove("llama.cpp")
    return names


def build_cases(kinds: Sequence[str], batch8_kind: str | None) -> list[tuple[str, int, list[list[int]]]]:
    """(kind, batch size, prompt token ids) for every measured case, chat-templated by specd's tokenizer."""
    from specd.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_gguf())
    cases: list[tuple[str, int, list[list[int]]]] = []
    for kind in kinds:
        if kind == "long":
            docqa = [p.messages[0]["content"] for p in prompts_of("docqa")[:NUM_LONG_DOCUMENTS]]
            documents = "\n\n".join(text.split("Document:", 1)[1].split("Question:", 1)[0].strip() for text in docqa)
            question = docqa[-1].split("Question:", 1)[1].strip()
            messages: Sequence[dict[str, str]] = [{"role": "user", "content": (
                "Read the documents and answer the question using their words.\n\n"
                f"Documents:\n{documents}\n\nQuestion: {question}"
            )}]
        else:
            messages = prompts_of(kind)[0].messages
        cases.append((kind, 1, [tokenizer.encode_chat(messages)]))
    if batch8_kind:
        cases.append((batch8_kind, 8, [tokenizer.encode_chat(p.messages) for p in prompts_of(batch8_kind)[:8]]))
    return cases


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=["llama.cpp", "specd:default", "specd:float32"])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--batch8-kind", default="rewrite", help="kind of the batch-8 case ('' to skip it)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="threads of every engine (default: each engine's own choice)")
    ap.add_argument("--thread-policy", default="adaptive", choices=("adaptive", "fixed"),
                    help="specd's --thread-policy (fixed: always --threads, or every CPU)")
    ap.add_argument("--json", type=Path, help="also write every run's timings here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve_worker(args.worker, args.threads, args.thread_policy)
        return
    engines = without_missing_llama_cpp(args.engines)
    cases = build_cases(args.kinds, args.batch8_kind or None)
    workers = [Worker(engine, args.threads, args.thread_policy) for engine in engines]
    timings: dict[tuple[str, int, str], list[RunTiming]] = {}
    try:
        for round_index in range(args.rounds):
            for kind, batch, prompts in cases:
                shift = round_index % len(workers)
                for worker in workers[shift:] + workers[:shift]:
                    timing = worker.run(prompts, args.max_tokens)
                    timings.setdefault((kind, batch, worker.engine), []).append(timing)
                    print(f"round {round_index} {kind} b{batch} {worker.engine}: ttft {timing.ttft_s * 1e3:.0f} ms "
                          f"decode {timing.decode_rate:.1f} tok/s", file=sys.stderr)
    finally:
        for worker in workers:
            worker.close()
    rows = []
    for kind, batch, prompts in cases:
        peer = timings.get((kind, batch, "llama.cpp"))
        for engine in engines:
            runs = timings[(kind, batch, engine)]
            decode = [t.decode_rate for t in runs]
            ratio = "-"
            if peer is not None:
                ratio = f"{statistics.median(decode) / statistics.median([t.decode_rate for t in peer]):.2f}"
            rows.append([kind, max(len(p) for p in prompts), batch, engine,
                         spread([t.ttft_s * 1e3 for t in runs], 0), spread(decode),
                         spread([t.e2e_rate for t in runs]), ratio,
                         spread([t.decode_cpu_ms_per_token for t in runs], 2)])
    print(markdown_table(
        ["prompt", "prompt tokens", "batch", "engine", "TTFT ms", "decode tok/s", "e2e tok/s", "decode vs llama.cpp",
         "CPU ms/token"],
        rows,
    ))
    if args.json:
        args.json.write_text(json.dumps(
            [{"kind": k, "batch": b, "engine": e, "runs": [t._asdict() for t in ts]}
             for (k, b, e), ts in timings.items()],
            indent=1,
        ))


if __name__ == "__main__":
    main()
