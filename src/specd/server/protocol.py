"""OpenAI-compatible request and response bodies (pydantic), plus specd's extension fields.

Requests are parsed strictly (`extra="forbid"`, no string-to-number coercion): a field we do not
implement, such as `presence_penalty`, is an error naming it rather than something silently ignored.
A field that accepts several JSON shapes says which in its `description`, the text its type error shows.
Responses mirror OpenAI's shapes; `usage.speculative_decoding` is the one addition.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16  # n per prompt: each choice is a separate engine request holding a KV slot


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ------------------------------------------------------------------------------------------ requests
class SpeculationOptions(_Strict):
    """Extension: per-request override of the engine's speculation (maps to SpecOverride)."""

    enabled: bool = True
    num_speculative_tokens: int | None = None
    k_policy: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    # We never pad chunks, so only `false` (or absent) is meaningful; `true` is rejected by the server.
    include_obfuscation: bool | None = None


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, description="a string or a list of strings")
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for client compatibility; it never influences generation
    # specd extensions (vLLM spells the first three the same way)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    speculation: SpeculationOptions | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists"
    )
    logprobs: int | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextContentPart] = Field(
        description='a string or a list of text parts ({"type": "text", "text": "..."}); image, audio and file '
        "parts are not supported"
    )

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ----------------------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo


class SpeculativeDecodingUsage(BaseModel):
    """Speculation counters of one request, summed over its choices; ratios are of the sums (pooled)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    acceptance_rate: float | None  # accepted_tokens / draft_tokens
    mean_accepted_length: float | None  # accepted_tokens / drafts (bonus token excluded)
    mean_acceptance_length: float | None  # tau = 1 + accepted_tokens / drafts


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative_decoding: SpeculativeDecodingUsage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specd"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SpeculationInfo(BaseModel):
    method: str
    num_speculative_tokens: int
    k_policy: str


class EngineStateInfo(BaseModel):
    num_running: int
    num_waiting: int
    kv_used_slots: int
    kv_free_slots: int
    num_in_line: int  # waiting in the admission line for room in the waiting queue


class SpecStatsResponse(BaseModel):
    """GET /v1/spec/stats: the config, the engine after its latest step, and LLM.get_metrics()."""

    model: str
    speculation: SpeculationInfo
    engine: EngineStateInfo
    uptime_s: float
    metrics: dict[str, Any]
