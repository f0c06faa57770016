"""bench/spec.py runs eagle and hybrid with every head of --draft-heads beside the shipped one, labelled apart."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import spec  # bench/spec.py


def test_each_extra_head_gets_its_own_eagle_settings(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["spec.py", "--methods", "ngram", "eagle", "--ks", "8", "--eagle-ks", "4",
                                      "--policies", "fixed", "--draft-heads", "/tmp/new-head"])
    args = spec.parse_args()
    settings = spec.settings_for(args)
    assert [s.label for s in settings] == ["ngram", "eagle", "eagle:new-head"]
    config = spec.engine_config(args, settings[2])
    assert config.speculation.draft_model == "/tmp/new-head"
    assert spec.engine_config(args, settings[1]).speculation.draft_model is None


def test_rounds_report_each_run_against_the_plain_runs_around_it() -> None:
    # Plain runs take 1, 2, 1 s and the setting 1 s then 1.5 s, for 10 tokens each: per round 10 / mean(10, 5) and
    # 6.67 / mean(5, 10), while the pooled speed-up is 20 / 2.5 s over 30 / 4 s.
    seconds = {"off": iter([1.0, 2.0, 1.0]), "ngram": iter([1.0, 1.5])}

    def run_one(setting: spec.Setting) -> spec.Run:
        return spec.Run([[1] * 10], next(seconds[setting.method]), None)

    group = spec.measure_group("specd", "code", 1, [spec.Setting("ngram", 8, "adaptive")], run_one, repeats=2)
    plain, row = group.rows
    assert plain.round_speedups == () and plain.speedup == 1.0
    assert row.round_speedups == (10 / 7.5, (10 / 1.5) / 7.5)
    assert abs(row.speedup - (20 / 2.5) / (30 / 4)) < 1e-12
    assert "per round" in spec.table(group.rows) and "1.11 (0.89-1.33)" in spec.table(group.rows)
    assert spec.spread(row.round_speedups) == "1.11 (0.89-1.33)"
    assert spec.spread(()) == "-"
