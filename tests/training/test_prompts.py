"""The shipped training prompt set: diverse, deterministic, and disjoint from every benchmark prompt."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from specd.training.overlap import ReservedText, benchmark_texts
from specd.training.prompts import training_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from prompts import all_prompts  # bench/prompts.py


def test_prompt_set_is_large_diverse_and_deterministic() -> None:
    prompts = training_prompts()
    assert len(prompts) >= 300
    assert len({p.text for p in prompts}) == len(prompts)
    kinds = Counter(p.kind for p in prompts)
    assert set(kinds) == {"chat", "writing", "code", "qa", "summarise", "edit"}
    assert min(kinds.values()) >= 30
    assert training_prompts() == prompts


def test_every_templated_prompt_names_its_template() -> None:
    prompts = training_prompts()
    templates = Counter(p.template for p in prompts)
    assert all(p.template is None for p in prompts if p.kind == "qa")
    assert all(p.template is not None and p.template.startswith(p.kind + "/") for p in prompts if p.kind != "qa")
    assert len(templates) - 1 == 11 + 8 + 4 + 4 + 4  # chat, writing, code, summarise, edit (+ None)
    assert min(n for t, n in templates.items() if t is not None) >= 10


def test_no_training_prompt_shares_text_with_a_benchmark_prompt() -> None:
    bench = [m["content"] for p in all_prompts() for m in p.messages]
    assert set(bench) <= set(benchmark_texts())  # what self-generated prompts are filtered against
    reserved = ReservedText(bench)
    bench_lines = {line.strip().lower() for t in bench for line in t.splitlines() if len(line.split()) >= 4}
    for prompt in training_prompts():
        assert not reserved.overlaps(prompt.text), prompt.text
        assert all(line.strip().lower() not in bench_lines for line in prompt.text.splitlines()), prompt.text
