"""OpenAI-compatible request and response bodies (pydantic), plus specd's extension fields.

Requests are parsed strictly (`extra="forbid"`, no string-to-number coercion): a field we do not know is an error
naming it rather than something silently ignored. Known fields are judged by value in fields.py (a neutral value is a
no-op, a value specd cannot honour is a 400). A field that accepts several JSON shapes says which in its
`description`, the text its type error shows. Responses mirror OpenAI's shapes; `usage.speculative_decoding` is the
one addition.
"""

from __future__ import annotations

import json
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(default=None, description="an object of token id (a string) to bias")
    # Metadata only: accepted, never influences generation (fields.METADATA_FIELDS).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # specd extensions (vLLM spells all but `speculation` the same way)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    speculation: SpeculationOptions | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists"
    )
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[TextContentPart] | None = Field(
        default=None,
        description='a string or a list of text parts ({"type": "text", "text": "..."}); image, audio and file '
        "parts are not supported; null only in an assistant message",
    )
    name: str | None = None  # metadata only (OpenAI lets participants of one role be told apart)
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages

    def text(self, call_tag: str = "") -> str:
        """The content as the chat template sees it; an assistant's tool calls are written as the JSON they were
        generated as (`call_tag`, then a list of {"name", "arguments"} objects)."""
        if isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text for part in self.content or [])
        if self.tool_calls:
            calls = [{"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}
                     for c in self.tool_calls]
            text += call_tag + json.dumps(calls)
        return text


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class JSONSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # specd always enforces the schema, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # specd always enforces the parameters schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    )
    parallel_tool_calls: bool | None = None


# ----------------------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo


class SpeculativeDecodingUsage(BaseModel):
    """Speculation counters of one HTTP request, summed over its choices; ratios are of the sums (pooled)."""

    choices: int  # engine requests (prompts x n) these counters sum over
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    acceptance_rate: float | None  # accepted_tokens / draft_tokens
    accepted_tokens_per_draft: float | None  # accepted_tokens / drafts (bonus token excluded)
    mean_accepted_length: float | None  # deprecated alias of accepted_tokens_per_draft, kept one release
    mean_acceptance_length: float | None  # tau = 1 + accepted_tokens / drafts


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative_decoding: SpeculativeDecodingUsage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing precedes it)
    top_logprobs: list[dict[str, float] | None] | None
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
    content: str | None
    tool_calls: list[ToolCall] | None = None


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


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
    num_threads: int  # CPU threads the forwards run now
    free_cpus: float | None  # cores other processes left free in the last half second (None: not measured)


class SpecStatsResponse(BaseModel):
    """GET /v1/spec/stats: the config, the engine after its latest step, and LLM.get_metrics()."""

    model: str
    speculation: SpeculationInfo
    engine: EngineStateInfo
    uptime_s: float
    metrics: dict[str, Any]
