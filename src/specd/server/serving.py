"""/v1/completions and /v1/chat/completions: request -> engine requests (one per choice) -> response.

A request with P prompts and n choices becomes P * n engine requests, added all-or-nothing; choice
`p * n + i` is prompt p's i-th sample and, when `seed` is given, uses `seed + i` (so a seeded n = 2 is
reproducible and its two choices differ).

Parsing, chat-template rendering and tokenization run on a worker thread, never on the event loop: a large
prompt must not stall /health or other streams. Prompt text longer than max_model_len tokens could possibly
cover is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import NamedTuple, TypeVar, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from specd.engine.outputs import RequestDelta
from specd.errors import InvalidParameterError
from specd.llm import LLM, Prompt
from specd.sampling.params import SamplingParams, SpecOverride
from specd.server.async_engine import AsyncEngine, DeltaStream, EngineRequest, EngineStoppedError, cut_by_shutdown
from specd.server.errors import APIError, bad_request, from_engine_error, invalid_request, validation_offenses
from specd.server.fields import judge
from specd.server.guards import ClientDisconnected
from specd.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from specd.server.render import (
    ChatRenderer,
    ChoiceState,
    CompletionRenderer,
    EchoedPrompt,
    Renderer,
    request_usage,
)
from specd.server.structured import (
    TOOL_CALL_TAG,
    auto_tools,
    calls_tools,
    structured_output,
    tool_result_as_user,
    with_tool_instructions,
)

_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to "what fits"
_RequestT = TypeVar("_RequestT", bound=BaseModel)
IGNORED_FIELDS_HEADER = "x-specd-ignored-fields"

logger = logging.getLogger("specd.server")


class PromptInput(NamedTuple):
    text: str | None
    token_ids: list[int]


class _FieldNames(NamedTuple):
    """Request field names that engine errors are reported under (they differ between endpoints)."""

    prompt: str
    max_tokens: str
    logprobs: str

    def engine_to_request(self) -> dict[str, str]:
        return {"prompt_token_ids": self.prompt, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "logprobs": self.logprobs}


class _Prepared(NamedTuple):
    """A parsed, validated and tokenized request, ready for the engine."""

    request: SamplingRequest
    engine_requests: list[EngineRequest]
    num_prompt_tokens: int  # each prompt once (usage.prompt_tokens)
    names: _FieldNames
    renderer: Renderer
    ignored: list[str]  # metadata fields the request carried (x-specd-ignored-fields)


def parse_request(body: bytes, model: type[_RequestT]) -> tuple[_RequestT, list[str]]:
    """The validated request and the metadata fields it carried. Every field specd cannot honour -- unknown, of the
    wrong type, or of a value it cannot honour (fields.judge) -- is listed in one 400."""
    request: _RequestT | None = None
    try:
        request = model.model_validate_json(body, strict=True)
        offenses = []
    except ValidationError as exc:
        offenses = validation_offenses(exc, model)  # raises at once for malformed JSON
    try:
        decoded = json.loads(body)
    except ValueError:  # pydantic's JSON parser took it, the standard one does not: nothing to judge by value
        decoded = None
    judgement = judge(decoded, chat=issubclass(model, ChatCompletionRequest))
    offenses += [o for o in judgement.offenses if all(o.param != seen.param for seen in offenses)]
    if offenses or request is None:
        raise invalid_request(offenses)
    return request, judgement.ignored


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine deltas into OpenAI responses.

    queue_timeout_s: how long a request that finds the waiting queue full waits in line for room (0: it gets
    503 at once). split_special_tokens: control-token strings in client text are plain text (the safe
    default); False honours them as control tokens (`--parse-special-tokens`).
    """

    def __init__(self, llm: LLM, engine: AsyncEngine, model_name: str, queue_timeout_s: float = 0.0,
                 split_special_tokens: bool = True) -> None:
        self._llm = llm
        self._engine = engine
        self.model_name = model_name
        self._max_model_len = llm.config.max_model_len
        self._queue_timeout_s = queue_timeout_s
        self._split_special_tokens = split_special_tokens
        self._max_token_chars: int | None = None
        self._logged_ignored: set[str] = set()  # ignored metadata fields are logged once per name
        self._logged_lock = threading.Lock()  # requests are prepared on worker threads
        if llm.tokenizer is not None:
            llm.tokenizer.warm_up()  # here, not on the first request (it holds the GIL for a while)
            self._max_token_chars = llm.tokenizer.max_token_chars

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: bytes, http_request: Request) -> Response:
        return await self._generate(await asyncio.to_thread(self._prepare_completion, body), http_request)

    async def chat(self, body: bytes, http_request: Request) -> Response:
        return await self._generate(await asyncio.to_thread(self._prepare_chat, body), http_request)

    # ------------------------------------------------------------------ request -> engine requests (worker thread)
    def _prepare_completion(self, body: bytes) -> _Prepared:
        request, ignored = parse_request(body, CompletionRequest)
        self._check_common(request)
        names = _FieldNames("prompt", "max_tokens", "logprobs")
        prompt = request.prompt
        num_prompts = 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)
        self._check_capacity(num_prompts, request.n, names)  # before tokenizing any of them
        prompts = self._completion_prompts(prompt)
        renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                                      request.logprobs, self._llm.tokenizer, None, request.n)
        prepared = self._prepared(request, prompts, names, renderer, ignored)
        if request.echo:
            # After the engine requests are built, so their checks (logprobs range, lengths) come first.
            renderer.set_echo([self._echoed(p, r.prompt, request.logprobs)
                               for p, r in zip(prompts, prepared.engine_requests[:: request.n])])
        return prepared

    def _prepare_chat(self, body: bytes) -> _Prepared:
        request, ignored = parse_request(body, ChatCompletionRequest)
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
        self._check_capacity(1, request.n, names)
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, top_logprobs,
                                self._llm.tokenizer, request if calls_tools(request) else None)
        return self._prepared(request, [self._chat_prompt(request)], names, renderer, ignored)

    def _prepared(self, request: SamplingRequest, inputs: list[PromptInput], names: _FieldNames,
                  renderer: Renderer, ignored: list[str]) -> _Prepared:
        prompts = [self._validated(p, names) for p in inputs]
        engine_requests = self._engine_requests(renderer.response_id, request, prompts, renderer.top_logprobs,
                                                names)
        self._log_ignored(ignored)
        return _Prepared(request, engine_requests, sum(len(p.token_ids) for p in prompts), names, renderer, ignored)

    def _log_ignored(self, ignored: list[str]) -> None:
        with self._logged_lock:
            new = [name for name in ignored if name not in self._logged_ignored]
            self._logged_ignored.update(new)
        for name in new:
            logger.warning("request field '%s' is accepted but never used for generation (metadata); it is listed in "
                           "the %s response header (logged once)", name, IGNORED_FIELDS_HEADER)

    def _echoed(self, prompt: PromptInput, validated: Prompt, logprobs: int | None) -> EchoedPrompt:
        """A prompt written back (echo): its text, and with logprobs its tokens' logprobs (one extra forward)."""
        token_ids = list(validated.token_ids)
        text = prompt.text
        if text is None:
            if self._llm.tokenizer is None:
                raise bad_request("echo needs a tokenizer to write a token-id prompt back as text", "echo")
            text = self._llm.tokenizer.decode(token_ids)
        scored = None if logprobs is None else self._llm.prompt_logprobs(validated, logprobs)
        return EchoedPrompt(text, token_ids, scored)

    def _validated(self, prompt: PromptInput, names: _FieldNames) -> Prompt:
        """Validated once, here (tokenized already, with this server's special-token rule); the engine takes the
        Prompt as it is."""
        try:
            return self._llm.prompt(prompt.text, prompt.token_ids)
        except InvalidParameterError as exc:
            raise from_engine_error(exc, names.engine_to_request()) from None

    def _check_common(self, request: SamplingRequest) -> None:
        if request.model is not None and request.model != self.model_name:
            raise APIError(404, f"model '{request.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if request.stream_options is not None:
            if not request.stream:
                raise bad_request("stream_options is only allowed with stream: true", "stream_options")
            if request.stream_options.include_obfuscation:
                raise bad_request("stream obfuscation is not supported", "stream_options.include_obfuscation")

    def _completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[PromptInput]:
        if isinstance(prompt, str):
            return [self._text_prompt(prompt)]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):  # the schema allows no mixed lists
            return [PromptInput(None, list(cast(list[int], prompt)))]
        return [self._text_prompt(p) if isinstance(p, str) else PromptInput(None, list(p))
                for p in cast(list[str | list[int]], prompt)]

    def _text_prompt(self, text: str) -> PromptInput:
        if self._llm.tokenizer is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", "prompt")
        self._check_num_chars(len(text), "prompt")
        return PromptInput(text, self._llm.tokenizer.encode(text, split_special_tokens=self._split_special_tokens))

    def _chat_prompt(self, request: ChatCompletionRequest) -> PromptInput:
        tokenizer = self._llm.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer / chat template", "messages")
        auto = auto_tools(request)
        # tool_call_id, name: unused. With "auto", earlier calls are written as the model is asked to write them.
        messages = [{"role": m.role, "content": m.text(TOOL_CALL_TAG if auto else "")} for m in request.messages]
        if "tool" not in tokenizer.chat_roles:  # a template without a tool role: results come back as user turns
            messages = [tool_result_as_user(m) if m["role"] == "tool" else m for m in messages]
        if auto:  # the model decides whether to call, so it must be told what it can call
            messages = with_tool_instructions(messages, request, tokenizer.chat_roles)
        self._check_num_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            # The template writes its own BOS (as LLM.chat does).
            rendered = tokenizer.render_chat(messages, split_special_tokens=self._split_special_tokens)
        except InvalidParameterError as exc:
            raise from_engine_error(exc) from None
        return PromptInput(rendered.text, rendered.token_ids)

    def _check_num_chars(self, num_chars: int, field: str) -> None:
        """Refuse, before tokenizing it, text too long to fit in max_model_len whatever its tokens are."""
        if self._max_token_chars is not None and num_chars > self._max_model_len * self._max_token_chars:
            raise APIError(
                400, f"{field}: {num_chars} characters cannot fit in max_model_len ({self._max_model_len} tokens): "
                f"no token of this model stands for more than {self._max_token_chars} characters",
                param=field, code="context_length_exceeded",
            )

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

    def _check_capacity(self, num_prompts: int, n: int, names: _FieldNames) -> None:
        """A request of more engine requests than even an idle server holds at once can never be admitted:
        a 400 naming the field (waiting and retrying cannot help), not a 503."""
        capacity = self._engine.capacity
        if capacity is None or num_prompts * n <= capacity:
            return
        param = names.prompt if num_prompts > capacity else "n"
        raise bad_request(
            f"{param}: {num_prompts} prompt(s) x n = {n} make {num_prompts * n} engine requests, more than this "
            f"server ever holds at once ({capacity} = --max-num-seqs + --max-waiting); split the request", param,
        )

    # ------------------------------------------------------------------ engine requests -> HTTP
    async def _generate(self, prepared: _Prepared, http_request: Request) -> Response:
        request, renderer, num_prompt_tokens = prepared.request, prepared.renderer, prepared.num_prompt_tokens
        stream = await self._admit(prepared, http_request)
        headers = {IGNORED_FIELDS_HEADER: ", ".join(prepared.ignored)} if prepared.ignored else {}
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            events = self._events(stream, http_request, renderer, num_prompt_tokens, include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        choices = await self._collect(stream, http_request)
        body = renderer.response(choices, request_usage(num_prompt_tokens, choices, self._k_max))
        # pydantic writes non-finite floats (a -inf logprob) as null; json.dumps would write invalid JSON.
        return Response(body.model_dump_json(), media_type="application/json", headers=headers)

    async def _admit(self, prepared: _Prepared, http_request: Request) -> DeltaStream:
        """Add the engine requests (waiting in line for room up to queue_timeout_s); a client that hangs up
        meanwhile leaves the line."""
        add = asyncio.ensure_future(self._engine.add_requests(prepared.engine_requests, self._queue_timeout_s))
        gone = asyncio.ensure_future(_disconnected(http_request))
        try:
            await asyncio.wait({add, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not add.done():
                add.cancel()  # add_requests undoes whatever landed
        if not add.done():
            raise ClientDisconnected("while waiting for room in the queue")
        try:
            return add.result()
        except EngineStoppedError as exc:
            raise APIError(503, str(exc), error_type="service_unavailable_error", code="engine_stopped") from None
        except Exception as exc:
            raise from_engine_error(exc, prepared.names.engine_to_request()) from None

    @property
    def _k_max(self) -> int:
        return self._llm.config.speculation.metrics_k_max

    async def _collect(self, stream: DeltaStream, http_request: Request) -> list[ChoiceState]:
        """Every choice to its end. A client that disconnects aborts them (their KV slots free at once)."""
        choices = [ChoiceState(i) for i in range(len(stream.request_ids))]
        by_id = dict(zip(stream.request_ids, choices))
        watcher = asyncio.create_task(_abort_on_disconnect(http_request, stream))
        try:
            async for delta in stream:
                by_id[delta.request_id].add(delta)
                if delta.error is not None:
                    raise _generation_error(delta)
        finally:
            watcher.cancel()
            stream.abort()  # no-op unless we leave early (error, cancellation)
        return choices

    async def _events(
        self, stream: DeltaStream, http_request: Request, renderer: Renderer, num_prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """SSE frames. The choices are aborted if the client goes away or the generator is closed early.

        A failed step ends the stream with an error event at once. Choices cut by the shutdown grace period end
        as a finished stream does (each choice's final chunk, finish_reason "abort", and the usage chunk when
        asked for), then the error event says why: clients that stop reading at an error (the OpenAI SDK
        raises) have read the finish and the usage first."""
        choices = [ChoiceState(i) for i in range(len(stream.request_ids))]
        by_id = dict(zip(stream.request_ids, choices))
        watcher = asyncio.create_task(_abort_on_disconnect(http_request, stream))
        shutdown: RequestDelta | None = None
        try:
            for payload in renderer.preamble(len(choices)):
                yield _frame(payload)
            async for delta in stream:
                choice = by_id[delta.request_id]
                if delta.finished:
                    choice.final = delta
                if delta.error is not None and not cut_by_shutdown(delta):
                    yield _frame(f'{{"error": {_generation_error(delta).info.model_dump_json()}}}')
                    break
                if delta.error is not None:
                    shutdown = shutdown or delta
                if renderer.worth_sending(delta) and (payload := renderer.chunk(choice, delta)) is not None:
                    yield _frame(payload)
            else:
                if include_usage:
                    yield _frame(renderer.usage_chunk(request_usage(num_prompt_tokens, choices, self._k_max)))
                if shutdown is not None:
                    yield _frame(f'{{"error": {_generation_error(shutdown).info.model_dump_json()}}}')
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
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=_logit_bias(request.logit_bias),
        structured=structured_output(request),
        speculation=None if spec is None else SpecOverride(
            enabled=spec.enabled, num_speculative_tokens=spec.num_speculative_tokens, k_policy=spec.k_policy
        ),
    )


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    if not logit_bias:
        return None
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        if not key.isascii() or not key.isdigit():
            raise InvalidParameterError("logit_bias", f"keys must be token ids, got '{key}'")
        out[int(key)] = bias
    return out


def _generation_error(delta: RequestDelta) -> APIError:
    if cut_by_shutdown(delta):
        return APIError(503, f"{delta.error}", error_type="service_unavailable_error", code="server_shutting_down")
    return APIError(500, f"generation failed: {delta.error}", error_type="server_error", code="internal_error")


async def _disconnected(http_request: Request) -> None:
    """Returns when the client hangs up (the body is read, so the next ASGI message is the disconnect)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


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
