"""`specd train-draft`: prompts -> the target's own answers -> its features -> a trained head, saved with a report."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specd.errors import InvalidParameterError, ModelLoadError, require_int
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
from specd.training.overlap import ReservedText, benchmark_prompt_file, benchmark_texts
from specd.training.prompts import training_prompts
from specd.training.report import write_report
from specd.training.self_prompts import SelfPromptConfig, generate_self_prompts
from specd.training.split import PromptSet, file_prompt_set, split_prompts
from specd.training.trainer import TrainConfig, acceptance, mean_acceptance_length, train

REPORT_POSITIONS = 6


@dataclass(frozen=True, slots=True)
class DataConfig:
    """How the training data is made. Fields are named after their `specd train-draft` flags. The time limit on
    generating (35 minutes) keeps the default run within an hour on a 2-core CPU; a faster machine answers more of
    the prompts (and a second, sampled answer for each) in that time.

    held_out_fraction: share of the prompts (of each source: the given set, the self-generated ones) held out.
    held_out_templates: share of each kind's templates whose prompts are all held out (at least one per kind that
    has two or more; 0: none), so one held-out figure is about prompts unlike any trained on.
    self_prompts: prompts the target writes itself, added to the set (specd.training.self_prompts)."""

    samples_per_prompt: int = 2
    max_tokens: int = 192
    temperature: float = 0.8
    batch_size: int = 64
    draft_vocab_size: int = 8192
    held_out_fraction: float = 0.05
    held_out_templates: float = 0.1
    self_prompts: int = 0
    max_prompts: int | None = None
    max_generate_s: float | None = 35 * 60
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples_per_prompt", "max_tokens", "batch_size", "draft_vocab_size"):
            require_int(f"--{name.replace('_', '-')}", getattr(self, name))
        if not 0 < self.temperature <= 2:
            raise InvalidParameterError("--temperature", "must be in (0, 2]")
        if not 0 < self.held_out_fraction < 1:
            raise InvalidParameterError("--held-out", "must be in (0, 1)")
        if not 0 <= self.held_out_templates < 1:
            raise InvalidParameterError("--held-out-templates", "must be in [0, 1)")
        require_int("--self-prompts", self.self_prompts, lo=0)
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


def self_prompts_file(data_cache: Path) -> Path:
    """Where the self-generated prompts of a data cache are kept (its answers need the very same prompts)."""
    return data_cache.with_name(data_cache.name + ".self-prompts.json")


def add_self_prompts(prompt_set: PromptSet, target: LlamaForCausalLM, tokenizer: Tokenizer, data: DataConfig,
                     data_cache: Path | None, generate: bool) -> tuple[PromptSet, dict[str, Any]]:
    """`data.self_prompts` self-generated prompts appended to the set, and a report of how they were made. With a
    data cache they are saved next to it and reused (a larger count extends the saved list)."""
    config = SelfPromptConfig(count=data.self_prompts, seed=data.seed)
    saved_file = self_prompts_file(data_cache) if data_cache is not None else None
    settings = {k: v for k, v in asdict(config).items() if k != "count"}
    saved: dict[str, Any] = {}
    if saved_file is not None and saved_file.is_file():
        saved = json.loads(saved_file.read_text(encoding="utf-8"))
    if saved.get("settings") == settings and len(saved.get("prompts", [])) >= config.count:
        texts = saved["prompts"][: config.count]
        made = {k: saved[k] for k in ("num_candidates", "dropped", "reserved_texts")}
    elif not generate:
        raise InvalidParameterError("--self-prompts", f"no {config.count} saved self-generated prompts next to "
                                    "--data-cache: generate them first (without --only train)")
    else:
        existing = [m["content"] for c in prompt_set.conversations for m in c]
        reserved = ReservedText(benchmark_texts())
        result = generate_self_prompts(target, tokenizer, config, existing, reserved)
        if len(result.texts) < config.count:
            raise InvalidParameterError("--self-prompts", f"only {len(result.texts)} of {result.num_candidates} "
                                        f"candidates passed the filters ({result.dropped}); ask for fewer")
        texts = result.texts
        made = {"num_candidates": result.num_candidates, "dropped": result.dropped,
                "reserved_texts": reserved.num_texts}
        if saved_file is not None:
            saved_file.parent.mkdir(parents=True, exist_ok=True)
            saved_file.write_text(json.dumps({"settings": settings, "prompts": texts, **made}, indent=1) + "\n",
                                  encoding="utf-8")
    report = {"count": len(texts), **made, "benchmark_file": str(benchmark_prompt_file()), **settings}
    grown = PromptSet(prompt_set.conversations + [[{"role": "user", "content": t}] for t in texts],
                      prompt_set.kinds + ["self"] * len(texts), prompt_set.templates + [None] * len(texts))
    return grown, report


def check_cache_matches(samples: Sequence[Sample], prompt_set: PromptSet, tokenizer: Tokenizer,
                        cache: Path | None) -> None:
    """Every cached answer must continue the prompt it is filed under (a cache made for other prompts is refused)."""
    encoded: dict[int, list[int]] = {}
    for sample in samples:
        if sample.prompt_index not in encoded:
            encoded[sample.prompt_index] = tokenizer.encode_chat(prompt_set.conversations[sample.prompt_index])
        if sample.token_ids[: sample.num_prompt_tokens].tolist() != encoded[sample.prompt_index]:
            raise InvalidParameterError("--data-cache", f"{cache} holds answers to other prompts (prompt "
                                        f"{sample.prompt_index} differs)")


def evaluate(head: DraftHead, samples: Sequence[Sample]) -> dict[str, Any]:
    """Greedy per-position acceptance and tau on the greedy answers among `samples`."""
    greedy = [s for s in samples if s.greedy]
    per_position = acceptance(head, greedy, REPORT_POSITIONS)
    return {"answers": len(greedy), "answer_tokens": sum(len(s.response_ids) for s in greedy),
            "acceptance_per_position": per_position,
            "tau": {f"k={k}": mean_acceptance_length(per_position, k) for k in (1, 2, 4, 6)}}


def train_draft(
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    target_name: str,
    out_dir: str | Path | None,
    conversations: Sequence[Conversation] | PromptSet,
    data: DataConfig,
    training: TrainConfig,
    command: str = "",
    data_cache: str | Path | None = None,
    generate: bool = True,
    train_head: bool = True,
    init_from: str | Path | None = None,
) -> TrainDraftResult | None:
    """The whole pipeline; writes head.safetensors, config.json and report.json (+ report.png) into out_dir.

    conversations: a PromptSet (kinds and templates known: whole templates can be held out) or plain conversations.
    data_cache: a file of the target's answers and features (from the same prompts). Its answers are kept and only
    the missing (prompt, sample) answers are generated; the file is rewritten every few minutes while generating,
    so a stopped run resumes where it was. generate=False trains on the file as it is; train_head=False stops after
    generating (returns None). init_from: a saved head to go on training (its weights and draft vocabulary) instead
    of a fresh one, so training cut short by a time limit can continue.
    """
    if train_head and out_dir is None:
        raise InvalidParameterError("--out", "is required to train a head")
    if data.draft_vocab_size > target.config.vocab_size:
        raise InvalidParameterError(
            "--draft-vocab-size", f"must be <= the target's vocabulary ({target.config.vocab_size})"
        )
    prompt_set = conversations if isinstance(conversations, PromptSet) else file_prompt_set(conversations)
    if data.max_prompts is not None:
        prompt_set = PromptSet(*(column[: data.max_prompts] for column in prompt_set))
    if len(prompt_set.conversations) < 2:
        raise InvalidParameterError("--prompts", "needs at least 2 prompts (one to train on, one held out)")
    phases: dict[str, float] = {}
    started = time.monotonic()

    cache = Path(data_cache) if data_cache is not None else None
    self_report: dict[str, Any] | None = None
    if data.self_prompts:
        prompt_set, self_report = add_self_prompts(prompt_set, target, tokenizer, data, cache, generate)
        phases["self_prompts_s"] = time.monotonic() - started
    conversations = prompt_set.conversations
    samples = load_samples(cache, len(conversations)) if cache is not None and cache.is_file() else []
    check_cache_matches(samples, prompt_set, tokenizer, cache)
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

    split = split_prompts(prompt_set, data.held_out_fraction, data.held_out_templates, data.seed)
    held_out_indices = split.all
    train_set = [s for s in samples if s.prompt_index not in held_out_indices]
    if not train_set:
        raise InvalidParameterError("--held-out-templates", "holds out every prompt that has answers: nothing is "
                                    "left to train on")
    held_out = [s for s in samples if s.prompt_index in held_out_indices]
    by_set = {name: [s for s in held_out if s.prompt_index in indices]
              for name, indices in (("prompts", split.prompts), ("templates", split.templates), ("self", split.self))}

    token_map = frequent_tokens(train_set, target.config.vocab_size, data.draft_vocab_size,
                                always=list(target.config.eos_token_ids))
    if init_from is None:
        head = DraftHead.initialise(target, token_map, target_name, seed=training.seed)
    else:
        try:
            head = DraftHead.load(init_from, target)
        except ModelLoadError as exc:
            raise InvalidParameterError("--init-from", str(exc)) from exc
        token_map = head.token_map
    before = acceptance(head, [s for s in by_set["prompts"] if s.greedy], REPORT_POSITIONS)
    mark = time.monotonic()
    history = train(head, train_set, held_out, training)
    phases["train_s"] = time.monotonic() - mark
    held_out_sets: dict[str, Any] = {}
    for name, members in by_set.items():
        if members:
            held_out_sets[name] = {"prompts": len({s.prompt_index for s in members}), **evaluate(head, members)}
    held_out_sets.setdefault("templates", {})["names"] = split.template_names
    after = evaluate(head, by_set["prompts"])["acceptance_per_position"]
    phases["total_s"] = time.monotonic() - started

    in_map = set(token_map.tolist())
    held_out_tokens = [t for s in by_set["prompts"] for t in s.response_ids]
    report: dict[str, Any] = {
        "command": command,
        "target": target_name,
        "data": {
            **asdict(data),
            "prompts": len(conversations),
            "held_out_prompts": len(split.prompts),
            "held_out_template_prompts": len(split.templates),
            "held_out_self_prompts": len(split.self),
            "answers": len(samples),
            "train_response_tokens": sum(len(s.response_ids) for s in train_set),
            "train_tokens": sum(len(s.token_ids) for s in train_set),
            "held_out_response_tokens": len(held_out_tokens),
            "draft_vocab_coverage_held_out": (
                sum(t in in_map for t in held_out_tokens) / len(held_out_tokens) if held_out_tokens else None
            ),
        },
        "self_prompts": self_report,
        "training": {**asdict(training), "steps": len(history.steps), "seconds": history.seconds},
        "phases": phases,
        "loss_curve": {"steps": history.steps, "train_loss": history.train_loss,
                       "train_distill_depth1": [d[0] for d in history.train_distill],
                       "held_out_loss": history.held_out_loss},
        # The random share of the given prompts (comparable across heads trained on the same prompt list):
        "held_out_acceptance_per_position": after,
        "held_out_acceptance_per_position_untrained": before,  # before this run's training (--init-from's head)
        "init_from": None if init_from is None else str(init_from),
        "held_out_tau": {f"k={k}": mean_acceptance_length(after, k) for k in (1, 2, 4, 6)},
        # Every held-out set: "prompts" (as above), "templates" (whole templates never trained on), "self".
        "held_out_sets": held_out_sets,
    }
    assert out_dir is not None  # checked on entry
    earlier = json.loads((Path(init_from) / "config.json").read_text())["training"] if init_from else None
    head.save(out_dir, extra={"command": command, "continues": earlier,
                              "train_response_tokens": report["data"]["train_response_tokens"],
                              "held_out_tau": report["held_out_tau"],
                              "held_out_tau_templates": held_out_sets["templates"].get("tau")})
    write_report(Path(out_dir), report)
    return TrainDraftResult(head, report)


def summary_line(report: dict[str, Any]) -> str:
    tau = report["held_out_tau"]
    return (f"held-out tau: k=2 {tau['k=2']:.2f}, k=4 {tau['k=4']:.2f}, k=6 {tau['k=6']:.2f}; per-position "
            + json.dumps([round(a, 3) for a in report["held_out_acceptance_per_position"]])
            + "".join(f"; held-out {name} tau at k=4 {found['tau']['k=4']:.2f}"
                      for name, found in report["held_out_sets"].items() if name != "prompts" and "tau" in found)
            + f"; {report['data']['train_response_tokens']} training answer tokens; "
            + f"{report['phases']['total_s'] / 60:.1f} min")
