"""One request's state inside the engine, and the stop rules that decide how many tokens it keeps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specd.engine.outputs import FinishReason, TokenLogprob
from specd.model.tokenizer import IncrementalDetokenizer
from specd.sampling.grammar import Grammar
from specd.sampling.params import SamplingParams
from specd.speculation.k_policy import KPolicy


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's text (when it came as text) and token ids.

    checked_against: the (vocab_size, max_model_len) LLMEngine.make_prompt validated it for, so that an engine
    with those limits takes it without checking again; None (a Prompt made by hand) has it checked on entry.
    """

    text: str | None
    token_ids: list[int]
    checked_against: tuple[int, int] | None = None


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity equality: membership tests must not compare every field
class Sequence:
    """Mutable per-request state, owned by the engine thread.

    Invariant while running: the target KV cache holds every token but the last (`num_computed ==
    len(token_ids) - 1` once prefill is done); the last token is fed at the next step together with drafts.
    """

    request_id: str
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival_time: float
    k_max: int  # this request's cap on k_i (0: no speculation)
    k_policy: KPolicy | None  # decides its k_i; None when k_max is 0
    detokenizer: IncrementalDetokenizer | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    num_computed: int = 0
    finish_reason: FinishReason | None = None
    text: str = ""
    num_text_streamed: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_steps: int = 0
    stop_string_hit: bool = False
    grammar: Grammar | None = None  # the request's structured-output state (specd.sampling.grammar)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def max_new_this_step(self) -> int:
        """Most tokens this sequence may still emit (max_tokens and max_model_len both bound it)."""
        return min(
            self.params.max_tokens - len(self.output_token_ids),
            self.max_model_len - self.num_tokens,
        )

    def append_tokens(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> int:
        """Append tokens one by one until a stop rule fires; return how many were kept (e_i).

        Stop rules, in order per token: EOS (unless ignore_eos) and stop_token_ids finish with "stop" and
        keep the token (it is not shown as text); a stop string finishes with "stop" and cuts the text before
        it (or after it with include_stop_str_in_output); max_tokens / max_model_len finish with "length".
        """
        params = self.params
        kept = 0
        for i, tok in enumerate(token_ids):
            self.output_token_ids.append(tok)
            if logprobs is not None and self.logprobs is not None:
                self.logprobs.append(logprobs[i])
            kept += 1
            is_eos = tok in self.eos_token_ids and not params.ignore_eos
            if is_eos or tok in params.stop_token_ids:
                self.finish_reason = "stop"
                break
            if self.detokenizer is not None:
                num_old_chars = len(self.text)
                self.text += self.detokenizer.push([tok])
                if params.stop and self._check_stop_strings(num_old_chars):
                    self.finish_reason = "stop"
                    break
            if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= self.max_model_len:
                self.finish_reason = "length"
                break
        return kept

    def _check_stop_strings(self, num_old_chars: int) -> bool:
        # A stop string can only end inside the text added by the newest token (or straddle into it), and that
        # text may be any length; older text was searched already.
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, num_old_chars - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
        self.stop_string_hit = True
        return True

    def take_text_delta(self) -> str:
        """Text not streamed yet. While running, hold back a possible stop-string prefix at the end."""
        if self.finished and self.detokenizer is not None and not self.stop_string_hit:
            self.text += self.detokenizer.flush()
        end = len(self.text)
        if not self.finished and self.params.stop:
            end = max(self.num_text_streamed, end - (max(len(s) for s in self.params.stop) - 1))
        delta = self.text[self.num_text_streamed : end]
        self.num_text_streamed = end
        return delta
