"""`specd serve --replicas N`: start (or join) Ray, run the application, serve until SIGINT/SIGTERM, clean up."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from types import FrameType, ModuleType
from typing import Any

from specd.cluster.options import ClusterSettings, cluster_settings_from_args, require_ray
from specd.cluster.replica_spec import ReplicaSpec, replica_spec_from_args
from specd.cluster.stream_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from specd.errors import InvalidParameterError, SpecdError
from specd.threads import available_cpus

APP_NAME = "specd"
PROXY_READY_TIMEOUT_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
LOCAL_OBJECT_STORE_BYTES = 128 * 1024**2  # replicas exchange only small reports; Ray's default takes 30% of RAM
logger = logging.getLogger("specd.cluster")


def serve_cluster_from_args(args: argparse.Namespace) -> int:
    spec = replica_spec_from_args(args)  # every flag is validated before Ray starts
    cluster = cluster_settings_from_args(args)
    run_cluster(spec, cluster, args.host, args.port)
    return 0


def run_cluster(spec: ReplicaSpec, cluster: ClusterSettings, host: str, port: int) -> None:
    local = cluster.ray_address is None
    cpus = available_cpus()  # the affinity mask's CPUs, capped by the cgroup quota
    if local and cluster.most_replicas * cluster.replica_cpus > cpus:
        raise InvalidParameterError(
            "--replica-cpus", f"{cluster.most_replicas} replicas x {cluster.replica_cpus:g} CPUs need "
            f"{cluster.most_replicas * cluster.replica_cpus:g} CPUs and this machine has {cpus}: lower "
            "--replica-cpus or the replica count")
    ray, serve = require_ray("--replicas" if cluster.min_replicas is None else "--min-replicas")
    from specd.cluster.deployment import HUB_NAMESPACE, build_application, hub_name

    if local:
        # Read by each Serve proxy when it starts: cut streams end with specd's error event (stream_guard.py).
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        # Ray Serve gives a proxy 5 s per readiness check and kills it after 3 misses: measured here, a machine
        # busy loading models (load average 10 on 2 cores) missed them and `serve.start` failed. 30 s does not.
        os.environ.setdefault(PROXY_READY_TIMEOUT_ENV, "30")
        _start_ray(ray, num_cpus=cpus, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    else:
        _start_ray(ray, address=cluster.ray_address)
        available = ray.cluster_resources().get("CPU", 0.0)
        if cluster.num_replicas * cluster.replica_cpus > available:
            logger.warning("the cluster has %g CPUs; %d replicas x %g CPUs wait until nodes join", available,
                           cluster.num_replicas, cluster.replica_cpus)
        if os.environ.get(PROXY_CALLBACK_ENV) != PROXY_CALLBACK:
            logger.info("joining a running cluster: streams cut by a dying replica end with an error event only "
                        "where every node was started with %s=%s (docs/cluster.md)", PROXY_CALLBACK_ENV,
                        PROXY_CALLBACK)
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
        except Exception as exc:  # e.g. the port is taken, or the proxy missed its readiness checks
            raise SpecdError(f"--port: Ray Serve's HTTP proxy did not start on {host}:{port}: "
                             f"{type(exc).__name__}: {exc}") from None
        try:
            serve.run(build_application(spec, cluster), name=APP_NAME, route_prefix="/")
        except Exception as exc:  # a replica that cannot load (bad model path, ...) fails the deployment
            raise SpecdError(f"the replicas did not start: {type(exc).__name__}: {exc}") from None
        scaling = (f"autoscaling {cluster.min_replicas}..{cluster.max_replicas} replicas"
                   if cluster.autoscaling else f"{cluster.num_replicas} replicas")
        logger.info("serving '%s' with %s on http://%s:%d (Ray Serve)", spec.settings.model_name, scaling, host, port)
        _wait_for_signal()
    finally:
        if local:
            serve.shutdown()
            ray.shutdown()
        else:  # leave the cluster and its Serve proxies running; remove what this command added
            serve.delete(APP_NAME)
            try:
                ray.kill(ray.get_actor(hub_name(APP_NAME), namespace=HUB_NAMESPACE))
            except ValueError:  # no replica ever created it
                pass
            ray.shutdown()


def _start_ray(ray: ModuleType, **kwargs: Any) -> None:
    try:
        ray.init(**kwargs)
    except Exception as exc:  # no cluster at --ray-address, or a local start that failed
        flag = "--ray-address" if "address" in kwargs else "--replicas"
        raise SpecdError(f"{flag}: Ray did not start: {type(exc).__name__}: {exc}") from None


def _wait_for_signal() -> None:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %d: shutting the replicas down", signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
