"""Serving load: a mixed workload, open-loop (Poisson) or closed-loop arrivals, and per-point statistics.

The shape follows vLLM's serving benchmark, so figures can be set side by side: request throughput, output
tokens/s, TTFT, TPOT and ITL at p50/p90/p99, plus what only specd reports, acceptance and tau pooled over the
point's requests from `usage.speculative_decoding` (sums first, then one division).

Definitions (per request, from the client's clock):
- TTFT: request sent -> first content chunk.
- TPOT: (last content chunk - first content chunk) / (completion tokens - 1), requests with >= 2 tokens.
- ITL: the gaps between consecutive content chunks. One chunk can carry several tokens when a draft is accepted,
  so with speculation ITL measures what a streaming client waits between updates, as vLLM's does.
- E2E: request sent -> last byte of the stream.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import KINDS, prompts_of

# Output lengths a request may ask for: short answers to long rewrites, as in chat traffic.
MAX_TOKENS_CHOICES = (32, 64, 96, 128, 192, 256)


@dataclass(frozen=True, slots=True)
class WorkItem:
    kind: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int


def build_workload(num_requests: int, seed: int, kinds: Sequence[str] = KINDS) -> list[WorkItem]:
    """`num_requests` requests cycling through `kinds` (a realistic mix), each with a prompt of its kind and an
    output length drawn from MAX_TOKENS_CHOICES, all from `seed` so every setting gets the same workload."""
    if num_requests < 1:
        raise ValueError(f"num_requests: must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    pools = {kind: prompts_of(kind) for kind in kinds}
    items = []
    for index in range(num_requests):
        kind = kinds[index % len(kinds)]
        prompt = rng.choice(pools[kind])
        items.append(WorkItem(kind, prompt.messages, rng.choice(MAX_TOKENS_CHOICES)))
    return items


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: exponential gaps of mean 1 / rate; rate = inf sends all at once."""
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 requests/s (inf for all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


@dataclass(frozen=True, slots=True)
class RequestResult:
    ok: bool
    kind: str
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()
    completion_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, model: str, item: WorkItem, temperature: float,
                      ignore_eos: bool) -> RequestResult:
    """One streaming chat completion; never raises (a failure is a result with ok=False)."""
    body = {
        "model": model, "messages": list(item.messages), "max_tokens": item.max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
    }
    start = time.perf_counter()
    chunks: list[float] = []
    usage: dict | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult(False, item.kind, error=f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return RequestResult(False, item.kind, error=str(event["error"].get("message")))
                if event.get("usage"):
                    usage = event["usage"]
                if any(choice["delta"].get("content") for choice in event.get("choices", [])):
                    chunks.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return RequestResult(False, item.kind, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if usage is None:
        return RequestResult(False, item.kind, error="the stream ended without a usage chunk")
    tokens = usage["completion_tokens"]
    spec = usage.get("speculative_decoding") or {}
    first, last = (chunks[0], chunks[-1]) if chunks else (None, None)
    return RequestResult(
        True, item.kind,
        ttft_s=None if first is None else first - start,
        tpot_s=(last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None,
        e2e_s=end - start,
        itl_s=tuple(b - a for a, b in pairwise(chunks)),
        completion_tokens=tokens,
        drafts=spec.get("drafts", 0), draft_tokens=spec.get("draft_tokens", 0),
        accepted_tokens=spec.get("accepted_tokens", 0),
    )


async def run_open_loop(client: httpx.AsyncClient, model: str, items: Sequence[WorkItem], send_times: Sequence[float],
                        temperature: float, ignore_eos: bool) -> tuple[list[RequestResult], float]:
    """Send item i at send_times[i] whether or not earlier requests finished (open loop); (results, seconds)."""
    start = time.perf_counter()

    async def send(item: WorkItem, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await one_request(client, model, item, temperature, ignore_eos)

    results = await asyncio.gather(*(send(item, at) for item, at in zip(items, send_times)))
    return list(results), time.perf_counter() - start


async def run_closed_loop(client: httpx.AsyncClient, model: str, items: Sequence[WorkItem], concurrency: int,
                          temperature: float, ignore_eos: bool) -> tuple[list[RequestResult], float]:
    """`concurrency` clients, each sending its next request when its previous one finished; (results, seconds)."""
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    queue = iter(items)
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def worker() -> None:
        for item in queue:
            results.append(await one_request(client, model, item, temperature, ignore_eos))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class PointStats:
    """One (setting, load) point: `load` is a rate in requests/s (open loop) or a concurrency (closed loop)."""

    setting: str
    mode: str
    load: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft_ms: tuple[float | None, float | None, float | None]  # p50, p90, p99
    tpot_ms: tuple[float | None, float | None, float | None]
    itl_ms: tuple[float | None, float | None, float | None]
    e2e_ms: tuple[float | None, float | None, float | None]
    acceptance_rate: float | None
    tau: float | None
    # Output tok/s of each round when the point ran in rounds (bench/serve.py --rounds), in round order; () otherwise.
    round_output_throughput: tuple[float, ...] = ()


def _ms_percentiles(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    def ms(q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else value * 1000

    return ms(50), ms(90), ms(99)


def summarize(setting: str, mode: str, load: float, results: Sequence[RequestResult], duration_s: float,
              round_output_throughput: Sequence[float] = ()) -> PointStats:
    """One point from its requests' results and its duration (summed over rounds when it ran in rounds)."""
    ok = [r for r in results if r.ok]
    drafts = sum(r.drafts for r in ok)
    draft_tokens = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    return PointStats(
        setting=setting, mode=mode, load=load, completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_throughput=sum(r.completion_tokens for r in ok) / duration_s,
        ttft_ms=_ms_percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=_ms_percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_ms=_ms_percentiles([gap for r in ok for gap in r.itl_s]),
        e2e_ms=_ms_percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        tau=1 + accepted / drafts if drafts else None,
        round_output_throughput=tuple(round_output_throughput),
    )
