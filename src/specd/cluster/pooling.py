"""Pooling the replicas' figures exactly: counters are summed, ratios are taken of the sums. No Ray import here.

Each replica pushes a ReplicaReport (its cumulative speculation snapshot, engine state and Prometheus families
labelled `replica`) to one MetricsBoard (kept by a named Ray actor, specd.cluster.deployment.MetricsHub), and
whichever replica answers /metrics or /v1/spec/stats reads the board back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from specd.metrics.snapshots import SpecMetricsSnapshot
from specd.server.async_engine import EngineState

REPLICA_LABEL = "replica"


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """One replica's cumulative figures at one moment.

    families: its Prometheus metric families, every sample labelled replica=<replica>.
    policy_estimates: its k policies' own estimates, as LLM.get_metrics() names them ("goodput_policy", ...).
    final: the replica is shutting down (it leaves /metrics at once; its counters stay in the pooled totals).
    """

    replica: str
    node: str
    snapshot: SpecMetricsSnapshot
    engine: EngineState
    families: tuple[Metric, ...]
    policy_estimates: dict[str, Any] = field(default_factory=dict)
    final: bool = False


class BoardEntry(NamedTuple):
    report: ReplicaReport
    age_s: float
    live: bool


class MetricsBoard:
    """The latest report of every replica seen. A replica that has not pushed for `stale_after_s` (or said it
    was shutting down) is retired: it leaves the Prometheus exposition (Prometheus then marks its series stale)
    but its last counters stay in the pooled totals, so pooled cumulative figures never go down when a replica
    dies or is scaled away. A retired replica that pushes again is live again (never counted twice)."""

    def __init__(self, stale_after_s: float) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s: must be > 0, got {stale_after_s}")
        self._stale_after_s = stale_after_s
        self._latest: dict[str, tuple[ReplicaReport, float]] = {}

    def push(self, report: ReplicaReport, now: float) -> None:
        if report.final:
            report = replace(report, families=())  # nothing to expose any more; keep the counters
        self._latest[report.replica] = (report, now)

    def entries(self, now: float) -> list[BoardEntry]:
        out = []
        for report, pushed_at in self._latest.values():
            age = max(0.0, now - pushed_at)
            out.append(BoardEntry(report, age, not report.final and age <= self._stale_after_s))
        return sorted(out, key=lambda entry: entry.report.replica)


def labelled_families(registry: CollectorRegistry, replica: str) -> tuple[Metric, ...]:
    """Every family of `registry` with replica=<replica> added to each sample."""
    out = []
    for family in registry.collect():
        labelled = Metric(family.name, family.documentation, family.type, family.unit)
        labelled.samples = [s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples]
        out.append(labelled)
    return tuple(out)


class MergedFamilies:
    """A collector (for prometheus_client.generate_latest) yielding each family once with the samples of every
    live replica, so the exposition has one HELP/TYPE per family and a `replica` label per series."""

    def __init__(self, entries: Iterable[BoardEntry]) -> None:
        merged: dict[str, Metric] = {}
        for entry in entries:
            if not entry.live:
                continue
            for family in entry.report.families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(family.samples)
        self._families = list(merged.values())

    def collect(self) -> list[Metric]:
        return self._families


def pooled_snapshot(entries: Sequence[BoardEntry], k_max: int) -> SpecMetricsSnapshot:
    """The sum of every replica's cumulative snapshot, live and retired."""
    total = SpecMetricsSnapshot.zero(k_max)
    for entry in entries:
        total = total + entry.report.snapshot
    return total


def pooled_spec_stats(local_body: dict[str, Any], entries: Sequence[BoardEntry], k_max: int) -> dict[str, Any]:
    """/v1/spec/stats of the endpoint from the answering replica's own body: `metrics` becomes the pooled
    snapshot (k policies' estimates are per engine, so they move to `replicas`), `engine` the sum over live
    replicas, and `replicas` lists each one."""
    body = dict(local_body)
    body["metrics"] = pooled_snapshot(entries, k_max).to_dict()
    live = [entry.report.engine for entry in entries if entry.live]
    # free_cpus is each replica's view of its own machine: summing views of one machine would count a core twice,
    # so the pooled body leaves it to the replicas' rows.
    body["engine"] = {field: None if field == "free_cpus" else sum(getattr(state, field) for state in live)
                      for field in EngineState._fields}
    body["replicas"] = [_replica_row(entry) for entry in entries]
    return body


def _replica_row(entry: BoardEntry) -> dict[str, Any]:
    report = entry.report
    counters = report.snapshot.counters
    row: dict[str, Any] = {
        "replica": report.replica,
        "node": report.node,
        "live": entry.live,
        "age_s": entry.age_s,
        "engine": report.engine._asdict(),
        "finished_requests": report.snapshot.per_request.finished_requests,
        "counters": {"drafts": counters.drafts, "draft_tokens": counters.draft_tokens,
                     "accepted_tokens": counters.accepted_tokens, "emitted_tokens": counters.emitted_tokens},
    }
    row.update(report.policy_estimates)
    return row
