"""The replay in bench/peer_anatomy.py: tokens per forward of a drafter over a fixed text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peer_anatomy import hf_drafter, replay, specd_drafter


def test_replay_counts_steps_like_greedy_verification() -> None:
    text = list(range(100, 110))  # 10 tokens
    # No drafts: one token per forward.
    assert replay(lambda ctx: [], [[1, 2]], [text]) == 1.0
    # A perfect drafter of 3 tokens: every step emits 3 accepted + 1 of the target's own -> ceil(10 / 4) = 3 steps.
    oracle = {tuple([1, 2, *text[:i]]): text[i : i + 3] for i in range(len(text))}
    assert replay(lambda ctx: oracle[tuple(ctx)], [[1, 2]], [text]) == pytest.approx(10 / 3)
    # A wrong first draft token: nothing accepted, one token per forward.
    assert replay(lambda ctx: [0, 0], [[1, 2]], [text]) == 1.0


def test_both_proposers_copy_a_repeated_text() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    text = [5, 6, 7, 8, 9, 10, 11, 12]  # the answer repeats the prompt
    # The first context ends in 12 with no earlier 12, so neither proposer
    # drafts: 5 is emitted alone; then 6..12 are copied (k=8 covers all 7): 2 forwards for 8 tokens.
    assert replay(specd_drafter(8), [prompt], [text]) == pytest.approx(8 / 2)
    assert replay(hf_drafter(8), [prompt], [text]) == pytest.approx(8 / 2)
    # k bounds the copy: 1 + ceil(7 / 3) = 4 forwards with k = 2.
    assert replay(specd_drafter(2), [prompt], [text]) == pytest.approx(8 / 4)
    assert replay(hf_drafter(2), [prompt], [text]) == pytest.approx(8 / 4)
