"""A busy neighbour: specd's time to first token and decode speed on a quiet machine and with other processes
keeping cores busy, side by side in one run.

    .venv/bin/python bench/noisy.py [--settings adaptive fixed fixed1 llama.cpp] [--hogs 1] [--rounds 3]
        [--max-tokens 128] [--json OUT]
    .venv/bin/python bench/noisy.py --serve [--rounds 3]      # specd serve, 1 replica vs --replicas 2

A hog is a separate Python process spinning on the CPU (`--hogs N` of them, unpinned, as a neighbour is).
Each setting is a worker process of bench/decode.py, loaded once and kept (the engine; the default model, int4):

- adaptive: `--thread-policy adaptive`, the default (threads follow the cores other processes leave free);
- fixed: `--thread-policy fixed`, every available core always (OpenMP's and torch's own default);
- fixed1: `--thread-policy fixed --threads 1`;
- llama.cpp: llama-cpp-python on the same GGUF with every core (skipped when it is not installed).

Per round, the quiet and the hog conditions alternate in order, and the settings rotate within each. Under a
hog every setting first generates 64 unmeasured tokens (about half a second), as a server that was already
running when the neighbour started would have: the adaptive policy counts free cores over half-second windows.
Measured: TTFT of a 372-token chat prompt (a long system prompt and a question: prefill plus one token) and
decode tok/s of `--max-tokens` tokens after a short prompt's first token, medians over rounds with the range;
"x quiet" is the hog figure over the same setting's quiet one (TTFT: slower is > 1; decode: slower is < 1).

--serve starts `specd serve` (one process, 2 threads at most) and `specd serve --replicas 2` (Ray Serve, one
thread each) and measures, quiet and with the hogs: one streamed request's TTFT on the long prompt and its
decode tok/s (1 / TPOT), and the output tok/s of 2 clients in a closed loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_gguf, markdown_table
from decode import RunTiming, Worker, spread, without_missing_llama_cpp

# (engine, threads, thread policy) of each setting
SETTINGS: dict[str, tuple[str, int | None, str]] = {
    "adaptive": ("specd:default", None, "adaptive"),
    "fixed": ("specd:default", None, "fixed"),
    "fixed1": ("specd:default", 1, "fixed"),
    "llama.cpp": ("llama.cpp", None, "fixed"),
}
CONDITIONS = ("quiet", "hog")
WARMUP_TOKENS = 64
SYSTEM_PROMPT = " ".join(
    ["The assistant answers questions about the weather, cooking, travel and history with care."] * 22
)
LONG_MESSAGES = (
    {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What should I cook tonight?"},
)
SHORT_MESSAGES = ({"role": "user", "content": "Write a short story about a lighthouse keeper."},)


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.3)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def chat_ids(messages: Sequence[dict[str, str]]) -> list[int]:
    from specd.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_gguf()).encode_chat(messages)


def bench_engines(args: argparse.Namespace) -> dict[tuple[str, str], list[tuple[RunTiming, RunTiming]]]:
    """(setting, condition) -> per round (TTFT run on the long prompt, decode run on the short one)."""
    long_ids, short_ids = chat_ids(LONG_MESSAGES), chat_ids(SHORT_MESSAGES)
    print(f"[noisy] long prompt: {len(long_ids)} tokens, short: {len(short_ids)}", file=sys.stderr)
    workers = {name: Worker(*SETTINGS[name]) for name in args.settings}
    runs: dict[tuple[str, str], list[tuple[RunTiming, RunTiming]]] = {}
    try:
        for round_index in range(args.rounds):
            conditions = CONDITIONS if round_index % 2 == 0 else CONDITIONS[::-1]
            for condition in conditions:
                with hogs(args.hogs if condition == "hog" else 0):
                    shift = round_index % len(workers)
                    names = list(workers)[shift:] + list(workers)[:shift]
                    for name in names:
                        worker = workers[name]
                        if condition == "hog":
                            worker.run([short_ids], WARMUP_TOKENS)
                        ttft = worker.run([long_ids], 1)
                        decode = worker.run([short_ids], args.max_tokens)
                        runs.setdefault((name, condition), []).append((ttft, decode))
                        print(f"round {round_index} {condition} {name}: TTFT {ttft.ttft_s * 1e3:.0f} ms, decode "
                              f"{decode.decode_rate:.1f} tok/s", file=sys.stderr)
    finally:
        for worker in workers.values():
            worker.close()
    return runs


def engine_table(runs: dict[tuple[str, str], list[tuple[RunTiming, RunTiming]]], settings: Sequence[str]) -> str:
    rows = []
    for name in settings:
        quiet, hog = runs[(name, "quiet")], runs[(name, "hog")]
        ttft_q, ttft_h = [t.ttft_s * 1e3 for t, _ in quiet], [t.ttft_s * 1e3 for t, _ in hog]
        dec_q, dec_h = [d.decode_rate for _, d in quiet], [d.decode_rate for _, d in hog]
        rows.append([
            name, spread(ttft_q, 0), spread(ttft_h, 0), f"{statistics.median(ttft_h) / statistics.median(ttft_q):.2f}",
            spread(dec_q), spread(dec_h), f"{statistics.median(dec_h) / statistics.median(dec_q):.2f}",
        ])
    return markdown_table(["setting", "TTFT ms quiet", "TTFT ms hog", "x quiet", "decode tok/s quiet",
                           "decode tok/s hog", "x quiet"], rows)


# ---------------------------------------------------------------- specd serve, 1 replica vs 2
SERVERS = {"1 process": [], "2 replicas": ["--replicas", "2"]}


def bench_servers(args: argparse.Namespace) -> dict[tuple[str, str], list[dict[str, float]]]:
    import httpx

    from load import WorkItem, one_request, run_closed_loop
    from serve import served

    server_args = argparse.Namespace(model="default", max_num_seqs=8, server_arg=[], api_key=None,
                                     startup_timeout=600.0)
    long_item = WorkItem("long", LONG_MESSAGES, 1)
    decode_item = WorkItem("short", SHORT_MESSAGES, args.max_tokens)
    loop_items = [WorkItem("short", SHORT_MESSAGES, 64)] * 8
    results: dict[tuple[str, str], list[dict[str, float]]] = {}

    async def measure(url: str, condition: str) -> dict[str, float]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            if condition == "hog":
                await one_request(client, "default", WorkItem("warm", SHORT_MESSAGES, WARMUP_TOKENS), 0.0, True)
            ttft = await one_request(client, "default", long_item, 0.0, True)
            decode = await one_request(client, "default", decode_item, 0.0, True)
            loop_results, seconds = await run_closed_loop(client, "default", loop_items, 2, 0.0, True)
        if not (ttft.ok and decode.ok and all(r.ok for r in loop_results)) or ttft.ttft_s is None or not decode.tpot_s:
            raise RuntimeError(f"a request failed: {ttft.error or decode.error}")
        return {"ttft_ms": ttft.ttft_s * 1e3, "decode_tok_s": 1 / decode.tpot_s,
                "loop2_tok_s": sum(r.completion_tokens for r in loop_results) / seconds}

    for name, extra in SERVERS.items():  # one server at a time: two would share the cores they are measured on
        server_args.server_arg = [*extra, "--spec", "off"]
        with served("off", server_args) as url:
            asyncio.run(measure(url, "hog"))  # warm-up, unmeasured
            for round_index in range(args.rounds):
                conditions = CONDITIONS if round_index % 2 == 0 else CONDITIONS[::-1]
                for condition in conditions:
                    with hogs(args.hogs if condition == "hog" else 0):
                        figures = asyncio.run(measure(url, condition))
                    results.setdefault((name, condition), []).append(figures)
                    print(f"round {round_index} {condition} {name}: {figures}", file=sys.stderr)
    return results


def server_table(results: dict[tuple[str, str], list[dict[str, float]]]) -> str:
    rows = []
    for name in SERVERS:
        row: list[Any] = [name]
        for key, digits in (("ttft_ms", 0), ("decode_tok_s", 1), ("loop2_tok_s", 1)):
            quiet = [r[key] for r in results[(name, "quiet")]]
            hog = [r[key] for r in results[(name, "hog")]]
            ratio = statistics.median(hog) / statistics.median(quiet)
            row += [spread(quiet, digits), spread(hog, digits), f"{ratio:.2f}"]
        rows.append(row)
    return markdown_table(["server", "TTFT ms quiet", "hog", "x", "decode tok/s quiet", "hog", "x",
                           "2 clients tok/s quiet", "hog", "x"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--hogs", type=int, default=1, help="busy processes under the hog condition")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serve", action="store_true", help="measure specd serve (1 process vs --replicas 2) instead")
    ap.add_argument("--json", type=Path, help="also write every run here")
    args = ap.parse_args()
    if args.hogs < 1 or args.rounds < 1 or args.max_tokens < 2:
        raise SystemExit("--hogs and --rounds must be >= 1, --max-tokens >= 2")
    if args.serve:
        results = bench_servers(args)
        print(server_table(results))
        if args.json:
            args.json.write_text(json.dumps([{"server": s, "condition": c, "runs": r} for (s, c), r in results.items()],
                                            indent=1))
        return
    settings = without_missing_llama_cpp(args.settings)
    args.settings = settings
    runs = bench_engines(args)
    print(engine_table(runs, settings))
    if args.json:
        args.json.write_text(json.dumps(
            [{"setting": s, "condition": c, "runs": [{"ttft": t._asdict(), "decode": d._asdict()} for t, d in r]}
             for (s, c), r in runs.items()], indent=1))


if __name__ == "__main__":
    main()
