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
