"""What the engine hands back: per-step deltas for streaming and finished outputs in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from specd.metrics.stats import RequestSpecStats

# Why a request ended: "stop" (EOS, a stop token or string), "length" (max_tokens or max_model_len), "abort"
# (aborted by its caller), "error" (its step failed).
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-softmax of the raw target logits: the chosen token and, if asked, the top-n alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestTimings:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_steps: int

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one step added to one request (streaming). Empty token lists are possible while prefilling."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    spec_stats: RequestSpecStats | None = None
    error: str | None = None
    timings: RequestTimings | None = None  # set on the final delta


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request, shaped like vLLM's: `outputs[0].text`, `.token_ids`, `.finish_reason`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_stats: RequestSpecStats | None
    timings: RequestTimings
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text
