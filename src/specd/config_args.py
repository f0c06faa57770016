"""The command-line flags <-> EngineConfig mapping, in one place for `specd generate` and `specd serve`.

Each flag names the config field it sets; its default and type come from that field's default in the config
dataclasses, and its choices from the config's own enumerations (dtypes, registered proposers and k policies),
so the CLI cannot drift from what EngineConfig accepts. Values are validated by EngineConfig itself.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, get_args

from specd.config import DType, EngineConfig, SpeculationConfig, ThreadPolicy, k_policies, spec_methods


class ConfigFlag(NamedTuple):
    """One flag: the EngineConfig field it sets ("speculation.<name>" for SpeculationConfig fields)."""

    flag: str
    field: str
    help: str | None = None
    type: Callable[[str], Any] | None = None  # needed only where the field's default is None
    choices: Callable[[], Sequence[str]] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def default(self) -> Any:
        config_type, name = (SpeculationConfig, self.field.split(".", 1)[1]) if "." in self.field else (
            EngineConfig, self.field
        )
        return {f.name: f.default for f in dataclasses.fields(config_type)}[name]

    def add_to(self, group: Any, default: Any = dataclasses.MISSING) -> None:
        """Add the flag to `group` (a parser or an argument group); `default` overrides the config's (e.g. the
        server's queue limit)."""
        value = self.default() if default is dataclasses.MISSING else default
        arg_type = self.type or (type(value) if value is not None else str)
        group.add_argument(
            self.flag, dest=self.dest, default=value, type=arg_type, help=self.help, metavar=self.metavar,
            choices=list(self.choices()) if self.choices is not None else None,
        )


MODEL_FLAGS = (
    ConfigFlag("--model", "model", help="'default' (SmolLM2-135M-Instruct GGUF), a HF dir or .gguf"),
    ConfigFlag("--dtype", "dtype", choices=lambda: get_args(DType),
               help="int4: int4 weights for decode-sized matmuls (a Q4_1 GGUF's codes kept exactly), "
               "bfloat16 activations; float64: exact reference runs"),
    ConfigFlag("--max-num-seqs", "max_num_seqs"),
    ConfigFlag("--max-model-len", "max_model_len"),
    ConfigFlag("--max-num-batched-tokens", "max_num_batched_tokens"),
    ConfigFlag("--threads", "num_threads", type=int,
               help="the most CPU threads (default: the CPUs this process may use, cgroup quota included)"),
    ConfigFlag("--thread-policy", "thread_policy", choices=lambda: get_args(ThreadPolicy),
               help="adaptive: run as many threads as the cores other processes leave free; fixed: always --threads"),
    ConfigFlag("--seed", "seed", help="engine seed for requests without their own"),
)
SPECULATION_FLAGS = (
    ConfigFlag("--spec", "speculation.method", choices=spec_methods),
    ConfigFlag("--num-spec-tokens", "speculation.num_speculative_tokens",
               help="k_max: most draft tokens per sequence per step"),
    ConfigFlag("--k-policy", "speculation.k_policy", choices=k_policies),
    ConfigFlag("--draft-model", "speculation.draft_model", type=str,
               help="draft model (HF dir or .gguf) for --spec draft; a head directory from "
               "`specd train-draft` for --spec eagle (default: the head shipped for the model)"),
    ConfigFlag("--draft-layers", "speculation.draft_layers", type=int, help="layers used by --spec layerskip"),
    ConfigFlag("--ngram-min", "speculation.ngram_min_match"),
    ConfigFlag("--ngram-max", "speculation.ngram_max_match"),
    ConfigFlag("--confidence-threshold", "speculation.confidence_threshold"),
    ConfigFlag("--hybrid-min-match", "speculation.hybrid_min_match",
               help="--spec hybrid: take ngram's draft when its matched suffix is at least this long, else eagle's"),
    ConfigFlag("--spec-trace", "spec_trace_path", type=str, metavar="FILE",
               help="write one JSON line per (step, request)"),
    ConfigFlag("--log-stats-interval", "log_stats_interval_s", help="seconds between metric log lines"),
)
MAX_WAITING_FLAG = ConfigFlag(
    "--max-waiting", "max_waiting",
    help="waiting-queue limit; beyond it requests get 503 + Retry-After (0 = unbounded)",
)
_ALL_FLAGS = (*MODEL_FLAGS, *SPECULATION_FLAGS, MAX_WAITING_FLAG)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, engine and speculation flags shared by `generate` and `serve`."""
    model_group = parser.add_argument_group("model and engine")
    for flag in MODEL_FLAGS:
        flag.add_to(model_group)
    spec_group = parser.add_argument_group("speculation")
    for flag in SPECULATION_FLAGS:
        flag.add_to(spec_group)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe (flags a command does not have keep the config's default).
    Raises InvalidParameterError naming the config field of a bad value."""
    engine: dict[str, Any] = {}
    speculation: dict[str, Any] = {}
    for flag in _ALL_FLAGS:
        if hasattr(args, flag.dest):
            if flag.field.startswith("speculation."):
                speculation[flag.field.split(".", 1)[1]] = getattr(args, flag.dest)
            else:
                engine[flag.field] = getattr(args, flag.dest)
    return EngineConfig(speculation=SpeculationConfig(**speculation), **engine)
