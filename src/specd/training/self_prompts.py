"""Prompts the target writes itself ("Magpie"-style): given only its chat template's text up to where a user's
message starts, an instruction-tuned model samples a plausible user turn. This widens a draft head's training data
beyond the shipped templates with what the target itself thinks users ask, at no cost but generation.

Every candidate is filtered: it must end its turn (not hit the token limit), hold no control tokens, have a
sensible number of words, repeat no earlier prompt (the ones already in the set included), and share no text with
the benchmark prompts (specd.training.overlap), so benchmark acceptance is never measured on training text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from specd.config import EngineConfig
from specd.errors import InvalidParameterError, require_int
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import Tokenizer
from specd.sampling.params import SamplingParams
from specd.training.overlap import ReservedText, words
from specd.training.progress import Progress

_SENTINEL = "\u2063specd-user-turn\u2063"  # text no template rewrites or contains
DROP_REASONS = ("unfinished", "control", "length", "duplicate", "reserved")


@dataclass(frozen=True, slots=True)
class SelfPromptConfig:
    """count: prompts to keep (`--self-prompts`). A candidate is a user turn sampled at `temperature` / `top_p`, at
    most `max_tokens` long; kept when it has min_words..max_words words and passes the other filters. Generation
    gives up after count x max_candidates_per_prompt candidates (a model that cannot write user turns)."""

    count: int
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 96
    min_words: int = 4
    max_words: int = 80
    max_candidates_per_prompt: int = 4
    batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        require_int("--self-prompts", self.count, lo=0)
        for name in ("max_tokens", "min_words", "max_words", "max_candidates_per_prompt", "batch_size"):
            require_int(f"self_prompts.{name}", getattr(self, name))
        if self.max_words < self.min_words:
            raise InvalidParameterError("self_prompts.max_words", "must be >= min_words")
        if not 0 < self.temperature <= 2:
            raise InvalidParameterError("self_prompts.temperature", "must be in (0, 2]")
        if not 0 < self.top_p <= 1:
            raise InvalidParameterError("self_prompts.top_p", "must be in (0, 1]")


class SelfPrompts(NamedTuple):
    texts: list[str]  # the kept prompts, in candidate order
    num_candidates: int  # judged: len(texts) + sum(dropped.values())
    dropped: dict[str, int]  # reason (DROP_REASONS) -> candidates dropped for it


class UserTurn(NamedTuple):
    prefix: str  # the template's text before a user's message (system prompt included, if the template adds one)
    end: str  # the text that ends the message (a stop string), e.g. "<|im_end|>"


def user_turn(tokenizer: Tokenizer) -> UserTurn:
    """Where a user's message starts and ends in the model's chat template: a one-message conversation rendered
    without the assistant's cue, split at its content."""
    if tokenizer.chat_template is None:
        raise InvalidParameterError("--self-prompts", "the model has no chat template to write user turns with")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    if text.count(_SENTINEL) != 1:
        raise InvalidParameterError("--self-prompts", "the model's chat template does not show a user's message "
                                    "as it is, so where a user turn starts is unknown")
    prefix, suffix = text.split(_SENTINEL)
    end = suffix.strip() or suffix
    if not end:
        raise InvalidParameterError("--self-prompts", "the model's chat template marks no end of a user turn")
    return UserTurn(prefix, end)


class PromptFilter:
    """Judges candidates in order; remembers the kept ones (and the `existing` prompts) to refuse duplicates.
    Two prompts are duplicates when their words (lower-cased, punctuation dropped) are the same."""

    def __init__(self, config: SelfPromptConfig, existing: Iterable[str], reserved: ReservedText) -> None:
        self.config = config
        self.reserved = reserved
        self.seen = {tuple(words(text)) for text in existing}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    def judge(self, text: str, finished: bool, has_control_tokens: bool) -> str | None:
        """None when the candidate is kept (and remembered), else the reason it is dropped (counted)."""
        key = tuple(words(text))
        reason: str | None = None
        if not finished:
            reason = "unfinished"
        elif has_control_tokens:
            reason = "control"
        elif not self.config.min_words <= len(key) <= self.config.max_words:
            reason = "length"
        elif key in self.seen:
            reason = "duplicate"
        elif self.reserved.overlaps(text):
            reason = "reserved"
        if reason is None:
            self.seen.add(key)
        else:
            self.dropped[reason] += 1
        return reason


def generate_self_prompts(target: LlamaForCausalLM, tokenizer: Tokenizer, config: SelfPromptConfig,
                          existing: Sequence[str] = (), reserved: ReservedText | None = None) -> SelfPrompts:
    """Sample user turns from the target with specd's engine until `config.count` pass the filter (or the candidate
    budget is spent). Candidate i is sampled with seed `config.seed + i`, and candidates are judged in order, so the
    result depends only on the model and the config (a larger count extends a smaller one's list)."""
    from specd.llm import LLM

    if config.count == 0:
        return SelfPrompts([], 0, dict.fromkeys(DROP_REASONS, 0))
    turn = user_turn(tokenizer)
    prefix_ids = tokenizer.encode(turn.prefix, add_special_tokens=False)
    engine = EngineConfig(max_num_seqs=config.batch_size, max_model_len=len(prefix_ids) + config.max_tokens + 1,
                          max_num_batched_tokens=max(512, config.batch_size))
    llm = LLM.from_model(target, tokenizer, engine)
    judge = PromptFilter(config, existing, reserved if reserved is not None else ReservedText([]))
    special = set(tokenizer.eos_token_ids)
    budget = config.count * config.max_candidates_per_prompt
    kept: list[str] = []
    num_candidates = 0
    progress = Progress("prompts", config.count, "self-generated prompts")
    while len(kept) < config.count and num_candidates < budget:
        # More candidates than prompts still missing: some are dropped.
        size = min(budget - num_candidates, max(config.batch_size, 2 * (config.count - len(kept))))
        params = [SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p,
                                 seed=config.seed + num_candidates + i, stop=[turn.end])
                  for i in range(size)]
        outputs = llm.generate(prompt_token_ids=[prefix_ids] * size, sampling_params=params)
        for request in outputs:
            if len(kept) == config.count:  # the rest of the round is not judged (nor counted as candidates)
                break
            num_candidates += 1
            out = request.outputs[0]
            if out.finish_reason == "error":  # the engine logged why; a broken model is no candidate source
                raise RuntimeError("generating self-prompts failed: an engine step raised (see the log)")
            ids = [t for t in out.token_ids if t not in special]
            control = tokenizer.decode(ids, skip_special_tokens=False) != tokenizer.decode(ids)
            text = out.text.strip()
            if judge.judge(text, out.finish_reason == "stop", control) is None:
                kept.append(text)
                progress.advance(1, note=f"{num_candidates} candidates")
    progress.finish()
    llm.close()
    return SelfPrompts(kept, num_candidates, judge.dropped)
