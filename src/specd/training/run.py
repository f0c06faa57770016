"""`specd train-draft`: prompts -> the target's own answers -> its features -> a trained head, saved with a report."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specd.errors import InvalidParameterError
from specd.model.draft_head import DraftHead
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import Tokenizer
from specd.training.data import (
    Conversation,
    Sample,
    frequent_tokens,
    generate_samples,
    load_samples,
    save_samples,
)
from specd.training.prompts import training_prompts
from specd.training.report import write_report
from specd.training.trainer import TrainConfig, acceptance, mean_acceptance_length, train

REPORT_POSITIONS = 6


@dataclass(frozen=True, slots=True)
class DataConfig:
    """How the training data is made. Fields are named after their `specd train-draft` flags. The time limit on
    generating (35 minutes) keeps the default run within an hour on a 2-core CPU; a faster machine answers more of
    the prompts (and a second, sampled answer for each) in that time."""

    samples_per_prompt: int = 2
    max_tokens: int = 192
    temperature: float = 0.8
    batch_size: int = 64
    draft_vocab_size: int = 8192
    held_out_fraction: float = 0.05
    max_prompts: int | None = None
    max_generate_s: float | None = 35 * 60
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples_per_prompt", "max_tokens", "batch_size", "draft_vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"--{name.replace('_', '-')}", f"must be an integer >= 1, got {value!r}")
        if not 0 < self.temperature <= 2:
            raise InvalidParameterError("--temperature", "must be in (0, 2]")
        if not 0 < self.held_out_fraction < 1:
            raise InvalidParameterError("--held-out", "must be in (0, 1)")
        if self.max_generate_s is not None and not self.max_generate_s > 0:
            raise InvalidParameterError("--generate-minutes", "must be > 0")
        if self.max_prompts is not None and self.max_prompts < 2:
            raise InvalidParameterError("--max-prompts", "must be >= 2 (one to train on, one held out)")


@dataclass(slots=True)
class TrainDraftResult:
    """What a run made: the head, and the report written next to it."""

    head: DraftHead
    report: dict[str, Any] = field(default_factory=dict)


def default_conversations() -> list[Conversation]:
    return [[{"role": "user", "content": p.text}] for p in training_prompts()]


def train_draft(
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    target_name: str,
    out_dir: str | Path | None,
    conversations: Sequence[Conversation],
    data: DataConfig,
    training: TrainConfig,
    command: str = "",
    data_cache: str | Path | None = None,
    generate: bool = True,
    train_head: bool = True,
) -> TrainDraftResult | None:
    """The whole pipeline; writes head.safetensors, config.json and report.json (+ report.png) into out_dir.

    data_cache: a file of the target's answers and features (from the same prompts). Its answers are kept and only
    the missing (prompt, sample) answers are generated; the file is rewritten every few minutes while generating,
    so a stopped run resumes where it was. generate=False trains on the file as it is; train_head=False stops after
    generating (returns None).
    """
    if train_head and out_dir is None:
        raise InvalidParameterError("--out", "is required to train a head")
    if data.draft_vocab_size > target.config.vocab_size:
        raise InvalidParameterError(
            "--draft-vocab-size", f"must be <= the target's vocabulary ({target.config.vocab_size})"
        )
    conversations = list(conversations)
    if data.max_prompts is not None:
        conversations = conversations[: data.max_prompts]
    if len(conversations) < 2:
        raise InvalidParameterError("--prompts", "needs at least 2 prompts (one to train on, one held out)")
    phases: dict[str, float] = {}
    started = time.monotonic()

    cache = Path(data_cache) if data_cache is not None else None
    samples = load_samples(cache, len(conversations)) if cache is not None and cache.is_file() else []
    if generate:
        kept = list(samples)

        def save(new: list[Sample]) -> None:
            if cache is not None:
                save_samples(cache, kept + new)

        samples = kept + generate_samples(
            target, tokenizer, conversations, data.samples_per_prompt, data.max_tokens, data.temperature,
            data.batch_size, data.seed, data.max_generate_s, done={s.job for s in kept},
            checkpoint=save if cache is not None else None)
    phases["generate_s"] = time.monotonic() - started
    if not samples:
        raise InvalidParameterError("--data-cache", f"{cache} does not exist: nothing to train on")
    if not train_head:
        return None

    prompt_order = list(range(len(conversations)))
    random.Random(data.seed).shuffle(prompt_order)
    num_held_out = max(1, round(len(conversations) * data.held_out_fraction))
    held_out_prompts = set(prompt_order[:num_held_out])
    train_set = [s for s in samples if s.prompt_index not in held_out_prompts]
    held_out = [s for s in samples if s.prompt_index in held_out_prompts]
    held_out_greedy = [s for s in held_out if s.greedy]

    token_map = frequent_tokens(train_set, target.config.vocab_size, data.draft_vocab_size,
                                always=list(target.config.eos_token_ids))
    head = DraftHead.initialise(target, token_map, target_name, seed=training.seed)
    before = acceptance(head, held_out_greedy, REPORT_POSITIONS)
    mark = time.monotonic()
    history = train(head, train_set, held_out, training)
    phases["train_s"] = time.monotonic() - mark
    after = acceptance(head, held_out_greedy, REPORT_POSITIONS)
    phases["total_s"] = time.monotonic() - started

    in_map = set(token_map.tolist())
    held_out_tokens = [t for s in held_out for t in s.response_ids]
    report: dict[str, Any] = {
        "command": command,
        "target": target_name,
        "data": {
            **asdict(data),
            "prompts": len(conversations),
            "held_out_prompts": num_held_out,
            "answers": len(samples),
            "train_response_tokens": sum(len(s.response_ids) for s in train_set),
            "train_tokens": sum(len(s.token_ids) for s in train_set),
            "held_out_response_tokens": len(held_out_tokens),
            "draft_vocab_coverage_held_out": (
                sum(t in in_map for t in held_out_tokens) / len(held_out_tokens) if held_out_tokens else None
            ),
        },
        "training": {**asdict(training), "steps": len(history.steps), "seconds": history.seconds},
        "phases": phases,
        "loss_curve": {"steps": history.steps, "train_loss": history.train_loss,
                       "train_distill_depth1": [d[0] for d in history.train_distill],
                       "held_out_loss": history.held_out_loss},
        "held_out_acceptance_per_position": after,
        "held_out_acceptance_per_position_untrained": before,
        "held_out_tau": {f"k={k}": mean_acceptance_length(after, k) for k in (1, 2, 4, 6)},
    }
    assert out_dir is not None  # checked on entry
    head.save(out_dir, extra={"command": command, "train_response_tokens": report["data"]["train_response_tokens"],
                              "held_out_tau": report["held_out_tau"]})
    write_report(Path(out_dir), report)
    return TrainDraftResult(head, report)


def summary_line(report: dict[str, Any]) -> str:
    tau = report["held_out_tau"]
    return (f"held-out tau: k=2 {tau['k=2']:.2f}, k=4 {tau['k=4']:.2f}, k=6 {tau['k=6']:.2f}; per-position "
            + json.dumps([round(a, 3) for a in report["held_out_acceptance_per_position"]])
            + f"; {report['data']['train_response_tokens']} training answer tokens; "
            + f"{report['phases']['total_s'] / 60:.1f} min")
