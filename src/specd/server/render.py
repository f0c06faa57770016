"""Engine deltas -> OpenAI bodies: per-choice state, usage (with speculation counters), logprobs, chunks.

One renderer per endpoint knows its response and chunk shapes; everything else (driving the engine,
streaming, disconnects) is shared in serving.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pydantic import BaseModel

from specd.engine.outputs import RequestDelta, TokenLogprob
from specd.metrics.records import SpecCounters
from specd.model.tokenizer import Tokenizer
from specd.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    SpeculativeDecodingUsage,
    TopLogprob,
    Usage,
)


@dataclass(slots=True)
class ChoiceState:
    """One choice: what it produced so far (non-streaming) and its final delta once finished."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_chars: int = 0  # characters of the token strings reported so far (completion text_offset)
    final: RequestDelta | None = None

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
        drafts=counters.drafts, draft_tokens=counters.draft_tokens, accepted_tokens=counters.accepted_tokens,
        emitted_tokens=counters.emitted_tokens, acceptance_rate=counters.acceptance_rate,
        mean_accepted_length=counters.mean_accepted_length, mean_acceptance_length=counters.mean_acceptance_length,
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
    def chunk(self, choice: ChoiceState, delta: RequestDelta) -> str: ...

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> str: ...

    @abstractmethod
    def response(self, choices: list[ChoiceState], usage: Usage) -> BaseModel: ...


class CompletionRenderer(Renderer):
    def _logprobs(self, choice: ChoiceState, logprobs: list[TokenLogprob]) -> CompletionLogprobs | None:
        if self.top_logprobs is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(choice.token_chars)
            choice.token_chars += len(token)
        top = [{self.token_text(t): v for t, v in lp.top} for lp in logprobs] if self.top_logprobs > 0 else None
        return CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs], top_logprobs=top,
                                  text_offset=offsets)

    def chunk(self, choice: ChoiceState, delta: RequestDelta) -> str:
        out = CompletionChoice(index=choice.index, text=delta.new_text, finish_reason=delta.finish_reason,
                               logprobs=self._logprobs(choice, delta.new_logprobs or []))
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=[out]).model_dump_json()

    def usage_chunk(self, usage: Usage) -> str:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[],
                                  usage=usage).model_dump_json()

    def response(self, choices: list[ChoiceState], usage: Usage) -> CompletionResponse:
        out = [CompletionChoice(index=c.index, text="".join(c.text), finish_reason=c.finish_reason,
                                logprobs=self._logprobs(c, c.logprobs)) for c in choices]
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=out,
                                  usage=usage)


class ChatRenderer(Renderer):
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

    def chunk(self, choice: ChoiceState, delta: RequestDelta) -> str:
        return self._chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(content=delta.new_text),
                                            logprobs=self._logprobs(delta.new_logprobs or []),
                                            finish_reason=delta.finish_reason)])

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def response(self, choices: list[ChoiceState], usage: Usage) -> ChatCompletionResponse:
        out = [ChatChoice(index=c.index, message=ChatResponseMessage(content="".join(c.text)),
                          finish_reason=c.finish_reason, logprobs=self._logprobs(c.logprobs)) for c in choices]
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=out,
                                      usage=usage)
