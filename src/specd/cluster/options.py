"""The replica flags of `specd serve` and their validated settings. No Ray import here.

`--replicas 1` with no other flag of this group is the single-process server; `--replicas N >= 2` or any other
flag of the group runs N engines as Ray Serve replicas (specd.cluster.launch).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

from specd.errors import InvalidParameterError, SpecdError
from specd.threads import available_cpus

INSTALL_HINT = "pip install 'specd[cluster]'"  # the extra that brings ray[serve]


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """How Ray Serve runs the replicas. Errors name the `specd serve` flag at fault.

    num_replicas: the fixed count, or the starting count when autoscaling (min_replicas..max_replicas).
    replica_cpus: CPUs Ray reserves per replica (torch then uses that many threads at most unless --threads says);
    by default a local Ray splits the machine's CPUs between the replicas.
    max_ongoing_requests: HTTP requests one replica takes at once; the rest wait in Ray Serve's queue for the
    first replica with room. max_queued_requests: that queue's bound per proxy (-1: unbounded).
    ray_address: an existing cluster ("auto" or "ray://..."); None starts a local Ray on this machine.
    """

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    max_ongoing_requests: int = 8
    max_queued_requests: int = -1
    graceful_shutdown_s: float = 10.0
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise InvalidParameterError("--replicas", f"must be an integer >= 1, got {self.num_replicas!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            given, missing = ("--min-replicas", "--max-replicas") if self.max_replicas is None else (
                "--max-replicas", "--min-replicas")
            raise InvalidParameterError(missing, f"is required with {given} (autoscaling needs both bounds)")
        if self.min_replicas is not None and self.max_replicas is not None:
            if self.min_replicas < 1:
                # A specd replica takes seconds to load its model, and the pooled metrics hub outlives replicas
                # only while one is alive to push to it; scale-to-zero would cost both.
                raise InvalidParameterError("--min-replicas", f"must be >= 1, got {self.min_replicas}")
            if self.max_replicas < self.min_replicas:
                raise InvalidParameterError(
                    "--max-replicas", f"must be >= --min-replicas ({self.min_replicas}), got {self.max_replicas}")
            if not self.min_replicas <= self.num_replicas <= self.max_replicas:
                raise InvalidParameterError(
                    "--replicas", f"the starting count {self.num_replicas} must lie within --min-replicas "
                    f"{self.min_replicas} and --max-replicas {self.max_replicas}")
        if not self.replica_cpus > 0:
            raise InvalidParameterError("--replica-cpus", f"must be > 0, got {self.replica_cpus}")
        if not isinstance(self.max_ongoing_requests, int) or self.max_ongoing_requests < 1:
            raise InvalidParameterError("--max-ongoing-requests", f"must be >= 1, got {self.max_ongoing_requests}")
        if self.max_queued_requests < -1 or self.max_queued_requests == 0:
            raise InvalidParameterError("--max-waiting", "the Ray Serve queue bound must be >= 1 or -1 (unbounded)")
        if not self.graceful_shutdown_s > 0:
            raise InvalidParameterError("--shutdown-timeout", f"must be > 0, got {self.graceful_shutdown_s}")
        if self.ray_address is not None and not self.ray_address:
            raise InvalidParameterError("--ray-address", "must not be empty")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.num_replicas


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas (Ray Serve; needs " + INSTALL_HINT + ")")
    g.add_argument("--replicas", type=int, default=None,
                   help="engines behind the one endpoint (default 1: this process, no Ray); with autoscaling, "
                   "the starting count")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound (with --max-replicas)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound (with --min-replicas)")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default: a local Ray splits this machine's CPUs between the "
                   "replicas, at least 1 each; a running cluster: 1)")
    g.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests one replica takes at once; more wait at the proxy (default: --max-num-seqs)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one `ray start` runs here) instead of starting one")


_CLUSTER_ONLY_FLAGS = ("min_replicas", "max_replicas", "replica_cpus", "max_ongoing_requests", "ray_address")


def wants_cluster(args: argparse.Namespace) -> bool:
    """True when the replica flags ask for Ray Serve: --replicas >= 2 or any other flag of the group."""
    replicas = getattr(args, "replicas", None)
    return (replicas is not None and replicas != 1) or any(
        getattr(args, name, None) is not None for name in _CLUSTER_ONLY_FLAGS)


def default_replica_cpus(args: argparse.Namespace) -> float:
    """--replica-cpus when not given: on a local Ray, this machine's CPUs (affinity and cgroup quota) split
    evenly between the most replicas there will be, at least 1 each; on a running cluster, 1."""
    if args.ray_address is not None:
        return 1.0
    most = args.max_replicas or args.replicas or args.min_replicas or 1
    return float(max(1, available_cpus() // most))


def cluster_settings_from_args(args: argparse.Namespace) -> ClusterSettings:
    return ClusterSettings(
        num_replicas=args.replicas if args.replicas is not None else (args.min_replicas or 1),
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        replica_cpus=default_replica_cpus(args) if args.replica_cpus is None else args.replica_cpus,
        max_ongoing_requests=args.max_num_seqs if args.max_ongoing_requests is None else args.max_ongoing_requests,
        max_queued_requests=args.max_waiting if args.max_waiting > 0 else -1,
        graceful_shutdown_s=float(args.shutdown_timeout),
        ray_address=args.ray_address,
    )


class RayModules(NamedTuple):
    ray: ModuleType
    serve: ModuleType


def require_ray(flag: str = "--replicas") -> RayModules:
    """ray and ray.serve, or a SpecdError naming `flag` and the install command."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise SpecdError(f"{flag}: replicas run on Ray Serve, which is not installed ({exc.msg}); "
                         f"install it with: {INSTALL_HINT}") from None
    return RayModules(ray, serve)
