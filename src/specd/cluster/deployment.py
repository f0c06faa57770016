"""The Ray Serve application: specd engines as replicas of one deployment, and the hub that pools their metrics.

Each replica loads its own LLM and serves specd's own FastAPI app (server/app.py build_app, built inside the
replica through Serve's late-bound ingress, `__serve_build_asgi_app__`), wrapped by ReplicaFrontend so that
/metrics and /v1/spec/stats answer for every replica. Requests reach replicas through Ray Serve's default
router (power of two choices: the shorter queue of two random replicas); docs/cluster.md says why specd
does not route by prompt prefix.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import ray
from prometheus_client import CollectorRegistry
from ray import serve
from ray.serve.deployment import Application
from starlette.types import ASGIApp

from specd.cluster.frontend import ReplicaFrontend
from specd.cluster.options import ClusterSettings
from specd.cluster.pooling import BoardEntry, MetricsBoard, ReplicaReport, labelled_families
from specd.cluster.replica_spec import ReplicaSpec
from specd.metrics.prometheus_sink import PrometheusSink
from specd.server.app import build_app, load_off_main_thread

DEPLOYMENT_NAME = "specd"
HUB_NAMESPACE = "specd"


def hub_name(app_name: str) -> str:
    """The named actor holding the metrics board of one Serve application."""
    return f"specd-metrics-{app_name}"


@ray.remote(num_cpus=0, max_restarts=-1)
class MetricsHub:
    """The MetricsBoard of one application, in a detached named actor: it outlives any replica, so a dead
    replica's last counters stay in the pooled totals. Times are the hub's own clock (replicas on other nodes
    may disagree about the time)."""

    def __init__(self, stale_after_s: float) -> None:
        self._board = MetricsBoard(stale_after_s)

    def push(self, report: ReplicaReport) -> None:
        self._board.push(report, time.monotonic())

    def push_and_read(self, report: ReplicaReport) -> list[BoardEntry]:
        self._board.push(report, time.monotonic())
        return self._board.entries(time.monotonic())

    def entries(self) -> list[BoardEntry]:
        return self._board.entries(time.monotonic())


@serve.ingress()
class SpecdReplica:
    """One specd engine. Ray Serve calls check_health() periodically and restarts a replica whose engine
    thread has stopped; a replica that dies is replaced the same way."""

    def __init__(self, spec: ReplicaSpec) -> None:
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self._spec = spec
        self._registry = CollectorRegistry()
        config = spec.config_for(self.replica, ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
        sink = PrometheusSink(self._registry, model=spec.settings.model_name, proposer=config.speculation.method,
                              k_policy=config.speculation.k_policy, vllm_compat=spec.vllm_compat_metrics,
                              speculating=config.speculation.enabled)
        # Loaded on a thread that then exits, as `specd serve` does, so no OpenMP pool is left competing.
        self._llm = load_off_main_thread(lambda: spec.llm_factory(config, [sink]))
        self._app = build_app(self._llm, spec.settings, self._registry)
        self._node = ray.util.get_node_ip_address()
        self._hub = MetricsHub.options(  # type: ignore[attr-defined]
            name=hub_name(context.app_name), namespace=HUB_NAMESPACE, lifetime="detached", get_if_exists=True,
        ).remote(spec.metrics_stale_after_s)
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push_periodically, name="specd-metrics-push", daemon=True)
        self._pusher.start()

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return ReplicaFrontend(self._app, self.replica, self, self._llm.engine.recorder.k_max)

    async def pooled_entries(self) -> list[BoardEntry]:
        return await self._hub.push_and_read.remote(self._report())

    def check_health(self) -> None:
        if not self._app.state.engine.is_running:
            raise RuntimeError(f"replica {self.replica}: the engine thread is not running")

    async def __del__(self) -> None:
        # Serve awaits this on a graceful stop, after the app's lifespan shutdown stopped the engine.
        self._stop.set()
        try:
            final = self._hub.push.remote(self._report(final=True))
            await asyncio.wait_for(asyncio.wrap_future(final.future()), timeout=5)
        except Exception:  # the hub may already be gone with the cluster; the counters die with it then
            pass

    def _report(self, final: bool = False) -> ReplicaReport:
        engine = self._llm.engine
        return ReplicaReport(
            replica=self.replica,
            node=self._node,
            snapshot=engine.recorder.snapshot(),
            engine=self._app.state.engine.state,
            families=labelled_families(self._registry, self.replica),
            policy_estimates={f"{name}_policy": estimates for name, estimates in engine.speculator.snapshots().items()},
            final=final,
        )

    def _push_periodically(self) -> None:
        while not self._stop.wait(self._spec.metrics_push_interval_s):
            try:
                ray.get(self._hub.push.remote(self._report()), timeout=10)
            except Exception:  # a missed push only delays the figures; the next one carries them all
                continue


def build_application(spec: ReplicaSpec, cluster: ClusterSettings) -> Application:
    """The Serve application: bind it with serve.run(app, route_prefix="/") or return it from a builder."""
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": cluster.max_ongoing_requests,
        "max_queued_requests": cluster.max_queued_requests,
        "graceful_shutdown_timeout_s": cluster.graceful_shutdown_s,
        "ray_actor_options": {"num_cpus": cluster.replica_cpus},
    }
    if cluster.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": cluster.min_replicas,
            "max_replicas": cluster.max_replicas,
            "initial_replicas": cluster.num_replicas,
            # Scale up when replicas are full on average (queued requests count as ongoing).
            "target_ongoing_requests": cluster.max_ongoing_requests,
        }
    else:
        options["num_replicas"] = cluster.num_replicas
    return serve.deployment(SpecdReplica).options(**options).bind(spec)
