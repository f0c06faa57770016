"""/v1/completions and /v1/chat/completions: request -> engine requests (one per choice) -> response.

A request with P prompts and n choices becomes P * n engine requests, added all-or-nothing; choice
`p * n + i` is prompt p's i-th sample and, when `seed` is given, uses `seed + i` (so a seeded n = 2 is
reproducible and its two choices differ).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import NamedTuple, TypeVar, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from specd.errors import InvalidParameterError
from specd.llm import LLM, Prompt
from specd.sampling.params import SamplingParams, SpecOverride
from specd.server.async_engine import AsyncEngine, DeltaStream, EngineRequest, EngineStoppedError
from specd.server.errors import APIError, bad_request, from_engine_error, from_validation_error
from specd.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    SamplingRequest,
)
from specd.server.render import ChatRenderer, ChoiceState, CompletionRenderer, Renderer, request_usage

_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to "what fits"
_RequestT = TypeVar("_RequestT", bound=BaseModel)


class _FieldNames(NamedTuple):
    """Request field names that engine errors are reported under (they differ between endpoints)."""

    prompt: str
    max_tokens: str
    logprobs: str

    def engine_to_request(self) -> dict[str, str]:
        return {"prompt_token_ids": self.prompt, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "logprobs": self.logprobs}


def parse_request(body: bytes, model: type[_RequestT]) -> _RequestT:
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise from_validation_error(exc, model) from None


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine deltas into OpenAI responses."""

    def __init__(self, llm: LLM, engine: AsyncEngine, model_name: str) -> None:
        self._llm = llm
        self._engine = engine
        self.model_name = model_name
        self._max_model_len = llm.config.max_model_len

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: bytes, http_request: Request) -> Response:
        request = parse_request(body, CompletionRequest)
        self._check_common(request)
        names = _FieldNames("prompt", "max_tokens", "logprobs")
        prompts = self._completion_prompts(request.prompt, names)
        renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                                      request.logprobs, self._llm.tokenizer)
        return await self._generate(request, prompts, names, renderer, http_request)

    async def chat(self, body: bytes, http_request: Request) -> Response:
        request = parse_request(body, ChatCompletionRequest)
        self._check_common(request)
        max_field = "max_tokens"
        if request.max_completion_tokens is not None:
            if request.max_tokens is not None:
                raise bad_request("give max_completion_tokens or max_tokens, not both", "max_completion_tokens")
            request = request.model_copy(update={"max_tokens": request.max_completion_tokens})
            max_field = "max_completion_tokens"
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        names = _FieldNames("messages", max_field, "top_logprobs")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, top_logprobs,
                                self._llm.tokenizer)
        return await self._generate(request, [self._chat_prompt(request, names)], names, renderer, http_request)

    async def _generate(
        self, request: SamplingRequest, prompts: list[Prompt], names: _FieldNames, renderer: Renderer,
        http_request: Request,
    ) -> Response:
        engine_requests = self._engine_requests(renderer.response_id, request, prompts, renderer.top_logprobs,
                                                names)
        try:
            stream = await self._engine.add_requests(engine_requests)
        except EngineStoppedError as exc:
            raise APIError(503, str(exc), error_type="service_unavailable_error", code="engine_stopped") from None
        except Exception as exc:
            raise from_engine_error(exc, names.engine_to_request()) from None
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            events = self._events(stream, http_request, renderer, num_prompt_tokens, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        choices = await self._collect(stream, http_request)
        body = renderer.response(choices, request_usage(num_prompt_tokens, choices, self._k_max))
        # pydantic writes non-finite floats (a -inf logprob) as null; json.dumps would write invalid JSON.
        return Response(body.model_dump_json(), media_type="application/json")

    @property
    def _k_max(self) -> int:
        return self._llm.config.speculation.metrics_k_max

    # ------------------------------------------------------------------ request -> engine requests
    def _check_common(self, request: SamplingRequest) -> None:
        if request.model is not None and request.model != self.model_name:
            raise APIError(404, f"model '{request.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if request.stream_options is not None:
            if not request.stream:
                raise bad_request("stream_options is only allowed with stream: true", "stream_options")
            if request.stream_options.include_obfuscation:
                raise bad_request("stream obfuscation is not supported", "stream_options.include_obfuscation")

    def _completion_prompts(
        self, prompt: str | list[int] | list[str] | list[list[int]], names: _FieldNames
    ) -> list[Prompt]:
        if isinstance(prompt, str):
            return [self._prompt(prompt, None, names)]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):  # the schema allows no mixed lists
            return [self._prompt(None, cast(list[int], prompt), names)]
        return [self._prompt(p, None, names) if isinstance(p, str) else self._prompt(None, p, names)
                for p in cast(list[str | list[int]], prompt)]

    def _prompt(self, text: str | None, token_ids: list[int] | None, names: _FieldNames) -> Prompt:
        """Tokenized and validated once, here; the engine takes the Prompt as it is."""
        if token_ids is None and self._llm.tokenizer is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", "prompt")
        try:
            return self._llm.prompt(text, token_ids)
        except InvalidParameterError as exc:
            raise from_engine_error(exc, names.engine_to_request()) from None

    def _chat_prompt(self, request: ChatCompletionRequest, names: _FieldNames) -> Prompt:
        if self._llm.tokenizer is None:
            raise bad_request("this model has no tokenizer / chat template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            return self._llm.chat_prompt(messages)
        except InvalidParameterError as exc:
            raise from_engine_error(exc, names.engine_to_request()) from None

    def _engine_requests(
        self, response_id: str, request: SamplingRequest, prompts: list[Prompt], logprobs: int | None,
        names: _FieldNames,
    ) -> list[EngineRequest]:
        rename = names.engine_to_request()
        out: list[EngineRequest] = []
        for prompt_index, prompt in enumerate(prompts):
            room = self._max_model_len - len(prompt.token_ids)  # >= 1: the prompt was validated
            max_tokens = request.max_tokens
            if max_tokens is None:
                chat = isinstance(request, ChatCompletionRequest)
                max_tokens = room if chat else min(_DEFAULT_COMPLETION_MAX_TOKENS, room)
            elif max_tokens > room:
                raise APIError(
                    400, f"{names.max_tokens}: {max_tokens} does not fit: the prompt has {len(prompt.token_ids)} "
                    f"tokens and max_model_len is {self._max_model_len} (at most {room} can be generated)",
                    param=names.max_tokens, code="context_length_exceeded",
                )
            try:
                params = _sampling_params(request, max_tokens, logprobs)
                for sample in range(request.n):
                    seeded = params if params.seed is None else replace(params, seed=params.seed + sample)
                    index = prompt_index * request.n + sample
                    out.append(EngineRequest(f"{response_id}-{index}", prompt, seeded))
            except InvalidParameterError as exc:
                raise from_engine_error(exc, rename) from None
        return out

    # ------------------------------------------------------------------ engine deltas -> HTTP
    async def _collect(self, stream: DeltaStream, http_request: Request) -> list[ChoiceState]:
        """Every choice to its end. A client that disconnects aborts them (their KV slots free at once)."""
        choices = [ChoiceState(i) for i in range(len(stream.request_ids))]
        by_id = dict(zip(stream.request_ids, choices))
        watcher = asyncio.create_task(_abort_on_disconnect(http_request, stream))
        try:
            async for delta in stream:
                by_id[delta.request_id].add(delta)
                if delta.error is not None:
                    raise APIError(500, f"generation failed: {delta.error}", error_type="server_error",
                                   code="internal_error")
        finally:
            watcher.cancel()
            stream.abort()  # no-op unless we leave early (error, cancellation)
        return choices

    async def _events(
        self, stream: DeltaStream, http_request: Request, renderer: Renderer, num_prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """SSE frames. The choices are aborted if the client goes away or the generator is closed early."""
        choices = [ChoiceState(i) for i in range(len(stream.request_ids))]
        by_id = dict(zip(stream.request_ids, choices))
        watcher = asyncio.create_task(_abort_on_disconnect(http_request, stream))
        try:
            for payload in renderer.preamble(len(choices)):
                yield _frame(payload)
            async for delta in stream:
                choice = by_id[delta.request_id]
                if delta.finished:
                    choice.final = delta
                if delta.error is not None:
                    error = ErrorInfo(message=f"generation failed: {delta.error}", type="server_error",
                                      code="internal_error")
                    yield _frame(f'{{"error": {error.model_dump_json()}}}')
                    break
                if renderer.worth_sending(delta):
                    yield _frame(renderer.chunk(choice, delta))
            else:
                if include_usage:
                    yield _frame(renderer.usage_chunk(request_usage(num_prompt_tokens, choices, self._k_max)))
            yield _frame("[DONE]")
        finally:
            watcher.cancel()
            stream.abort()


def _sampling_params(request: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    spec = request.speculation
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=request.seed,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        speculation=None if spec is None else SpecOverride(
            enabled=spec.enabled, num_speculative_tokens=spec.num_speculative_tokens, k_policy=spec.k_policy
        ),
    )


async def _abort_on_disconnect(http_request: Request, stream: DeltaStream) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or the end of the response,
    # by which time this task has been cancelled).
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            stream.abort()
            return


def _frame(payload: str) -> str:
    return f"data: {payload}\n\n"
