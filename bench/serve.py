"""Load generator for `specd serve`: concurrency sweep with speculation off and on.

For each speculation config it starts `specd serve` on 127.0.0.1 (a fresh server per config, so the
configs do not share warm state), warms it with one request, then for each concurrency level sends
`--max-requests` streaming chat requests from that many concurrent workers, stopping early at
`--max-seconds`. With --url it measures an already running server instead (loopback only).

Run: .venv/bin/python bench/serve.py [--concurrency 1,2,4,8,16] [--specs off,ngram] [--max-requests 16]
     [--max-tokens 64] [--max-seconds 120] [--model default] [--server-arg=--threads=2 ...] [--json FILE]
Smoke: .venv/bin/python bench/serve.py --max-requests 2 --concurrency 1

Columns: req/s and output tok/s over the point's wall time; TTFT from sending to the first content chunk;
TPOT = (last chunk - first content chunk) / (completion tokens - 1); accept = accepted / draft tokens and
tau = 1 + accepted / drafts, pooled over the point's requests from `usage.speculative_decoding`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

SPEC_ARGS = {
    "off": ["--spec", "off"],
    "ngram": ["--spec", "ngram", "--k-policy", "heuristic"],
    "goodput": ["--spec", "ngram", "--num-spec-tokens", "8", "--k-policy", "goodput"],
}
PROMPTS = [
    "Rewrite this sentence in the passive voice: The quick brown fox jumps over the lazy dog.",
    "Repeat the following list exactly, one item per line: apples, bananas, cherries, dates, elderberries.",
    "Summarize in one sentence: The library opens at nine, closes at five, and is closed on Sundays.",
    "Write a short poem about the sea.",
    "Correct the grammar: 'She don't like them apples and he go to school every days.'",
    "Explain what a hash table is to a child.",
    "Convert to JSON with keys name and age: Alice is 30 years old, Bob is 25 years old.",
    "List five prime numbers and explain why each is prime.",
    "Translate to French: Good morning, how are you today?",
    "Give three tips for writing clear code.",
    "Extract the city names: I flew from Paris to Berlin, then took a train to Vienna and Prague.",
    "Continue the story: Once upon a time, in a small village by the mountains,",
]
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class RequestResult:
    ok: bool
    ttft_s: float | None
    tpot_s: float | None
    completion_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PointResult:
    """One (spec config, concurrency) point of the sweep."""

    spec: str
    concurrency: int
    num_requests: int
    num_failed: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    acceptance_rate: float | None
    tau: float | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, args: argparse.Namespace) -> RequestResult:
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
        "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    start = time.perf_counter()
    first = last = None
    usage: dict | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, None, None, 0, 0, 0, 0, f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return RequestResult(False, None, None, 0, 0, 0, 0, event["error"]["message"])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
    except httpx.HTTPError as exc:
        return RequestResult(False, None, None, 0, 0, 0, 0, f"{type(exc).__name__}: {exc}")
    if usage is None:
        return RequestResult(False, None, None, 0, 0, 0, 0, "no usage chunk")
    tokens = usage["completion_tokens"]
    spec = usage.get("speculative_decoding") or {}
    ttft = None if first is None else first - start
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return RequestResult(True, ttft, tpot, tokens, spec.get("drafts", 0), spec.get("draft_tokens", 0),
                         spec.get("accepted_tokens", 0))


async def run_point(url: str, model: str, spec: str, concurrency: int, args: argparse.Namespace) -> PointResult:
    """`concurrency` workers share a budget of max_requests; nobody starts a request after max_seconds."""
    budget = iter(range(args.max_requests))
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + args.max_seconds
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.max_seconds + 60, connect=10)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            for index in budget:
                if time.perf_counter() > deadline:
                    return
                results.append(await one_request(client, model, PROMPTS[index % len(PROMPTS)], args))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    drafts = sum(r.drafts for r in ok)
    draft_tokens = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    for failure in (r for r in results if not r.ok):
        print(f"  request failed: {failure.error}", file=sys.stderr)
    return PointResult(
        spec=spec, concurrency=concurrency, num_requests=len(results), num_failed=len(results) - len(ok),
        wall_s=wall, requests_per_s=len(ok) / wall, output_tokens_per_s=sum(r.completion_tokens for r in ok) / wall,
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        tpot_p50_s=percentile(tpots, 50), tpot_p90_s=percentile(tpots, 90),
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        tau=1 + accepted / drafts if drafts else None,
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served(spec: str, args: argparse.Namespace) -> Iterator[str]:
    """Start `specd serve` for one spec config on a free loopback port; yield its URL; stop it."""
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


def measure(url: str, spec: str, args: argparse.Namespace) -> list[PointResult]:
    async def main() -> list[PointResult]:
        # Warm-up (first forwards allocate and tune); not measured.
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.max_seconds + 60) as client:
            models = await client.get("/v1/models")
            models.raise_for_status()
            model = models.json()["data"][0]["id"]
            warm = await one_request(client, model, PROMPTS[0], args)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        points = []
        for concurrency in args.concurrency:
            point = await run_point(url, model, spec, concurrency, args)
            print(format_row(point), flush=True)
            points.append(point)
        return points

    return asyncio.run(main())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


HEADER = (f"{'conc':>4} {'spec':>6} {'reqs':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'TPOT p50':>9} {'TPOT p90':>9} {'accept':>7} {'tau':>6}")


def format_row(p: PointResult) -> str:
    failed = f" ({p.num_failed} failed)" if p.num_failed else ""
    return (f"{p.concurrency:>4} {p.spec:>6} {p.num_requests:>5} {p.requests_per_s:>7.2f} "
            f"{p.output_tokens_per_s:>9.1f} {_ms(p.ttft_p50_s):>9} {_ms(p.ttft_p90_s):>9} {_ms(p.tpot_p50_s):>9} "
            f"{_ms(p.tpot_p90_s):>9} {_ratio(p.acceptance_rate):>7} {_ratio(p.tau):>6}{failed}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="measure this running server (loopback) instead of starting one")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated concurrency levels")
    parser.add_argument("--specs", default="off,ngram", help=f"comma-separated, from {', '.join(SPEC_ARGS)}")
    parser.add_argument("--max-requests", type=int, default=16, help="requests per point")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="no new request after this, per point")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    parser.add_argument("--model", default="default", help="--model of the started server")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="engine slots of the started server")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `specd serve` argument, e.g. --server-arg=--threads=2 (repeatable)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every point as JSON")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.specs = args.specs.split(",")
    if any(c < 1 for c in args.concurrency) or args.max_requests < 1 or args.max_seconds <= 0:
        parser.error("--concurrency levels, --max-requests and --max-seconds must be positive")
    if unknown := [s for s in args.specs if s not in SPEC_ARGS]:
        parser.error(f"--specs: unknown {unknown}")
    if args.url is not None and urlparse(args.url).hostname not in LOOPBACK_HOSTS:
        parser.error("--url must be a loopback address (127.0.0.1, localhost or ::1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    points: list[PointResult] = []
    print(HEADER, flush=True)
    if args.url is not None:
        points.extend(measure(args.url.rstrip("/"), "server", args))
    else:
        for spec in args.specs:
            with served(spec, args) as url:
                points.extend(measure(url, spec, args))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in points], indent=2))
    return 1 if any(p.num_failed for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
