"""Frozen, validated configuration of the engine and of speculation. A bad value fails here, naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from specd.errors import InvalidParameterError, require_int
from specd.speculation.k_policy import MAX_NUM_SPECULATIVE_TOKENS
from specd.speculation.ngram import check_match_lengths
from specd.speculation.policies import K_POLICIES
from specd.speculation.registry import PROPOSERS, k_policy_unsupported, supporting_methods

# "int4" (the default, the fastest on CPU): weight-only int4 (group 32) projections and an int8 LM head, bfloat16
# activations. "float32" is the exact mode (greedy speculation token-identical to plain decoding);
# "float64" is for tests.
DType = Literal["float32", "bfloat16", "int4", "float64"]
DTYPES: dict[str, torch.dtype] = dict(
    zip(get_args(DType), (torch.float32, torch.bfloat16, torch.bfloat16, torch.float64), strict=True)
)
# How the engine's CPU threads are counted (specd/threads.py): "adaptive" runs as many as the cores other processes
# leave free, measured every half second; "fixed" always runs num_threads (or every available CPU).
ThreadPolicy = Literal["adaptive", "fixed"]
# `method` value that turns speculation off; every other value names a registered proposer.
SPEC_OFF = "off"
# The log line runs on its own timer thread: a shorter interval would mostly log its own overhead.
MIN_LOG_STATS_INTERVAL_S = 0.01


def spec_methods() -> list[str]:
    """Every valid SpeculationConfig.method: "off" and the registered proposers."""
    return [SPEC_OFF, *PROPOSERS]


def k_policies() -> list[str]:
    """Every valid k policy name (the registry's)."""
    return list(K_POLICIES)


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """How the engine speculates.

    method: "off" or a registered proposer (speculation/registry.py): "ngram" (prompt lookup), "draft" (a
    separate small model sharing the vocabulary), "layerskip" (the target's first `draft_layers` layers + its
    final norm and LM head) or "eagle" (a draft head trained for the target by `specd train-draft`: the one in
    `draft_model`, or the one shipped for the default model) or "hybrid" (ngram's draft where its matched suffix is
    at least `hybrid_min_match` tokens, eagle's elsewhere).
    num_speculative_tokens: k_max, the most draft tokens per sequence per step (<= 64).
    k_policy: a registered k policy (speculation/policies/), which declares the proposers it works with:
    "fixed" (k_i = k_max), "heuristic" (+2 after a fully accepted draft, -1 otherwise, per sequence, within
    [0, k_max]; a sequence at 0 probes again with k = 1 after `heuristic_probe_interval` steps), "confidence"
    (model-based proposers stop drafting before a position where the draft's top probability -- of its raw
    distribution, read before sampling -- falls below `confidence_threshold`; lossless for sampled requests too)
    "goodput" (ngram: each step, verify only the draft tokens whose expected acceptance, learned online per
    match length, pays for their measured verification cost; see speculation/policies/goodput.py) or "adaptive"
    (every proposer: the k_i maximising expected tokens per second from the step cost measured at this batch
    size, each sequence's acceptance and the drafting cost, 0 under load; see speculation/policies/adaptive.py).
    """

    method: str = "off"
    num_speculative_tokens: int = 4
    k_policy: str = "fixed"
    ngram_min_match: int = 1
    ngram_max_match: int = 4
    draft_model: str | None = None
    draft_layers: int | None = None
    confidence_threshold: float = 0.5
    heuristic_probe_interval: int = 8
    hybrid_min_match: int = 3

    def __post_init__(self) -> None:
        if self.method not in spec_methods():
            raise InvalidParameterError("speculation.method", f"must be one of {', '.join(spec_methods())}")
        require_int("speculation.num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_NUM_SPECULATIVE_TOKENS:
            raise InvalidParameterError(
                "speculation.num_speculative_tokens", f"must be <= {MAX_NUM_SPECULATIVE_TOKENS}"
            )
        if self.k_policy not in K_POLICIES:
            raise InvalidParameterError("speculation.k_policy", f"must be one of {', '.join(k_policies())}")
        check_match_lengths(
            self.ngram_min_match, self.ngram_max_match, "speculation.ngram_min_match", "speculation.ngram_max_match"
        )
        if self.method == "draft" and not self.draft_model:
            raise InvalidParameterError("speculation.draft_model", "is required when method is 'draft'")
        if self.draft_layers is not None:
            require_int("speculation.draft_layers", self.draft_layers)
        if not (0.0 < self.confidence_threshold < 1.0):
            raise InvalidParameterError("speculation.confidence_threshold", "must be in (0, 1)")
        if self.enabled:
            reason = k_policy_unsupported(self.k_policy, PROPOSERS[self.method].traits)
            if reason is not None:
                works_with = ", ".join(supporting_methods(self.k_policy)) or "no registered proposer"
                raise InvalidParameterError(
                    "speculation.k_policy",
                    f"{self.k_policy!r} does not work with the {self.method!r} proposer: {reason} ({works_with})",
                )
        require_int("speculation.heuristic_probe_interval", self.heuristic_probe_interval)
        require_int("speculation.hybrid_min_match", self.hybrid_min_match)
        if self.method == "hybrid" and self.hybrid_min_match > self.ngram_max_match:
            raise InvalidParameterError(
                "speculation.hybrid_min_match",
                f"must be <= speculation.ngram_max_match ({self.ngram_max_match}): a longer match is never found",
            )

    @property
    def enabled(self) -> bool:
        return self.method != SPEC_OFF

    @property
    def metrics_k_max(self) -> int:
        """Positions the metrics keep: k_max, and at least one so the layout is fixed even with speculation off."""
        return max(1, self.num_speculative_tokens)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine limits and options.

    max_num_seqs: sequences running at once (KV-cache slots). max_model_len: prompt + output tokens per
    sequence. max_num_batched_tokens: token budget of one step (decode + draft tokens + prefill chunks);
    a prompt longer than what is left is prefilled in chunks across steps. max_waiting: queue limit
    (0 = unbounded); beyond it add_request raises QueueFullError. num_threads: the most CPU threads a forward
    uses (None: torch's setting when the engine is built, capped by the CPUs the process may run on and its
    cgroup quota); thread_policy: "adaptive" lowers that to the cores other processes leave free, "fixed"
    keeps it.
    """

    model: str = "default"
    dtype: DType = "int4"
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    max_waiting: int = 0
    seed: int = 0
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    log_stats_interval_s: float = 0.0
    spec_trace_path: str | None = None
    num_threads: int | None = None
    thread_policy: ThreadPolicy = "adaptive"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidParameterError("model", "must be a non-empty string")
        if self.dtype not in DTYPES:
            raise InvalidParameterError("dtype", f"must be one of {', '.join(get_args(DType))}")
        require_int("max_num_seqs", self.max_num_seqs)
        require_int("max_model_len", self.max_model_len, 2)
        require_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < max(self.max_num_seqs, self.speculation.num_speculative_tokens + 1):
            raise InvalidParameterError(
                "max_num_batched_tokens",
                "must be at least max_num_seqs (one token per running sequence) and num_speculative_tokens + 1",
            )
        require_int("max_waiting", self.max_waiting, 0)
        if not (self.log_stats_interval_s == 0 or MIN_LOG_STATS_INTERVAL_S <= self.log_stats_interval_s < math.inf):
            raise InvalidParameterError(
                "log_stats_interval_s", f"must be 0 (off) or a finite number of seconds >= {MIN_LOG_STATS_INTERVAL_S}"
            )
        if self.num_threads is not None:
            require_int("num_threads", self.num_threads)
        if self.thread_policy not in get_args(ThreadPolicy):
            raise InvalidParameterError("thread_policy", f"must be one of {', '.join(get_args(ThreadPolicy))}")
        if not isinstance(self.speculation, SpeculationConfig):
            raise InvalidParameterError("speculation", "must be a SpeculationConfig")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def int4_weights(self) -> bool:
        return self.dtype == "int4"

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype checkpoints are read in: int4 quantizes from float32 weights, so that a Q4_1 GGUF's 4-bit
        codes are recovered exactly before the bfloat16 cast."""
        return torch.float32 if self.int4_weights else self.torch_dtype
