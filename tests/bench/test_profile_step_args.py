"""bench/profile_step.py refuses option combinations it could not honour, naming the flag."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import profile_step  # bench/profile_step.py


@pytest.mark.parametrize("argv", [["--fused-only", "--variants", "fused"], ["--batch", "0"]])
def test_bad_arguments_exit_2_naming_the_flag(monkeypatch, capsys, argv) -> None:
    monkeypatch.setattr(sys, "argv", ["profile_step.py", *argv])
    with pytest.raises(SystemExit) as exited:
        profile_step.main()
    assert exited.value.code == 2
    flag = "--variants" if "--variants" in argv else "--batch"
    assert flag in capsys.readouterr().err
