"""The cross-replica PromQL of docs/metrics.md ("Across replicas"), evaluated by a real Prometheus scraping the
pooled exposition of two replicas (two real engines with different traffic; no Ray needed): pooled recipes equal
the ratio of the summed counters, per-replica ones each replica's own, and the mean of the per-replica ratios
is not the pooled figure. Skipped where the `prometheus` binary is absent (.ci/run installs it)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specd.cluster.pooling import BoardEntry, MergedFamilies, MetricsBoard, ReplicaReport, labelled_families
from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.sampling.params import SamplingParams
from specd.server.async_engine import EngineState

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is absent (Debian: apt-get install prometheus)"
)
DOCS = Path(__file__).resolve().parents[2] / "docs"
SPEC = SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic")
TRAFFIC = {"a": ["abc abc abc abc abc abc abc", "one two one two one two one two"],
           "b": ["Zebra", "xyzxyzxyzxyzxyz", "1 2 3 1 2 3 1 2 3 1 2 3", "q r"]}


def _recipes() -> dict[str, str]:
    """{comment: query} of the code block in the "Across replicas" section."""
    text = (DOCS / "metrics.md").read_text()
    section = text[text.index("## Across replicas"):]
    block = section[section.index("```") + 3:]
    block = block[:block.index("```")]
    recipes: dict[str, str] = {}
    name = ""
    for line in block.strip().splitlines():
        if line.startswith("#"):
            name = line.lstrip("# ").strip()
            recipes[name] = ""
        else:
            recipes[name] = (recipes[name] + " " + line.strip()).strip()
    assert len(recipes) == 3, recipes
    return recipes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.2)


def _query(url: str, expr: str, at: float | None = None) -> list[dict]:
    params: dict[str, object] = {"query": expr}
    if at is not None:
        params["time"] = at
    body = httpx.get(f"{url}/api/v1/query", params=params, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_cross_replica_recipes_pool_exactly(tiny_model, tokenizer, tmp_path):
    registries = {name: CollectorRegistry() for name in TRAFFIC}
    llms = {name: LLM.from_model(tiny_model, tokenizer, EngineConfig(speculation=SPEC, max_model_len=256),
                                 stats_sinks=[PrometheusSink(registries[name], "tiny", "ngram", "heuristic")])
            for name in TRAFFIC}
    board = MetricsBoard(stale_after_s=600.0)

    def publish() -> None:
        for name, llm in llms.items():
            board.push(ReplicaReport(name, "127.0.0.1", llm.engine.recorder.snapshot(), EngineState(0, 0, 0, 1),
                                     labelled_families(registries[name], name)), now=time.monotonic())

    def entries() -> list[BoardEntry]:
        return board.entries(time.monotonic())

    async def exposition(scope, receive, send) -> None:
        body = generate_latest(MergedFamilies(entries()))  # type: ignore[arg-type]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())]})
        await send({"type": "http.response.body", "body": body})

    publish()  # all-zero counters first, so every increase in the window is exact
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    target = f"127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(exposition, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n"
        f"scrape_configs:\n  - job_name: specd\n    static_configs:\n      - targets: ['{target}']\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _ready(url))
        _wait_for(lambda: len(_query(url, "specd_spec_decode_drafts_total == 0")) == 2)
        for name, llm in llms.items():
            llm.generate(TRAFFIC[name], SamplingParams(max_tokens=24, temperature=0.0))
        publish()
        counters = {name: llm.get_metrics()["counters"] for name, llm in llms.items()}
        _wait_for(lambda: all(_query(url, f'specd_spec_decode_steps_total{{replica="{name}"}} == {c["steps"]}')
                              for name, c in counters.items()))
        at = float(_query(url, 'timestamp(specd_spec_decode_steps_total{replica="a"})')[0]["value"][1])
        _check(url, at, _recipes(), counters)
    finally:
        process.terminate()
        process.wait(timeout=30)
        server.should_exit = True
        thread.join(30)
        sock.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _check(url: str, at: float, recipes: dict[str, str], counters: dict[str, dict]) -> None:
    window = "[10m]"
    concrete = {name: re.sub(r"\[5m\]", window, expr) for name, expr in recipes.items()}
    total = {key: sum(c[key] for c in counters.values()) for key in ("accepted_tokens", "draft_tokens", "drafts")}
    pooled = _query(url, concrete["pooled over replicas (exact): sum the counters, then divide"], at)
    assert len(pooled) == 1
    assert float(pooled[0]["value"][1]) == pytest.approx(total["accepted_tokens"] / total["draft_tokens"], rel=1e-9)
    per_replica = {s["metric"]["replica"]: float(s["value"][1]) for s in _query(url, concrete["per replica"], at)}
    own = {name: c["accepted_tokens"] / c["draft_tokens"] for name, c in counters.items()}
    assert per_replica.keys() == own.keys()
    assert all(per_replica[name] == pytest.approx(own[name], rel=1e-9) for name in own)
    tau = _query(url, concrete["tau pooled over replicas"], at)
    assert float(tau[0]["value"][1]) == pytest.approx(1 + total["accepted_tokens"] / total["drafts"], rel=1e-9)
    # The replicas differ, so the average of their ratios (the wrong way) is not the pooled figure.
    assert sum(own.values()) / 2 != pytest.approx(float(pooled[0]["value"][1]))
