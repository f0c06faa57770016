"""The shipped training prompt set: diverse, deterministic, and disjoint from every benchmark prompt."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from specd.training.prompts import training_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from prompts import all_prompts  # bench/prompts.py

SHINGLE = 8


def shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def test_prompt_set_is_large_diverse_and_deterministic() -> None:
    prompts = training_prompts()
    assert len(prompts) >= 300
    assert len({p.text for p in prompts}) == len(prompts)
    kinds = Counter(p.kind for p in prompts)
    assert set(kinds) == {"chat", "writing", "code", "qa", "summarise", "edit"}
    assert min(kinds.values()) >= 30
    assert training_prompts() == prompts


def test_no_training_prompt_shares_text_with_a_benchmark_prompt() -> None:
    bench = [m["content"] for p in all_prompts() for m in p.messages]
    bench_shingles = set().union(*(shingles(t) for t in bench))
    bench_lines = {line.strip().lower() for t in bench for line in t.splitlines() if len(line.split()) >= 4}
    for prompt in training_prompts():
        assert not shingles(prompt.text) & bench_shingles, prompt.text
        assert prompt.text.strip().lower() not in bench_lines
        assert all(line.strip().lower() not in bench_lines for line in prompt.text.splitlines()), prompt.text
