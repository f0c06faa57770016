"""What every replica is built from (pickled by Ray to each replica), and how `specd serve` flags make it.

No Ray import here, so the flags are validated before Ray starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from specd.config import EngineConfig
from specd.config_args import engine_config_from_args
from specd.errors import InvalidParameterError
from specd.llm import LLM
from specd.metrics.stats import StatsSink
from specd.server.app import settings_from_args
from specd.server.settings import ServerSettings

LLMFactory = Callable[[EngineConfig, Sequence[StatsSink]], LLM]


def load_llm(config: EngineConfig, stats_sinks: Sequence[StatsSink]) -> LLM:
    """The default LLMFactory: what `specd serve` loads."""
    return LLM.from_config(config, stats_sinks)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """config and settings: as for one `specd serve` process. llm_factory: builds the replica's LLM with the
    given stats sinks (a module-level function, so Ray can import it by name on any node).
    metrics_push_interval_s: how often a replica pushes its figures to the metrics hub (it also pushes before
    it answers /metrics or /v1/spec/stats). metrics_stale_after_s: a replica silent that long leaves /metrics."""

    config: EngineConfig
    settings: ServerSettings
    vllm_compat_metrics: bool = False
    llm_factory: LLMFactory = load_llm
    metrics_push_interval_s: float = 1.0
    metrics_stale_after_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.config, EngineConfig):
            raise InvalidParameterError("config", "must be an EngineConfig")
        if not isinstance(self.settings, ServerSettings):
            raise InvalidParameterError("settings", "must be a ServerSettings")
        if not callable(self.llm_factory):
            raise InvalidParameterError("llm_factory", "must be callable")
        if not self.metrics_push_interval_s > 0:
            raise InvalidParameterError("metrics_push_interval_s", "must be > 0")
        if not self.metrics_stale_after_s > self.metrics_push_interval_s:
            raise InvalidParameterError("metrics_stale_after_s", "must be > metrics_push_interval_s")

    def config_for(self, replica: str, cpus: float) -> EngineConfig:
        """The engine config of one replica holding `cpus` CPUs. Without --threads, torch gets floor(cpus)
        threads (at least 1), so replicas sharing a machine do not each start one thread per core. A
        --spec-trace file gets the replica's name before its suffix (trace.jsonl -> trace.<replica>.jsonl), since
        replicas are separate processes writing their own lines."""
        config = self.config
        if config.num_threads is None:
            config = replace(config, num_threads=max(1, math.floor(cpus)))
        if config.spec_trace_path is None:
            return config
        trace = Path(config.spec_trace_path)
        return replace(config, spec_trace_path=str(trace.with_name(f"{trace.stem}.{replica}{trace.suffix}")))


def replica_spec_from_args(args: argparse.Namespace) -> ReplicaSpec:
    """The same mapping of flags as the single-process `specd serve` (server/app.py serve_from_args)."""
    config = engine_config_from_args(args)
    settings = settings_from_args(args)
    return ReplicaSpec(config, settings, vllm_compat_metrics=args.vllm_compat_metrics)
