"""Text that training must never see: the benchmark prompts (bench/prompts.py), and the test that keeps a training
prompt away from them (no shared run of 8 words, no whole line of 4+ words in common).

Acceptance measured on the benchmarks is only honest if no training prompt repeats their text. The shipped prompt
set is checked by a test; self-generated prompts (specd.training.self_prompts) are checked here as they are made.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path

SHINGLE_WORDS = 8
MIN_LINE_WORDS = 4  # a shorter line ("Thank you.") is too common to count as shared text

_WORD = re.compile(r"[a-z0-9']+")


def words(text: str) -> list[str]:
    """Lower-cased words (letters, digits, apostrophes): what the overlap and duplicate tests compare."""
    return _WORD.findall(text.lower())


def shingles(text: str, size: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    """Every run of `size` consecutive words of `text`."""
    seq = words(text)
    return {tuple(seq[i : i + size]) for i in range(len(seq) - size + 1)}


class ReservedText:
    """Texts a training prompt must not share: any 8-word run, or the whole of any of their lines of 4-7 words
    (a short benchmark prompt such as "Explain how a rainbow forms." has no 8-word run to share)."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.num_texts = 0
        self._shingles: set[tuple[str, ...]] = set()
        self._short_lines: set[tuple[str, ...]] = set()
        for text in texts:
            self.num_texts += 1
            self._shingles |= shingles(text)
            for line in text.splitlines():
                line_words = tuple(words(line))
                if MIN_LINE_WORDS <= len(line_words) < SHINGLE_WORDS:
                    self._short_lines.add(line_words)

    def overlaps(self, text: str) -> bool:
        if shingles(text) & self._shingles:
            return True
        seq = words(text)
        lengths = {len(line) for line in self._short_lines}
        return any(tuple(seq[i : i + n]) in self._short_lines for n in lengths for i in range(len(seq) - n + 1))


def benchmark_prompt_file() -> Path:
    """bench/prompts.py of the source tree this package runs from (src/specd -> the repository root)."""
    return Path(__file__).resolve().parents[3] / "bench" / "prompts.py"


def benchmark_texts(path: Path | None = None) -> list[str]:
    """Every message of every benchmark prompt (all kinds, the extraction kind included), or [] when the package
    runs outside its source tree (an installed wheel has no bench/, so there is nothing to keep apart)."""
    path = path if path is not None else benchmark_prompt_file()
    if not path.is_file():
        return []
    spec = importlib.util.spec_from_file_location("_specd_bench_prompts", path)
    assert spec is not None and spec.loader is not None  # a .py file always has a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kinds = [*module.KINDS, module.EXTRACT_KIND]
    return [m["content"] for kind in kinds for prompt in module.prompts_of(kind) for m in prompt.messages]
