"""Serving benchmark for `specd serve`: open-loop (Poisson) and closed-loop load, speculation off vs on.

For each setting it starts `specd serve` on 127.0.0.1 (a server per setting, all up at once, so settings share no
warm state), sends `--warmup` requests to each that are not measured, then for each load point sends, to each
server in turn (interleaved, so drift in the machine's load falls on every setting alike), the same mixed
workload (bench/load.py: the four prompt kinds of bench/prompts.py in turn, output lengths 32-256 tokens, seeded)
of `--num-requests` streaming chat requests: at Poisson arrivals of each `--rates` value (open loop; `inf` = all
at once), and from each `--concurrency` number of clients (closed loop). With --url it measures an already
running server instead (loopback only).

`--rounds R` runs each point's requests in R parts (request i in part i % R, so every part keeps the mix), the
settings alternating within every part (A B, then B A, ...): drift in the machine's speed over a point's tens of
seconds then falls on every setting alike. The point pools its parts (throughput = tokens over the summed time,
each part's drain included, the same for every setting), and the relative table adds the per-round ratio to
`off` (median and range): the noise a pooled ratio carries, measured.

Run:   .venv/bin/python bench/serve.py --settings off,goodput --rates 1,2,4,8,inf --concurrency 1,2,4,8,16,32
       [--num-requests 64] [--rounds 8] [--server-arg=--dtype=int4 ...] [--json FILE] [--markdown FILE]
       [--plot FILE.png]
Smoke: .venv/bin/python bench/serve.py --num-requests 4 --warmup 1 --rates inf --concurrency 1

Per point: completed requests, request and output-token throughput over the point's duration (first send to last
byte), TTFT / TPOT / ITL / E2E at p50, p90, p99 in ms, and acceptance and tau pooled over the point's requests.
When `off` is among the settings, a second table gives each setting's output throughput and TPOT p50 relative to
`off` at the same point; add `off-again` (a second server with speculation off) to see how far two identical
settings drift apart in the same run, the noise every other ratio carries. --plot draws throughput and TPOT
against load, one line per setting (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import (
    PointStats,
    RequestResult,
    WorkItem,
    build_workload,
    one_request,
    percentile,
    poisson_arrivals,
    run_closed_loop,
    run_open_loop,
    summarize,
)
from prompts import KINDS

SPEC_ARGS = {
    "off": ["--spec", "off"],
    # A second server with speculation off: its ratio to `off` in the same run is the run's noise (an A/A control).
    "off-again": ["--spec", "off"],
    "ngram": ["--spec", "ngram", "--k-policy", "heuristic"],
    "goodput": ["--spec", "ngram", "--num-spec-tokens", "8", "--k-policy", "goodput"],
    "adaptive": ["--spec", "ngram", "--num-spec-tokens", "8", "--k-policy", "adaptive"],
}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served(spec: str, args: argparse.Namespace) -> Iterator[str]:
    """Start `specd serve` for one setting on a free loopback port; yield its URL; stop it."""
    port = free_port()
    command = [
        sys.executable, "-m", "specd.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model", args.model, "--max-num-seqs",
        str(args.max_num_seqs), "--max-waiting", "0", *SPEC_ARGS[spec], *args.server_arg,
    ]
    env = {**os.environ, "SPECD_API_KEY": args.api_key} if args.api_key else dict(os.environ)
    with tempfile.NamedTemporaryFile("w+", prefix=f"specd-serve-{spec}-", suffix=".log", delete=False) as log:
        print(f"[bench] starting: {' '.join(command)} (log: {log.name})", file=sys.stderr)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, process, args.startup_timeout, Path(log.name))
            yield url
        finally:
            process.terminate()  # SIGTERM: uvicorn shuts down gracefully
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specd serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"specd serve did not become healthy in {timeout_s}s")


def measure(urls: dict[str, str], args: argparse.Namespace) -> list[PointStats]:
    """Warm up every server, then run each load point against every server in turn (setting -> its URL).

    Interleaved: point 1 on every setting, then point 2 on every setting (in reversed order every other point), so
    a change in the machine's load during the run falls on all settings alike instead of on whichever ran last.
    The servers not being measured sit idle.
    """

    async def main() -> list[PointStats]:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        timeout = httpx.Timeout(args.request_timeout, connect=10)
        # Idle pooled connections are dropped after 1 s: the server (uvicorn) closes a kept-alive connection after
        # 5 s idle, httpx's default is to reuse one for 5 s, and a request sent on a connection the server is
        # closing at that instant fails with a ReadError (seen once in 1,280 requests of an int4 grid).
        limits = httpx.Limits(max_connections=args.num_requests + 8, keepalive_expiry=1.0)
        clients = {setting: httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits)
                   for setting, url in urls.items()}
        try:
            models = {}
            for setting, client in clients.items():
                listed = await client.get("/v1/models")
                listed.raise_for_status()
                models[setting] = listed.json()["data"][0]["id"]
                for item in build_workload(args.warmup, args.seed + 1, args.kinds) if args.warmup else []:
                    warm = await one_request(client, models[setting], item, args.temperature, args.ignore_eos)
                    if not warm.ok:
                        raise RuntimeError(f"warm-up request failed ({setting}): {warm.error}")
            items = build_workload(args.num_requests, args.seed, args.kinds)
            loads = [("rate", float(rate)) for rate in args.rates] + [("concurrency", float(c)) for c in
                                                                     args.concurrency]
            points = []
            for number, (mode, load) in enumerate(loads):
                results: dict[str, list[RequestResult]] = {setting: [] for setting in clients}
                seconds: dict[str, list[float]] = {setting: [] for setting in clients}
                rates: dict[str, list[float]] = {setting: [] for setting in clients}
                first = list(clients) if number % 2 == 0 else list(reversed(clients))
                for index, part in enumerate(rounds_of(items, args.rounds)):
                    for setting in first if index % 2 == 0 else reversed(first):
                        client, model = clients[setting], models[setting]
                        if mode == "rate":
                            send_times = poisson_arrivals(len(part), load, args.seed + index)
                            got, took = await run_open_loop(client, model, part, send_times, args.temperature,
                                                            args.ignore_eos)
                        else:
                            got, took = await run_closed_loop(client, model, part, int(load), args.temperature,
                                                              args.ignore_eos)
                        results[setting] += got
                        seconds[setting].append(took)
                        rates[setting].append(sum(r.completion_tokens for r in got if r.ok) / max(took, 1e-9))
                    if args.rounds > 1:
                        done = ", ".join(f"{setting} {rates[setting][-1]:.1f}" for setting in clients)
                        print(f"  {_load_of(mode, load)} round {index + 1}/{args.rounds}: out tok/s {done}",
                              file=sys.stderr, flush=True)
                for setting in first:
                    point = summarize(setting, mode, load, results[setting], sum(seconds[setting]),
                                      rates[setting] if args.rounds > 1 else ())
                    points.append(_report(point, results[setting]))
            return points
        finally:
            for client in clients.values():
                await client.aclose()

    return asyncio.run(main())


def _report(point: PointStats, results: Sequence) -> PointStats:
    for failure in (r for r in results if not r.ok):
        print(f"  request failed: {failure.error}", file=sys.stderr)
    print(format_row(point), flush=True)
    return point


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _load(point: PointStats) -> str:
    return _load_of(point.mode, point.load)


def _load_of(mode: str, load: float) -> str:
    if mode == "rate":
        return "inf req/s" if math.isinf(load) else f"{load:g} req/s"
    return f"conc {load:g}"


def rounds_of(items: Sequence[WorkItem], rounds: int) -> list[list[WorkItem]]:
    """The point's workload in `rounds` parts, item i in part i % rounds: every part keeps the mix of kinds and
    output lengths, and together they are the whole workload, each item once."""
    return [list(items[index::rounds]) for index in range(min(rounds, len(items)))]


COLUMNS = ["setting", "load", "done", "req/s", "out tok/s", "TTFT p50/p90/p99", "TPOT p50/p90/p99",
           "ITL p50/p90/p99", "E2E p50/p99", "accept", "tau"]


def _cells(p: PointStats) -> list[str]:
    def trio(values: tuple[float | None, ...]) -> str:
        return "/".join(_num(v) for v in values)

    done = f"{p.completed}" + (f" ({p.failed} failed)" if p.failed else "")
    return [p.setting, _load(p), done, _num(p.request_throughput, 2), _num(p.output_throughput),
            trio(p.ttft_ms), trio(p.tpot_ms), trio(p.itl_ms), trio((p.e2e_ms[0], p.e2e_ms[2])),
            _num(p.acceptance_rate, 3), _num(p.tau, 3)]


def format_row(p: PointStats) -> str:
    return "  ".join(_cells(p))


def markdown(points: Sequence[PointStats]) -> str:
    """The points table (times in ms), then each setting relative to `off` at the same load when `off` ran."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(p)) + " |" for p in points]
    baseline = {(p.mode, p.load): p for p in points if p.setting == "off"}
    others = [p for p in points if p.setting != "off" and (p.mode, p.load) in baseline]
    if others:
        in_rounds = any(len(p.round_output_throughput) > 1 for p in points)
        extra = " per-round out tok/s vs off: median (min-max) |" if in_rounds else ""
        lines += ["", "| setting | load | out tok/s vs off | TPOT p50 speed-up vs off |" + extra,
                  "|---|---|---|---|" + ("---|" if in_rounds else "")]
        for p in others:
            off = baseline[(p.mode, p.load)]
            throughput = p.output_throughput / off.output_throughput if off.output_throughput else None
            tpot = off.tpot_ms[0] / p.tpot_ms[0] if off.tpot_ms[0] and p.tpot_ms[0] else None
            line = f"| {p.setting} | {_load(p)} | {_num(throughput, 3)}x | {_num(tpot, 3)}x |"
            if in_rounds:
                ratios = sorted(a / b for a, b in zip(p.round_output_throughput, off.round_output_throughput,
                                                      strict=True) if b > 0)
                spread = f"{percentile(ratios, 50):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})" if ratios else "-"
                line += f" {spread} |"
            lines.append(line)
    return "\n".join(lines)


def plot(points: Sequence[PointStats], path: Path) -> bool:
    """Throughput and TPOT p50 against load, one line per setting and one row per mode; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = [m for m in ("rate", "concurrency") if any(p.mode == m for p in points)]
    figure, axes = plt.subplots(len(modes), 2, figsize=(11, 4 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        finite = [p.load for p in points if p.mode == mode and not math.isinf(p.load)]
        inf_at = max(finite, default=1.0) * 2  # `inf` (all at once) is drawn right of the largest rate
        for setting in dict.fromkeys(p.setting for p in points):
            series = sorted((p for p in points if p.mode == mode and p.setting == setting), key=lambda p: p.load)
            xs = [inf_at if math.isinf(p.load) else p.load for p in series]
            axes[row][0].plot(xs, [p.output_throughput for p in series], marker="o", label=setting)
            axes[row][1].plot(xs, [p.tpot_ms[0] or math.nan for p in series], marker="o", label=setting)
        label = "request rate (req/s; rightmost point = all at once)" if mode == "rate" else "concurrent clients"
        for column, title in ((0, "output tokens/s"), (1, "TPOT p50 (ms)")):
            axes[row][column].set_xlabel(label)
            axes[row][column].set_ylabel(title)
            axes[row][column].set_xscale("log", base=2)
            axes[row][column].grid(True, alpha=0.3)
            axes[row][column].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{name}: comma-separated numbers, got {text!r}") from exc
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="measure this running server (loopback) instead of starting one")
    parser.add_argument("--settings", default="off,goodput", help=f"comma-separated, from {', '.join(SPEC_ARGS)}")
    parser.add_argument("--rates", default="1,2,4,8,inf", help="open-loop Poisson rates in requests/s ('' = none)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="closed-loop client counts ('' = none)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per point")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each point's requests in this many parts, the settings alternating per part")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests per server before its points")
    parser.add_argument("--kinds", default=",".join(KINDS), help="prompt kinds of the mix, from bench/prompts.py")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (same for every setting)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate each request's max_tokens")
    parser.add_argument("--model", default="default", help="--model of the started server")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="engine slots of the started server")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `specd serve` argument, e.g. --server-arg=--dtype=int4 (repeatable)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every point as JSON")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables as markdown")
    parser.add_argument("--plot", default=None, metavar="FILE", help="PNG of throughput and TPOT vs load")
    args = parser.parse_args(argv)
    try:
        args.rates = _floats(args.rates, "--rates")
        args.concurrency = [int(c) for c in _floats(args.concurrency, "--concurrency")]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.settings = [s for s in args.settings.split(",") if s]
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not args.kinds or any(k not in KINDS for k in args.kinds):
        parser.error(f"--kinds: choose one or more of {', '.join(KINDS)}")
    if any(not r > 0 for r in args.rates):
        parser.error("--rates: every rate must be > 0 (inf = all at once)")
    if any(c < 1 for c in args.concurrency):
        parser.error("--concurrency: every level must be >= 1")
    if not args.rates and not args.concurrency:
        parser.error("--rates and --concurrency are both empty: nothing to measure")
    if args.num_requests < 1 or args.warmup < 0:
        parser.error("--num-requests must be >= 1 and --warmup >= 0")
    if not 1 <= args.rounds <= args.num_requests:
        parser.error(f"--rounds must be between 1 and --num-requests ({args.num_requests}), got {args.rounds}")
    if len(set(args.settings)) != len(args.settings):
        parser.error("--settings: a setting is named twice (off-again is a second server with speculation off)")
    if unknown := [s for s in args.settings if s not in SPEC_ARGS]:
        parser.error(f"--settings: unknown {unknown}; choose from {', '.join(SPEC_ARGS)}")
    if args.url is not None and urlparse(args.url).hostname not in LOOPBACK_HOSTS:
        parser.error("--url must be a loopback address (127.0.0.1, localhost or ::1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    points: list[PointStats] = []
    print("  ".join(COLUMNS), flush=True)
    if args.url is not None:
        points.extend(measure({"server": args.url.rstrip("/")}, args))
    else:
        with ExitStack() as servers:  # every setting's server up at once; points interleave across them
            urls = {setting: servers.enter_context(served(setting, args)) for setting in args.settings}
            points.extend(measure(urls, args))
    table = markdown(points)
    print("\n" + table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in points], indent=2))
    if args.plot and not plot(points, Path(args.plot)):
        print("--plot: matplotlib is not installed (pip install 'specd[plot]'); no plot written", file=sys.stderr)
    return 1 if any(p.failed for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
