"""Frozen, validated configuration of the engine and of speculation. A bad value fails here, naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.errors import InvalidParameterError

SPEC_METHODS = ("off", "ngram", "draft", "layerskip")
K_POLICIES = ("fixed", "heuristic", "confidence", "goodput")
# "int4": weight-only int4 (group 32) for decode-sized matmuls, bfloat16 activations and dense fallback.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int4": torch.bfloat16, "float64": torch.float64}


def _positive_int(name: str, value: object, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidParameterError(name, f"must be an integer >= {lo}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """How the engine speculates.

    method: "off", "ngram" (prompt lookup), "draft" (a separate small model sharing the vocabulary) or
    "layerskip" (the target's first `draft_layers` layers + its final norm and LM head).
    num_speculative_tokens: k_max, the most draft tokens per sequence per step.
    k_policy: "fixed" (k_i = k_max), "heuristic" (+2 after a fully accepted draft, -1 otherwise, per
    sequence, within [0, k_max]; a sequence at 0 probes again with k = 1 after `heuristic_probe_interval`
    steps), "confidence" (model-based proposers stop drafting before a position where the draft's top
    probability -- of its raw distribution, read before sampling -- falls below `confidence_threshold`; lossless
    for sampled requests too) or "goodput" (ngram: each step, verify only the draft tokens
    whose expected acceptance, learned online per match length, pays for their measured verification cost;
    see specd/speculation/goodput.py).
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

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise InvalidParameterError("speculation.method", f"must be one of {', '.join(SPEC_METHODS)}")
        _positive_int("speculation.num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > 64:
            raise InvalidParameterError("speculation.num_speculative_tokens", "must be <= 64")
        if self.k_policy not in K_POLICIES:
            raise InvalidParameterError("speculation.k_policy", f"must be one of {', '.join(K_POLICIES)}")
        _positive_int("speculation.ngram_min_match", self.ngram_min_match)
        _positive_int("speculation.ngram_max_match", self.ngram_max_match)
        if self.ngram_min_match > self.ngram_max_match:
            raise InvalidParameterError("speculation.ngram_min_match", "must be <= ngram_max_match")
        if self.method == "draft" and not self.draft_model:
            raise InvalidParameterError("speculation.draft_model", "is required when method is 'draft'")
        if self.draft_layers is not None:
            _positive_int("speculation.draft_layers", self.draft_layers)
        if not (0.0 < self.confidence_threshold < 1.0):
            raise InvalidParameterError("speculation.confidence_threshold", "must be in (0, 1)")
        if self.k_policy == "confidence" and self.method == "ngram":
            raise InvalidParameterError(
                "speculation.k_policy", "'confidence' needs a model-based proposer (draft or layerskip)"
            )
        if self.k_policy == "goodput" and self.method != "ngram":
            raise InvalidParameterError(
                "speculation.k_policy", "'goodput' needs the ngram proposer, whose drafts cost nothing to cut"
            )
        _positive_int("speculation.heuristic_probe_interval", self.heuristic_probe_interval)

    @property
    def enabled(self) -> bool:
        return self.method != "off"

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
    (0 = unbounded); beyond it add_request raises QueueFullError.
    """

    model: str = "default"
    dtype: str = "float32"
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    max_waiting: int = 0
    seed: int = 0
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    log_stats_interval_s: float = 0.0
    spec_trace_path: str | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidParameterError("model", "must be a non-empty string")
        if self.dtype not in DTYPES:
            raise InvalidParameterError("dtype", f"must be one of {', '.join(DTYPES)}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len, 2)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < max(self.max_num_seqs, self.speculation.num_speculative_tokens + 1):
            raise InvalidParameterError(
                "max_num_batched_tokens",
                "must be at least max_num_seqs (one token per running sequence) and num_speculative_tokens + 1",
            )
        _positive_int("max_waiting", self.max_waiting, 0)
        if self.log_stats_interval_s < 0:
            raise InvalidParameterError("log_stats_interval_s", "must be >= 0")
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if not isinstance(self.speculation, SpeculationConfig):
            raise InvalidParameterError("speculation", "must be a SpeculationConfig")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def int4_weights(self) -> bool:
        return self.dtype == "int4"
