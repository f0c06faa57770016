"""Every PromQL recipe of docs/metrics.md and every panel query of docs/grafana/specd.json, evaluated by a real
Prometheus that scraped a live `specd` server, equals the recorder's own numbers.

The server speculates with ngram and the heuristic k policy, so k varies per step and per sequence. Prometheus
scrapes every second from before the first request, so every counter's first sample in the window is 0; the
queries are evaluated at the timestamp of the last scrape. Then Prometheus' `increase` is exact (it does not
extrapolate past a zero start or past the evaluation time), and every ratio of rates is the ratio of the
recorder's counters. Skipped where the `prometheus` binary is absent (Debian: `apt-get install prometheus`;
.ci/run installs it).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.metrics.prometheus_sink import DEFAULT_PHASE_BUCKETS, PrometheusSink
from specd.metrics.records import StepRecord
from specd.metrics.snapshots import tau_bucket_bounds

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is absent (Debian: apt-get install prometheus)"
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
MODEL = "tiny"
K_MAX = 4
WINDOW = "[10m]"
SELECTOR = '{model=~".*",proposer=~".*"}'
REPLICA_SELECTOR = '{model=~".*",proposer=~".*",replica=~".*"}'
DASHBOARD_SELECTOR = '{model=~".*",proposer=~".*",k_policy=~".*",replica=~".*"}'
PHASES = ("propose", "verify", "sample")


class StepLog:
    """A sink keeping every step's phase times, for the histogram_quantile check."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def bind(self, recorder: Any) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)

    def on_request_finished(self, request_id: str, stats: Any) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _recipes() -> dict[str, str]:
    """{quantity: PromQL} from the recipe table of docs/metrics.md."""
    text = (DOCS / "metrics.md").read_text()
    section = text[text.index("## PromQL recipes") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| ([^|]+?) \| `(.+)` \|$", section, flags=re.MULTILINE)
    assert len(rows) >= 10, "the recipe table was not found"
    return dict(rows)


def _vllm_recipes() -> list[str]:
    text = (DOCS / "metrics.md").read_text()
    return re.findall(r"`([^`]*vllm:spec_decode[^`]*\[5m\][^`]*)`", text)


def _panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every panel target of the Grafana dashboard."""
    dashboard = json.loads((DOCS / "grafana" / "specd.json").read_text())
    return [
        (panel["title"], target.get("refId", ""), target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def _concrete(expr: str) -> str:
    # The dashboard's replica variable at "All" (.*) also matches this single-process server's unlabelled series.
    expr = expr.replace('{model=~"$model",proposer=~"$proposer",k_policy=~"$k_policy",replica=~"$replica"}',
                        DASHBOARD_SELECTOR)
    expr = expr.replace('{model=~"$model",proposer=~"$proposer",replica=~"$replica"}', REPLICA_SELECTOR)
    expr = expr.replace(" S ", SELECTOR).replace('{model=~"$model",proposer=~"$proposer"}', SELECTOR)
    return expr.replace("[$__rate_interval]", WINDOW).replace("[5m]", WINDOW)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def scalar(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def by_label(self, expr: str, label: str, at: float) -> dict[str, float]:
        return {series["metric"][label]: float(series["value"][1]) for series in self.query(expr, at)}


@pytest.fixture(scope="module")
def scraped(tiny_model, tokenizer, start_server, tmp_path_factory):
    """A specd server that served varied traffic, a Prometheus that scraped all of it, and the recorder's view."""
    registry = CollectorRegistry()
    steps = StepLog()
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=K_MAX, k_policy="heuristic")
    sinks = [PrometheusSink(registry, MODEL, "ngram", "heuristic", vllm_compat=True), steps]
    config = EngineConfig(speculation=spec, max_model_len=256, max_num_seqs=4, max_waiting=64)
    llm = LLM.from_model(tiny_model, tokenizer, config, stats_sinks=sinks)
    workdir = tmp_path_factory.mktemp("prometheus")
    with start_server(llm, registry) as server:
        target = server.url.removeprefix("http://")
        (workdir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: specd\n    static_configs:\n      - targets: ['{target}']\n"
        )
        port = _free_port()
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        prometheus = Prometheus(f"http://127.0.0.1:{port}")
        try:
            server.wait_for(lambda: _ready(prometheus), timeout_s=60)
            # A scrape of the all-zero counters before any traffic: the window starts at 0.
            server.wait_for(lambda: _has_sample(prometheus, "specd_spec_decode_steps_total == 0"), timeout_s=60)
            _traffic(server)
            final_steps = llm.get_metrics()["counters"]["steps"]
            server.wait_for(
                lambda: _has_sample(prometheus, f"specd_spec_decode_steps_total == {final_steps}")
                and _has_sample(prometheus, "specd_spec_decode_request_mean_acceptance_length_count > 0"),
                timeout_s=60,
            )
            at = prometheus.scalar("timestamp(specd_spec_decode_steps_total)")
            yield prometheus, at, llm.get_metrics(), steps.records
        finally:
            process.terminate()
            process.wait(timeout=30)


def _ready(prometheus: Prometheus) -> bool:
    try:
        return httpx.get(f"{prometheus.url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _has_sample(prometheus: Prometheus, expr: str) -> bool:
    return bool(prometheus.query(expr))


def _traffic(server) -> None:
    client = server.client()
    prompts = ["abc abc abc abc abc abc abc", "one two one two one two one two", "xyzxyzxyzxyzxyz", "Zebra",
               "the quick brown fox jumps over the lazy dog. the quick"]
    for i, prompt in enumerate(prompts):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=20 + 7 * i, temperature=0)
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.9, seed=i)


# ------------------------------------------------------------------ expected values, from the recorder alone
def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def _expected_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    c = metrics["counters"]
    return {
        "acceptance rate": _ratio(c["accepted_tokens"], c["draft_tokens"]),
        "tau": 1 + _ratio(c["accepted_tokens"], c["drafts"]),
        "accepted tokens per draft": _ratio(c["accepted_tokens"], c["drafts"]),
        "mean proposed length": _ratio(c["draft_tokens"], c["drafts"]),
        "emitted per draft": _ratio(c["emitted_tokens"], c["drafts"]),
        "tokens per target forward": _ratio(c["emitted_tokens"] + c["nonspec_tokens"], c["steps"]),
        "tokens per sequence-step": _ratio(
            c["emitted_tokens"] + c["nonspec_tokens"], c["drafts"] + c["nonspec_seq_steps"]
        ),
        "share of steps that speculated": _ratio(c["spec_steps"], c["steps"]),
        "speed-up estimate": _ratio(metrics["speedup"]["plain_decode_s"], metrics["speedup"]["decode_s"]),
    }


def _expected_per_position(metrics: dict[str, Any], denominator: str) -> dict[str, float]:
    c = metrics["counters"]
    return {str(j + 1): _ratio(a, d) for j, (a, d) in enumerate(zip(c["accepted_at"], c[denominator]))}


def _expected_accepted_length_cdf(metrics: dict[str, Any]) -> dict[float, float]:
    hist = metrics["counters"]["accepted_length_hist"]
    total, running, cdf = sum(hist), 0, {}
    for length, count in enumerate(hist):
        running += count
        cdf[float(length)] = running / total
    return cdf


def _expected_tau_cdf(metrics: dict[str, Any]) -> dict[float, float]:
    counts = metrics["per_request"]["tau_hist"]["counts"]
    total, running, cdf = sum(counts), 0, {}
    for bound, count in zip(tau_bucket_bounds(K_MAX), counts):
        running += count
        cdf[bound] = running / total
    return cdf


def _quantile_like_prometheus(q: float, observations: list[float], bounds: tuple[float, ...]) -> float:
    """histogram_quantile's rule over these buckets: linear interpolation inside the bucket holding rank q * n
    (the first bucket starts at 0); a rank in the +Inf bucket gives the largest finite bound."""
    cumulative = [sum(1 for x in observations if x <= bound) for bound in bounds]
    rank = q * len(observations)
    lower, below = 0.0, 0
    for bound, count in zip(bounds, cumulative):
        if count >= rank:
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return bounds[-1]


def _close(actual: float, expected: float) -> bool:
    if math.isnan(expected):
        return math.isnan(actual)
    return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12)


def _check(prometheus: Prometheus, at: float, name: str, expr: str, metrics: dict[str, Any],
           records: list[StepRecord]) -> None:
    """Evaluate one query and compare it with what the recorder says it must be; `name` says which quantity."""
    query = _concrete(expr)
    scalars = _expected_scalars(metrics)
    counters, totals = metrics["counters"], metrics["counters"]
    rate_seconds = 600.0  # WINDOW; with exact increases, rate = increase / the window's length
    if name in scalars:
        assert _close(prometheus.scalar(query, at), scalars[name]), (name, query)
    elif name in ("per-position acceptance", "conditional acceptance", "per-position acceptance, vLLM-style"):
        actual = prometheus.by_label(query, "position", at)
        if name == "per-position acceptance, vLLM-style":  # every draft in the denominator
            expected = {str(j + 1): _ratio(a, counters["drafts"]) for j, a in enumerate(counters["accepted_at"])}
        else:
            denominator = "drafted_at" if name == "per-position acceptance" else "reached_at"
            expected = _expected_per_position(metrics, denominator)
        assert actual.keys() == expected.keys(), name
        assert all(_close(actual[p], expected[p]) for p in expected), (name, actual, expected)
    elif name in ("accepted-length heatmap", "per-request tau heatmap"):
        actual = prometheus.by_label(query, "le", at)
        cdf = _expected_accepted_length_cdf(metrics) if name.startswith("accepted") else _expected_tau_cdf(metrics)
        assert actual["+Inf"] > 0, name
        for bound, share in cdf.items():
            assert _close(actual[str(bound)] / actual["+Inf"], share), (name, bound)
    elif name == "mean phase time per step":
        actual = prometheus.by_label(query, "phase", at)
        for phase in PHASES:
            assert math.isclose(actual[phase], totals[f"{phase}_s"] / counters["steps"], rel_tol=1e-6), phase
    elif name == "p95 phase time":
        actual = prometheus.by_label(query, "phase", at)
        for phase in PHASES:
            observed = [getattr(r.times, f"{phase}_s") for r in records]
            expected = _quantile_like_prometheus(0.95, observed, DEFAULT_PHASE_BUCKETS)
            assert math.isclose(actual[phase], expected, rel_tol=1e-9), (phase, actual[phase], expected)
    elif name.startswith("throughput:"):
        counter = name.removeprefix("throughput:")
        assert _close(prometheus.scalar(query, at), counters[counter] / rate_seconds), name
    else:
        raise AssertionError(f"no expected value is known for {name!r}: add one to this test")


def test_every_docs_recipe_equals_the_recorder(scraped):
    prometheus, at, metrics, records = scraped
    assert metrics["counters"]["drafts"] > 0
    assert metrics["counters"]["rejected_tokens"] > 0
    assert len(set(metrics["counters"]["drafted_at"])) > 1  # k varied: positions were reached unevenly
    assert metrics["speedup"]["decode_s"] > 0  # plain steps were measured: the speed-up recipe is not 0/0
    for name, expr in _recipes().items():
        _check(prometheus, at, name, expr, metrics, records)


def test_vllm_compat_recipes_equal_the_recorder(scraped):
    prometheus, at, metrics, _ = scraped
    recipes = _vllm_recipes()
    assert len(recipes) == 2
    c = metrics["counters"]
    expected = [_ratio(c["accepted_tokens"], c["draft_tokens"]), 1 + _ratio(c["accepted_tokens"], c["drafts"])]
    for expr, value in zip(recipes, expected):
        assert _close(prometheus.scalar(_concrete(expr), at), value), expr


# Each Grafana target, by (panel title, refId), is the same quantity as a docs recipe (or a token throughput).
PANEL_QUANTITIES = {
    "Per-position acceptance, vLLM-style": "per-position acceptance, vLLM-style",  # before its prefix below
    "Speed-up estimate": "speed-up estimate",
    "Acceptance rate": "acceptance rate",
    "Mean acceptance length": "tau",
    "Per-position acceptance": "per-position acceptance",
    "Conditional per-position acceptance": "conditional acceptance",
    "Accepted length per draft": "accepted-length heatmap",
    "Per-request mean acceptance length": "per-request tau heatmap",
    "Phase time per step (mean)": "mean phase time per step",
    "Phase time per step (p95)": "p95 phase time",
    "Share of steps": "share of steps that speculated",
}


def _panel_quantity(title: str, expr: str) -> str:
    if title.startswith("Accepted tokens per draft"):
        return "mean proposed length" if "draft_tokens_total" in expr.split("/")[0] else "accepted tokens per draft"
    if title.startswith("Emitted per draft"):
        return "tokens per target forward" if "nonspec" in expr else "emitted per draft"
    if title.startswith(("Draft and accepted token throughput", "Drafting and wasted work")):
        counter = re.search(r"specd_spec_decode_(\w+)_total", expr)
        assert counter is not None
        return f"throughput:{counter.group(1)}"
    for prefix, quantity in PANEL_QUANTITIES.items():
        if title.startswith(prefix):
            return quantity
    raise AssertionError(f"Grafana panel {title!r} has no known quantity: add it to this test")


def test_every_grafana_panel_query_equals_the_recorder(scraped):
    prometheus, at, metrics, records = scraped
    queries = _panel_queries()
    assert len(queries) >= 20
    for title, _, expr in queries:
        _check(prometheus, at, _panel_quantity(title, expr), expr, metrics, records)
    # The dashboard's template variables resolve against the scraped series.
    labels = prometheus.query('group by (model, proposer, k_policy) (specd_spec_decode_steps_total)')
    assert [(s["metric"]["model"], s["metric"]["proposer"], s["metric"]["k_policy"]) for s in labels] == [
        (MODEL, "ngram", "heuristic")]
    # Every speculation series carries the configured k policy as its k_policy label.
    assert prometheus.query('count({__name__=~"specd_spec_decode_.+"})', at)
    assert prometheus.query('{__name__=~"specd_spec_decode_.+",k_policy!="heuristic"}', at) == []
