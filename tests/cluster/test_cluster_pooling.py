"""Pooling across replicas without Ray: two real engines with different traffic, their reports on one board,
the merged Prometheus exposition and the pooled /v1/spec/stats (sums, then ratios)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.cluster.frontend import REPLICA_HEADER, ReplicaFrontend
from specd.cluster.pooling import (
    BoardEntry,
    MergedFamilies,
    MetricsBoard,
    ReplicaReport,
    labelled_families,
    pooled_snapshot,
    pooled_spec_stats,
)
from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.sampling.params import SamplingParams
from specd.server.app import ServerSettings, build_app
from specd.server.async_engine import EngineState

K_MAX = 4
SPEC = SpeculationConfig(method="ngram", num_speculative_tokens=K_MAX, k_policy="heuristic")


class Replica:
    def __init__(self, tiny_model, tokenizer, name: str, prompts: list[str]) -> None:
        self.name = name
        self.registry = CollectorRegistry()
        sink = PrometheusSink(self.registry, "tiny", "ngram", "heuristic")
        self.llm = LLM.from_model(tiny_model, tokenizer, EngineConfig(speculation=SPEC, max_model_len=256),
                                  stats_sinks=[sink])
        self.outputs = self.llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))

    def report(self, final: bool = False) -> ReplicaReport:
        return ReplicaReport(self.name, "127.0.0.1", self.llm.engine.recorder.snapshot(), EngineState(1, 2, 1, 7),
                             labelled_families(self.registry, self.name), final=final)


@pytest.fixture(scope="module")
def replicas(tiny_model, tokenizer) -> list[Replica]:
    # Different traffic, so the two replicas' acceptance rates differ (averaging them would be wrong).
    return [Replica(tiny_model, tokenizer, "a", ["abc abc abc abc abc abc abc", "one two one two one two"]),
            Replica(tiny_model, tokenizer, "b", ["Zebra", "xyzxyzxyzxyzxyzxyz", "1 2 3 1 2 3 1 2 3", "q"])]


def _entries(replicas: list[Replica]) -> list[BoardEntry]:
    board = MetricsBoard(stale_after_s=10.0)
    for replica in replicas:
        board.push(replica.report(), now=0.0)
    return board.entries(now=1.0)


def _sum_usage(replicas: list[Replica], name: str) -> int:
    return sum(getattr(out.spec_stats, name) for replica in replicas for out in replica.outputs)


def test_pooled_snapshot_sums_counters_then_divides(replicas, pooled_from_counters):
    pooled = pooled_snapshot(_entries(replicas), K_MAX).to_dict()
    for name in ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens"):
        assert pooled["counters"][name] == _sum_usage(replicas, name)
    assert pooled["per_request"]["finished_requests"] == 6
    expected = pooled_from_counters(pooled["counters"])
    for key, value in expected.items():
        assert pooled["derived"][key] == pytest.approx(value), key
    rates = [r.llm.get_metrics()["derived"]["acceptance_rate_pooled"] for r in replicas]
    assert rates[0] != pytest.approx(rates[1])  # the figures differ, so the mean of the two would be wrong
    assert pooled["derived"]["acceptance_rate_pooled"] != pytest.approx(sum(rates) / 2)


def test_board_retires_silent_replicas_but_keeps_their_counters(replicas):
    a, b = replicas
    board = MetricsBoard(stale_after_s=5.0)
    board.push(a.report(), now=0.0)
    board.push(b.report(), now=4.0)
    assert [(e.report.replica, e.live) for e in board.entries(now=6.0)] == [("a", False), ("b", True)]
    assert [e.age_s for e in board.entries(now=6.0)] == [6.0, 2.0]
    # retired or not, each replica is counted once in the pooled totals; pushing again makes it live again
    pooled = pooled_snapshot(board.entries(now=6.0), K_MAX).counters.drafts
    board.push(a.report(), now=7.0)
    assert pooled == pooled_snapshot(board.entries(now=7.0), K_MAX).counters.drafts == _sum_usage(replicas, "drafts")
    assert all(e.live for e in board.entries(now=7.0))
    board.push(b.report(final=True), now=7.5)  # a graceful stop leaves /metrics at once
    entry_b = board.entries(now=7.5)[1]
    assert not entry_b.live and entry_b.report.families == ()
    assert MergedFamilies(board.entries(now=7.5)).collect()
    assert {s.labels["replica"] for f in MergedFamilies(board.entries(now=7.5)).collect() for s in f.samples} == {"a"}


def test_merged_exposition_has_each_family_once_with_a_replica_label(replicas):
    text = generate_latest(MergedFamilies(_entries(replicas))).decode()  # type: ignore[arg-type]
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))  # one HELP/TYPE per family: Prometheus would reject repeats
    families = {f.name: f for f in text_string_to_metric_families(text)}
    drafts = {s.labels["replica"]: s.value for s in families["specd_spec_decode_drafts"].samples
              if s.name == "specd_spec_decode_drafts_total"}
    assert drafts == {r.name: float(r.llm.get_metrics()["counters"]["drafts"]) for r in replicas}
    assert sum(drafts.values()) == _sum_usage(replicas, "drafts")
    for family in families.values():  # every series of every family carries the label
        assert all("replica" in sample.labels for sample in family.samples), family.name


def test_pooled_stats_body_sums_live_engines_and_lists_replicas(replicas):
    entries = _entries(replicas)
    local = {"model": "tiny", "metrics": {"counters": {}}, "engine": {}, "uptime_s": 1.0}
    body = pooled_spec_stats(local, entries, K_MAX)
    assert body["engine"] == {"num_running": 2, "num_waiting": 4, "kv_used_slots": 2, "kv_free_slots": 14,
                              "num_in_line": 0, "num_threads": 2, "free_cpus": None}
    assert [row["replica"] for row in body["replicas"]] == ["a", "b"]
    assert [row["finished_requests"] for row in body["replicas"]] == [2, 4]
    assert body["metrics"]["counters"]["drafts"] == _sum_usage(replicas, "drafts")
    assert body["model"] == "tiny" and body["uptime_s"] == 1.0


class _Source:
    def __init__(self, entries: list[BoardEntry] | None) -> None:
        self.entries = entries

    async def pooled_entries(self) -> list[BoardEntry]:
        if self.entries is None:
            raise ConnectionError("hub unreachable")
        return self.entries


async def _get(app, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        return await client.get(path, headers=headers or {})


def test_frontend_pools_after_the_replicas_own_checks(replicas):
    served = replicas[0]
    app = build_app(served.llm, ServerSettings("tiny", api_key="k"), served.registry)
    frontend = ReplicaFrontend(app, "a", _Source(_entries(replicas)), K_MAX)
    auth = {"Authorization": "Bearer k"}
    stats = asyncio.run(_get(frontend, "/v1/spec/stats", auth))
    assert stats.status_code == 200 and stats.headers[REPLICA_HEADER] == "a"
    body = stats.json()
    assert body["metrics"]["counters"]["drafts"] == _sum_usage(replicas, "drafts")
    assert body["speculation"]["method"] == "ngram" and len(body["replicas"]) == 2
    assert int(stats.headers["content-length"]) == len(stats.content)

    denied = asyncio.run(_get(frontend, "/v1/spec/stats"))  # the replica's own API-key check still decides
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert denied.headers[REPLICA_HEADER] == "a"

    scrape = asyncio.run(_get(frontend, "/metrics"))
    labels = {s.labels.get("replica") for f in text_string_to_metric_families(scrape.text) for s in f.samples}
    assert labels == {"a", "b"}

    models = asyncio.run(_get(frontend, "/v1/models", auth))  # everything else is the replica's own answer
    assert models.json()["data"][0]["id"] == "tiny" and models.headers[REPLICA_HEADER] == "a"

    broken = ReplicaFrontend(app, "a", _Source(None), K_MAX)
    failed = asyncio.run(_get(broken, "/metrics"))
    assert failed.status_code == 503
    assert json.loads(failed.content)["error"]["code"] == "metrics_unavailable"
