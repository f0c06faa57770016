"""bench/scale.py's arithmetic and table: the KL and top-1 it reports, and the RSS-less-KV column."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from scale import divergence, render


def test_divergence_is_zero_for_the_same_logits_and_the_kl_of_two_known_distributions() -> None:
    logits = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    kl, top1 = divergence(logits, logits + 3.0)  # a shift leaves the distribution as it is
    assert abs(kl) < 1e-9 and top1 == 1.0
    reference = np.log(np.array([[0.5, 0.5]]))
    other = np.log(np.array([[0.25, 0.75]]))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl, top1 = divergence(reference, other)
    assert abs(kl - expected) < 1e-12 and top1 == 0.0  # the tie takes index 0, the other distribution 1


def test_the_table_subtracts_each_engines_kv_cache_from_its_rss() -> None:
    run = {"ttft_s": 0.1, "first_all_s": 0.1, "total_s": 1.1, "num_tokens": 11, "num_decode_tokens": 10,
           "decode_cpu_s": 0.5}
    memory = {"load_s": 1.0, "rss_mib": 1000.0, "peak_mib": 1100.0, "load_peak_mib": 1050.0, "kv_mib": 400.0}
    report = [{"size": "1b", "type": "Q4_0", "file_mib": 600.0, "engines": {"specd": {
        "memory": memory, "runs": {"ttft100": [run], "decode_b1": [run], "decode_b8": [run]}}},
        "precision": {"specd": (0.01, 0.9)}}]
    table = render(report, argparse.Namespace(prompt_lengths=[100]))
    row = table.splitlines()[2].split(" | ")
    assert row[4:8] == ["1000", "400", "600", "1050"]
    assert row[-3] == "10.0 (10.0-10.0)" and "0.0100 / 0.900" in row[-1]
