"""Engine deltas -> OpenAI bodies: per-choice state, usage (with speculation counters), logprobs, chunks.

One renderer per endpoint knows its response and chunk shapes; everything else (driving the engine,
streaming, disconnects) is shared in serving.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

from pydantic import BaseModel

from specd.engine.outputs import RequestDelta, TokenLogprob
from specd.metrics.records import SpecCounters
from specd.model.tokenizer import Tokenizer
from specd.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallDelta,
    SpeculativeDecodingUsage,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from specd.server.structured import ParsedCalls, forced_tool, is_call_text, new_call_id, tool_calls


@dataclass(slots=True)
class ChoiceState:
    """One choice: what it produced so far (non-streaming) and its final delta once finished."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_chars: int = 0  # characters of the token strings reported so far (completion text_offset)
    final: RequestDelta | None = None
    tool_call_ids: list[str] = field(default_factory=list)  # a streamed tool call keeps its first chunk's id
    echoed: bool = False  # the prompt was written before this choice's text (completions with echo)

    def add(self, delta: RequestDelta) -> None:
        self.text.append(delta.new_text)
        self.logprobs.extend(delta.new_logprobs or [])
        if delta.finished:
            self.final = delta

    @property
    def finish_reason(self) -> str | None:
        return None if self.final is None else self.final.finish_reason


def request_usage(num_prompt_tokens: int, choices: list[ChoiceState], k_max: int) -> Usage:
    """Each prompt counted once, every choice's output; speculation counters summed over the choices and
    the ratios taken of the sums (pooled), so a choice that drafted more weighs more."""
    finals = [c.final for c in choices if c.final is not None]
    completion_tokens = sum(f.num_output_tokens for f in finals)
    counters = SpecCounters.zero(k_max)
    for final in finals:
        if final.spec_stats is not None:
            counters = counters + final.spec_stats.counters
    spec = SpeculativeDecodingUsage(
        choices=len(choices), drafts=counters.drafts, draft_tokens=counters.draft_tokens,
        accepted_tokens=counters.accepted_tokens, emitted_tokens=counters.emitted_tokens,
        acceptance_rate=counters.acceptance_rate,
        accepted_tokens_per_draft=counters.accepted_tokens_per_draft,
        mean_accepted_length=counters.accepted_tokens_per_draft, mean_acceptance_length=counters.mean_acceptance_length,
    )
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=num_prompt_tokens + completion_tokens, speculative_decoding=spec)


class Renderer(ABC):
    """Response and chunk bodies of one endpoint for one request."""

    def __init__(self, response_id: str, created: int, model: str, top_logprobs: int | None,
                 tokenizer: Tokenizer | None) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.top_logprobs = top_logprobs  # None: no logprobs; 0: the chosen token's only
        self._tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        # One token on its own: a byte-level piece of a multi-byte character decodes to U+FFFD.
        if self._tokenizer is None:
            return str(token_id)
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def worth_sending(delta: RequestDelta) -> bool:
        """A prefill step or a held-back partial character produces an empty delta; skip it."""
        return bool(delta.new_text or delta.new_logprobs or delta.finished)

    def preamble(self, num_choices: int) -> list[str]:
        return []

    @abstractmethod
    def chunk(self, choice: ChoiceState, delta: RequestDelta) -> str | None:
        """The SSE payload for a delta (None: nothing to send yet)."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> str: ...

    @abstractmethod
    def response(self, choices: list[ChoiceState], usage: Usage) -> BaseModel: ...


class EchoedPrompt(NamedTuple):
    """A prompt written back before its choices (completions `echo`): its text and, with logprobs, its tokens and
    their logprobs (entry i is token i + 1; the first token has none)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


class CompletionRenderer(Renderer):
    """echo: each prompt, written before its choices' output (prompt p's choices are p * n .. p * n + n - 1);
    None without echo."""

    def __init__(self, response_id: str, created: int, model: str, top_logprobs: int | None,
                 tokenizer: Tokenizer | None, echo: list[EchoedPrompt] | None = None, n: int = 1) -> None:
        super().__init__(response_id, created, model, top_logprobs, tokenizer)
        self._echo = echo
        self._n = n

    def set_echo(self, echo: list[EchoedPrompt]) -> None:
        self._echo = echo

    def _echoed(self, choice: ChoiceState) -> EchoedPrompt | None:
        """The choice's prompt, the first time the choice is written (then None)."""
        if self._echo is None or choice.echoed:
            return None
        choice.echoed = True
        return self._echo[choice.index // self._n]

    def _logprobs(self, choice: ChoiceState, logprobs: list[TokenLogprob],
                  echo: EchoedPrompt | None) -> CompletionLogprobs | None:
        if self.top_logprobs is None:
            return None
        prompt: list[TokenLogprob | None] = []
        token_ids = [lp.token_id for lp in logprobs]
        if echo is not None and echo.logprobs is not None:
            prompt = [None, *echo.logprobs][: len(echo.token_ids)]
            token_ids = echo.token_ids + token_ids
        entries: list[TokenLogprob | None] = [*prompt, *logprobs]
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(choice.token_chars)
            choice.token_chars += len(token)
        top = [None if lp is None else {self.token_text(t): v for t, v in lp.top} for lp in entries] \
            if self.top_logprobs > 0 else None
        return CompletionLogprobs(tokens=tokens, token_logprobs=[None if lp is None else lp.logprob for lp in entries],
                                  top_logprobs=top, text_offset=offsets)

    def chunk(self, choice: ChoiceState, delta: RequestDelta) -> str:
        echo = self._echoed(choice)
        out = CompletionChoice(index=choice.index, text=("" if echo is None else echo.text) + delta.new_text,
                               finish_reason=delta.finish_reason,
                               logprobs=self._logprobs(choice, delta.new_logprobs or [], echo))
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=[out]).model_dump_json()

    def usage_chunk(self, usage: Usage) -> str:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[],
                                  usage=usage).model_dump_json()

    def response(self, choices: list[ChoiceState], usage: Usage) -> CompletionResponse:
        out = []
        for c in choices:
            echo = self._echoed(c)
            out.append(CompletionChoice(index=c.index, text=("" if echo is None else echo.text) + "".join(c.text),
                                        finish_reason=c.finish_reason, logprobs=self._logprobs(c, c.logprobs, echo)))
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=out,
                                  usage=usage)


class ChatRenderer(Renderer):
    """tools: the request when its output may be tool calls (structured.calls_tools), else None."""

    def __init__(self, response_id: str, created: int, model: str, top_logprobs: int | None,
                 tokenizer: Tokenizer | None, tools: ChatCompletionRequest | None = None) -> None:
        super().__init__(response_id, created, model, top_logprobs, tokenizer)
        self._tools = tools

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        content = []
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            top = [TopLogprob(token=(text := self.token_text(t)), logprob=v, bytes=list(text.encode()))
                   for t, v in lp.top]
            content.append(ChatTokenLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage).model_dump_json()

    def preamble(self, num_choices: int) -> list[str]:
        # OpenAI opens every choice with a role-only delta.
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(num_choices)]

    def chunk(self, choice: ChoiceState, delta: RequestDelta) -> str | None:
        logprobs = self._logprobs(delta.new_logprobs or [])
        if self._tools is None:
            return self._content_chunk(choice, delta, logprobs)
        choice.text.append(delta.new_text)
        if forced_tool(self._tools) is not None:
            return self._named_call_chunk(choice, delta, logprobs)
        text = "".join(choice.text)
        is_call = is_call_text(self._tools, text)
        if is_call is False:  # "auto" answered in text: streamed as content (every delta before was empty)
            return self._content_chunk(choice, delta, logprobs)
        # A list of calls, sent whole once finished (it cannot be split into calls before); "auto" output that
        # has not decided yet sends nothing.
        if not delta.finished:
            return None
        parsed = tool_calls(self._tools, text, choice.tool_call_ids) if is_call else None
        calls = parsed.calls if parsed is not None else []
        out = ChatDelta(tool_calls=[
            ToolCallDelta(index=i, id=c.id, type="function",
                          function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments))
            for i, c in enumerate(calls)] or None)
        return self._chunk([ChatChunkChoice(index=choice.index, delta=out, logprobs=logprobs,
                                            finish_reason=_call_finish_reason(delta.finish_reason, parsed))])

    def _content_chunk(self, choice: ChoiceState, delta: RequestDelta, logprobs: ChatLogprobs | None) -> str:
        return self._chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(content=delta.new_text),
                                            logprobs=logprobs, finish_reason=delta.finish_reason)])

    def _named_call_chunk(self, choice: ChoiceState, delta: RequestDelta, logprobs: ChatLogprobs | None) -> str:
        """A named call streams its arguments as they are generated; the first chunk carries its id and name."""
        tool = forced_tool(self._tools) if self._tools is not None else None
        assert tool is not None
        first = not choice.tool_call_ids
        if first:
            choice.tool_call_ids.append(new_call_id())
        call = ToolCallDelta(index=0, id=choice.tool_call_ids[0] if first else None, type="function" if first
                             else None, function=FunctionCallDelta(name=tool.function.name if first else None,
                                                                   arguments=delta.new_text))
        finish_reason = delta.finish_reason
        if delta.finished:
            finish_reason = _call_finish_reason(finish_reason, tool_calls(self._tools, "".join(choice.text),
                                                                          list(choice.tool_call_ids)))
        return self._chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(tool_calls=[call]), logprobs=logprobs,
                                            finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def response(self, choices: list[ChoiceState], usage: Usage) -> ChatCompletionResponse:
        out = []
        for c in choices:
            text = "".join(c.text)
            parsed = None if self._tools is None else tool_calls(self._tools, text, c.tool_call_ids)
            message = ChatResponseMessage(content=text) if parsed is None else ChatResponseMessage(
                content=None, tool_calls=parsed.calls or None)
            out.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.logprobs),
                                  finish_reason=_call_finish_reason(c.finish_reason, parsed)))
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=out,
                                      usage=usage)


def _call_finish_reason(finish_reason: str | None, parsed: ParsedCalls | None) -> str | None:
    """OpenAI ends a choice that made whole tool calls with "tool_calls"; a cut one keeps its own reason
    ("length": max_tokens; "stop": a stop string), so a client can tell its arguments are incomplete."""
    complete = parsed is not None and parsed.complete and bool(parsed.calls)
    return "tool_calls" if complete and finish_reason == "stop" else finish_reason
