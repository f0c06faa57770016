"""The prompts `specd train-draft` answers, where each came from, and which are kept out of training."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

from specd.training.data import Conversation
from specd.training.prompts import training_prompts


class PromptSet(NamedTuple):
    """Conversations to answer, with where each came from."""

    conversations: list[Conversation]
    kinds: list[str]  # per conversation: the shipped set's kind, "file" (--prompts) or "self" (self-generated)
    templates: list[str | None]  # per conversation: the template it was made from (None: it stands alone)


def default_prompt_set() -> PromptSet:
    prompts = training_prompts()
    return PromptSet([[{"role": "user", "content": p.text}] for p in prompts], [p.kind for p in prompts],
                     [p.template for p in prompts])


def file_prompt_set(conversations: Sequence[Conversation]) -> PromptSet:
    return PromptSet(list(conversations), ["file"] * len(conversations), [None] * len(conversations))


class PromptSplit(NamedTuple):
    """Prompt indices kept out of training, in disjoint sets: `prompts`, a random share of the given prompts (the
    same prompts whatever is appended after them, so heads stay comparable); `templates`, the other prompts of
    whole held-out templates; `self`, a random share of the self-generated prompts."""

    prompts: set[int]
    templates: set[int]
    self: set[int]
    template_names: list[str]

    @property
    def all(self) -> set[int]:
        return self.prompts | self.templates | self.self


def split_prompts(prompt_set: PromptSet, held_out_fraction: float, held_out_templates: float,
                  seed: int) -> PromptSplit:
    """`held_out_fraction` of the given prompts and of the self-generated ones, at random; then
    `held_out_templates` of each kind's templates (at least one of a kind that has two or more; 0: none)."""
    def share(indices: list[int], seed: int) -> set[int]:
        order = list(indices)
        random.Random(seed).shuffle(order)
        return set(order[: max(1, round(len(order) * held_out_fraction))]) if len(order) >= 2 else set()

    given = [i for i, kind in enumerate(prompt_set.kinds) if kind != "self"]
    generated = [i for i, kind in enumerate(prompt_set.kinds) if kind == "self"]
    prompts, generated_out = share(given, seed), share(generated, seed + 1)
    by_kind: dict[str, list[str]] = {}
    for kind, template in zip(prompt_set.kinds, prompt_set.templates):
        if template is not None and template not in by_kind.setdefault(kind, []):
            by_kind[kind].append(template)
    chosen: list[str] = []
    rng = random.Random(seed + 2)
    for kind in sorted(by_kind):
        names = by_kind[kind]
        if held_out_templates > 0 and len(names) >= 2:
            chosen += sorted(rng.sample(names, max(1, round(len(names) * held_out_templates))))
    templates = {i for i, t in enumerate(prompt_set.templates) if t in chosen and i not in prompts}
    return PromptSplit(prompts, templates, generated_out, chosen)
