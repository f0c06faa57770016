"""Per-request sampling parameters, validated at construction.

Every field is honoured by the engine; nothing here is accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specd.errors import InvalidParameterError
from specd.speculation.k_policy import MAX_NUM_SPECULATIVE_TOKENS
from specd.speculation.policies import K_POLICIES

_MAX_LOGPROBS = 20


# Temperatures below this count as greedy (see SamplingParams.greedy).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SpecOverride:
    """Per-request override of the engine's speculation settings.

    enabled=False turns speculation off for this request (k_i = 0 every step).
    num_speculative_tokens caps k for this request (must be <= the engine's k_max).
    k_policy, when set: a registered k policy ("fixed", "heuristic", "confidence", "goodput") that works with the
    engine's proposer (goodput needs ngram, confidence a model-based proposer); the engine checks that when the
    request is added.
    """

    enabled: bool = True
    num_speculative_tokens: int | None = None
    k_policy: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InvalidParameterError("speculation.enabled", "must be a boolean")
        k = self.num_speculative_tokens
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or k < 0 or k > MAX_NUM_SPECULATIVE_TOKENS
        ):
            raise InvalidParameterError(
                "speculation.num_speculative_tokens", f"must be an integer in [0, {MAX_NUM_SPECULATIVE_TOKENS}]"
            )
        if self.k_policy is not None and self.k_policy not in K_POLICIES:
            raise InvalidParameterError(
                "speculation.k_policy", f"must be one of {', '.join(repr(name) for name in K_POLICIES)}"
            )


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output (grammar-constrained decoding, specd.sampling.grammar).

    kind "json_schema" (value: the schema, a dict), "json_object" (value: None; any JSON object), "regex" (value:
    a pattern), "choice" (value: a list of strings) or "grammar" (value: a Lark grammar). `field` names the API
    field that asked for it, so errors about the value point at what the client sent.
    """

    kind: str
    value: Any = None
    field: str = "structured_output"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidParameterError(self.field, f"kind must be one of {', '.join(STRUCTURED_KINDS)}")
        expected: type | tuple[type, ...] = {
            "json_schema": (dict, bool), "json_object": type(None), "regex": str, "choice": (list, tuple),
            "grammar": str,
        }[self.kind]
        if not isinstance(self.value, expected):
            raise InvalidParameterError(self.field, f"a {self.kind} constraint needs a value of type {expected}")


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidParameterError(name, f"must be {bound}, got {value}")


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, f"must be a number, got {type(value).__name__}")
    v = float(value)
    if v != v or v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise InvalidParameterError(name, f"must be in {left}{lo}, {hi}], got {value}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's continuation.

    temperature == 0 means greedy (argmax); top_k <= 0 disables top-k; top_p == 1 and min_p == 0 disable
    those filters. `seed` gives the request its own torch.Generator, so its output does not depend on what
    else is in the batch. `logprobs=None` returns none, 0 returns the chosen token's logprob, n > 0 also the
    top-n alternatives (log-softmax of the raw target logits).

    presence_penalty / frequency_penalty (OpenAI, [-2, 2], 0 = off), repetition_penalty (vLLM, (0, 2], 1 = off) and
    logit_bias ({token id: bias in [-100, 100]}) change the distribution before temperature and the filters,
    identically with and without speculation (specd.sampling.penalties). `structured` constrains the output to a
    JSON schema, a regex, a choice or a grammar; every verified row is masked, so speculation stays exact.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    speculation: SpecOverride | None = None
    spec_detail: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, -1)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameterError("stop", "must be a list of non-empty strings")
        if isinstance(self.stop_token_ids, (str, bytes)):
            raise InvalidParameterError("stop_token_ids", "must be a list of token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, _MAX_LOGPROBS)
        if self.speculation is not None and not isinstance(self.speculation, SpecOverride):
            raise InvalidParameterError("speculation", "must be a SpecOverride")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise InvalidParameterError("structured", "must be a StructuredOutput")
            if self.ignore_eos:
                raise InvalidParameterError("ignore_eos", "cannot be combined with a structured output, which ends on "
                                            "end-of-sequence once the constraint is complete")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise InvalidParameterError("logit_bias", "must be a mapping of token id to bias")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias", token, 0)
                _check_float(f"logit_bias[{token}]", bias, -100.0, 100.0)

    @property
    def greedy(self) -> bool:
        """The processed distribution is one-hot at the argmax: temperature 0, or below MIN_TEMPERATURE, where
        logits / T would overflow float32 and the T -> 0 limit is the argmax anyway."""
        return self.temperature < MIN_TEMPERATURE
