"""The `specd` command line, run in-process: models, generate (--json; --chat --stats with a trace and the
periodic log line), stats (table and --json), and bad input (exit status 2, a message naming the problem,
no traceback).

Tests that need the default model are marked integration; the ones that load it are kept to two calls.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from specd import cli
from specd.metrics.log_sink import PREFIX
from specd.testing import parse_log_line

COUNTER_KEYS = ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens", "nonspec_seq_steps", "nonspec_tokens")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be rejected before the (slow) model load; loading at all is a failure."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded although the arguments are invalid")

    monkeypatch.setattr(cli.LLM, "from_config", refuse)


# ------------------------------------------------------------------------------ bad input (no model)
@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-p", "0"], "top_p"),
        (["--spec", "ngram", "--k-policy", "confidence"], "speculation.k_policy"),
        (["--spec", "ngram", "--num-spec-tokens", "0"], "speculation.num_speculative_tokens"),
        (["--max-model-len", "1"], "max_model_len"),
    ],
)
def test_generate_bad_value_exits_2_naming_the_field(capsys, no_model_load, argv: list[str], field: str) -> None:
    code, out, err = run_cli(capsys, "generate", "x", *argv)
    assert code == 2
    assert f"specd: error: {field}:" in err
    assert "Traceback" not in err and out == ""


def test_generate_unknown_choice_is_an_argparse_error(capsys, no_model_load) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "x", "--spec", "medusa"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--spec" in err and "invalid choice" in err and "Traceback" not in err


def test_stats_missing_file_exits_2_with_a_clear_message(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "missing-file.jsonl"
    code, out, err = run_cli(capsys, "stats", str(missing))
    assert code == 2
    assert err.startswith("specd stats: ") and str(missing) in err and "cannot read trace" in err
    assert "Traceback" not in err and out == ""


# --------------------------------------------------------------------------- the default model
@pytest.mark.integration
def test_models_describes_the_default_model(capsys) -> None:
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    default = json.loads(out)["default"]
    assert default["name"] == "default" and default["model"] == "SmolLM2-135M-Instruct"
    assert Path(default["path"]).is_file() and default["path"].endswith(".gguf")
    assert default["file_size_bytes"] == Path(default["path"]).stat().st_size
    assert 100e6 < default["num_parameters"] < 200e6
    assert "Q4_1" in default["quantization"]
    arch = default["architecture"]
    assert (arch["vocab_size"], arch["hidden_size"], arch["num_layers"]) == (49152, 576, 30)


@pytest.mark.integration
def test_generate_json(capsys) -> None:
    code, out, err = run_cli(
        capsys, "generate", "The capital of France is", "--json", "--max-tokens", "8", "--max-model-len", "256"
    )
    assert code == 0
    data = json.loads(out)  # stdout holds the JSON document and nothing else
    assert isinstance(data["text"], str) and data["text"]
    assert 1 <= len(data["token_ids"]) <= 8 and all(isinstance(t, int) for t in data["token_ids"])
    assert data["finish_reason"] in ("length", "stop")
    assert data["num_prompt_tokens"] > 0
    timings = data["timings"]
    assert timings["load_s"] > 0 and timings["generate_s"] > 0 and timings["tokens_per_s"] > 0
    assert 0 < timings["ttft_s"] <= timings["generate_s"]
    counters = data["spec_stats"]["counters"]
    assert counters["drafts"] == 0  # speculation is off by default
    assert counters["nonspec_tokens"] == len(data["token_ids"])
    assert "[specd] loaded" in err


def _stderr_stats(err: str) -> dict[str, int]:
    match = re.search(
        r"drafts=(\d+) draft_tokens=(\d+) accepted_tokens=(\d+) emitted_tokens=(\d+) "
        r"nonspec_seq_steps=(\d+) nonspec_tokens=(\d+)",
        err,
    )
    assert match, f"no speculation stats on stderr:\n{err}"
    return dict(zip(COUNTER_KEYS, map(int, match.groups())))


@pytest.mark.integration
def test_generate_chat_stats_trace_and_log_then_stats(capsys, caplog, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    caplog.set_level(logging.INFO, logger="specd")
    code, out, err = run_cli(
        capsys, "generate", "Repeat exactly: the quick brown fox jumps over the lazy dog.", "--chat", "--stats",
        "--spec", "ngram", "--k-policy", "heuristic", "--max-tokens", "16", "--max-model-len", "512",
        "--spec-trace", str(trace), "--log-stats-interval", "0.05",
    )
    assert code == 0
    assert "quick brown fox" in out  # the reply, streamed to stdout
    assert "speculation: ngram" in err and "speculation stats for" in err
    assert "acceptance_rate" in err and "j=1" in err  # derived values and the per-position bars
    printed = _stderr_stats(err)
    assert printed["drafts"] > 0 and printed["accepted_tokens"] > 0

    # `specd stats FILE`: the table and the per-position bar chart.
    code, table, table_err = run_cli(capsys, "stats", str(trace))
    assert code == 0 and table_err == ""
    assert "step lines, " in table and "prefill lines, 1 finish lines" in table
    for heading in ("counters", "derived", "accepted length histogram", "accepted_at / drafted_at"):
        assert heading in table
    for key, value in printed.items():
        assert re.search(rf"^\s+{key}\s+{value}$", table, re.MULTILINE), key
    positions = [line for line in table.splitlines() if line.strip().startswith("j=")]
    assert len(positions) == 4 and "█" in table  # k_max = 4 (the largest k), some acceptance drawn as a bar

    # `specd stats FILE --json`: the same counters as the request's own stats, printed by generate.
    code, as_json, _ = run_cli(capsys, "stats", str(trace), "--json")
    assert code == 0
    recount = json.loads(as_json)
    assert {key: recount["counters"][key] for key in COUNTER_KEYS} == printed
    assert recount["per_request"]["finished_requests"] == 1

    # --log-stats-interval: the interval lines add up to the same counters.
    lines = [parse_log_line(r.getMessage()) for r in caplog.records if r.getMessage().startswith(PREFIX)]
    assert lines
    assert sum(line["drafts"] for line in lines) == printed["drafts"]
    assert sum(line["accepted"] for line in lines) == printed["accepted_tokens"]
    assert sum(line["emitted"] for line in lines) == printed["emitted_tokens"]
    assert sum(line["nonspec_tokens"] for line in lines) == printed["nonspec_tokens"]


def test_the_cli_default_dtype_is_the_engine_default_the_fast_mode() -> None:
    import argparse

    from specd.config import EngineConfig

    parser = argparse.ArgumentParser()
    cli.add_engine_arguments(parser)
    args = parser.parse_args([])
    assert args.dtype == EngineConfig().dtype == "int4"
    assert cli.engine_config_from_args(parser.parse_args(["--dtype", "float32"])).dtype == "float32"
