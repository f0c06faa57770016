"""Sinks: log line and periodic logger, Prometheus names and labels, JSONL trace, `specd stats` CLI, Grafana."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.config import EngineConfig
from specd.errors import InvalidParameterError
from specd.metrics import trace_cli
from specd.metrics.log_sink import PREFIX, PeriodicLogger, format_log_line
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.stats import SpecStatsRecorder, StepPhaseTimes
from specd.metrics.trace import (
    TraceFinish,
    TraceFormatError,
    TraceHeader,
    TraceRecord,
    TraceSink,
    read_trace,
    recount,
)
from specd.testing import parse_log_line

TIMES = StepPhaseTimes(0.001, 0.02, 0.0005)
REPO = Path(__file__).parents[2]


def counts(*rows: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).T  # [3, num_seqs]


def drive(recorder: SpecStatsRecorder) -> None:
    """The worked example of docs/metrics.md."""
    recorder.record_step(["X", "Y"], counts((1, 1, 2), (4, 0, 1)), TIMES)
    recorder.record_step(["X", "Y"], counts((1, 1, 1), (4, 2, 3)), TIMES)
    recorder.record_step(["Y"], counts((0, 0, 1)), TIMES)
    recorder.finish_request("X")
    recorder.finish_request("Y")


# Log line ------------------------------------------------------------------------------------------
def test_log_line_shape_and_exact_parse() -> None:
    recorder = SpecStatsRecorder(k_max=4)
    drive(recorder)
    line = format_log_line(recorder.take_interval(), interval_s=10.0)
    assert line.startswith(PREFIX) and "\n" not in line
    assert "drafts=4 draft_tokens=10 accepted=4 emitted=7" in line
    assert "acceptance_rate=0.4000 accepted_tokens_per_draft=1.0000 mean_accepted_len=1.0000 tau=2.0000" in line
    assert "tokens_per_forward=2.6667 tokens_per_seq_step=1.6000" in line
    assert "per_position_acceptance=[0.7500,0.5000,0.0000,0.0000] conditional=[0.7500,1.0000,0.0000,n/a]" in line
    parsed = parse_log_line("INFO 12:00:00 engine.py:88] " + line)  # logger prefixes are skipped
    assert parsed["accepted_at"] == [3, 1, 0, 0]
    assert parsed["conditional"][3] is None
    assert parsed["interval_s"] == 10.0
    with pytest.raises(ValueError, match="not a speculation metrics line"):
        parse_log_line("INFO something else")


def test_log_line_with_k_max_zero_and_no_drafts() -> None:
    recorder = SpecStatsRecorder(k_max=0)
    recorder.record_step(["r"], counts((0, 0, 1)), TIMES)
    parsed = parse_log_line(format_log_line(recorder.snapshot()))
    assert parsed["per_position_acceptance"] == [] and parsed["acceptance_rate"] is None
    assert parsed["tokens_per_forward"] == 1.0


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_periodic_logger_cuts_exact_intervals_on_its_own_clock_idle_ones_included(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = SpecStatsRecorder(k_max=4)
    logger = logging.getLogger("specd.test.metrics")
    clock = FakeClock(100.0)
    periodic = PeriodicLogger(recorder, interval_s=5.0, logger=logger, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="specd.test.metrics"):
        drive(recorder)
        clock.now = 104.9
        assert periodic.tick() is None and periodic.seconds_to_next() == pytest.approx(0.1)
        clock.now = 105.0
        busy = periodic.tick()  # the last busy interval, logged at its boundary, not after the next step
        clock.now = 110.0
        first_idle = periodic.tick()
        clock.now = 115.0
        second_idle = periodic.tick()
        recorder.record_step(["Z"], counts((2, 2, 3)), TIMES)
        recorder.finish_request("Z")
        clock.now = 120.0
        back = periodic.tick()
        recorder.finish_request("W")  # an abort with no step: its interval is logged, not dropped
        clock.now = 125.0
        finish_only = periodic.tick()
        recorder.record_step(["V"], counts((0, 0, 1)), TIMES)
        clock.now = 127.5
        last = periodic.close()  # the partial last interval
    lines = [busy, first_idle, second_idle, back, finish_only, last]
    assert all(line is not None for line in lines)
    parsed = [parse_log_line(line or "") for line in lines]
    assert [p["interval_s"] for p in parsed] == [5.0, 5.0, 5.0, 5.0, 5.0, 2.5]
    assert [p["steps"] for p in parsed] == [3, 0, 0, 1, 0, 1]
    assert [p["finished_requests"] for p in parsed] == [2, 0, 0, 1, 1, 0]
    assert parsed[3]["accepted"] == 2 and parsed[0]["drafts"] == 4
    # The first idle line is INFO (the engine went idle), further idle ones DEBUG.
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG, logging.INFO, logging.INFO, logging.INFO]
    assert periodic.close() is None  # nothing since: no line


def test_periodic_logger_late_tick_covers_the_whole_gap_once() -> None:
    recorder = SpecStatsRecorder(k_max=2)
    clock = FakeClock(0.0)
    periodic = PeriodicLogger(recorder, interval_s=10.0, logger=logging.getLogger("specd.test.metrics"), clock=clock)
    recorder.record_step(["a"], counts((1, 1, 2)), TIMES)
    clock.now = 35.0  # three boundaries missed (a blocked caller): one line, saying it covers 35 s
    line = periodic.tick()
    assert line is not None and parse_log_line(line)["interval_s"] == 35.0
    assert periodic.seconds_to_next() == pytest.approx(5.0)  # back on the 10 s grid


def test_periodic_logger_thread_logs_without_steps_and_stops_on_close(caplog: pytest.LogCaptureFixture) -> None:
    recorder = SpecStatsRecorder(k_max=2)
    periodic = PeriodicLogger(recorder, interval_s=0.02, logger=logging.getLogger("specd.test.metrics"))
    with caplog.at_level(logging.INFO, logger="specd.test.metrics"):
        recorder.record_step(["a"], counts((1, 1, 2)), TIMES)
        periodic.start()
        deadline = time.monotonic() + 30.0
        while not any(r.getMessage().startswith(PREFIX) for r in caplog.records):
            assert time.monotonic() < deadline, "the timer thread logged nothing"
            time.sleep(0.01)
        periodic.close()
        count = len(caplog.records)
        time.sleep(0.1)
    assert len(caplog.records) == count  # stopped
    assert sum(parse_log_line(r.getMessage())["steps"] for r in caplog.records) == 1
    with pytest.raises(ValueError, match="interval_s"):
        PeriodicLogger(recorder, interval_s=0.0, logger=logging.getLogger("specd.test.metrics"))
    for bad in (1e-6, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidParameterError, match="log_stats_interval_s"):
            EngineConfig(log_stats_interval_s=bad)


# Prometheus ----------------------------------------------------------------------------------------
def exposition(registry: CollectorRegistry) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(generate_latest(registry).decode())}


def test_prometheus_families_types_and_shared_registry() -> None:
    registry = CollectorRegistry()
    server_metric = Counter("specd_requests", "Requests served by the server.", registry=registry)
    server_metric.inc()
    sink = PrometheusSink(registry, model="smol", proposer="ngram", k_policy="fixed")
    recorder = SpecStatsRecorder(k_max=4, sinks=[sink])
    drive(recorder)
    families = exposition(registry)
    for name in (
        "drafts",
        "draft_tokens",
        "accepted_tokens",
        "emitted_tokens",
        "steps",
        "spec_steps",
        "nonspec_seq_steps",
        "nonspec_tokens",
        "drafted_at_position",
        "reached_at_position",
        "accepted_at_position",
    ):
        assert families[f"specd_spec_decode_{name}"] == "counter"
    for name in ("accepted_length", "request_mean_acceptance_length", "phase_seconds"):
        assert families[f"specd_spec_decode_{name}"] == "histogram"
    assert families["specd_requests"] == "counter"
    assert not any(name.startswith("vllm:") for name in families)
    text = generate_latest(registry).decode()
    assert 'specd_spec_decode_drafts_total{k_policy="fixed",model="smol",proposer="ngram"} 4.0' in text
    assert ('specd_spec_decode_accepted_at_position_total{k_policy="fixed",model="smol",position="2",'
            'proposer="ngram"} 1.0') in text
    # A second sink in the same registry would collide: the registry's duplicate check catches it.
    with pytest.raises(ValueError, match="Duplicated"):
        SpecStatsRecorder(k_max=4, sinks=[PrometheusSink(registry, model="smol", proposer="ngram", k_policy="fixed")])


def test_prometheus_vllm_compat_names_labels_and_zero_based_position() -> None:
    registry = CollectorRegistry()
    recorder = SpecStatsRecorder(k_max=4, sinks=[PrometheusSink(registry, "smol", "ngram", "fixed", vllm_compat=True)])
    drive(recorder)
    text = generate_latest(registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="smol"} 4.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smol"} 10.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smol"} 4.0' in text
    # vLLM position 0 is our position 1 (accepted_at = [3, 1, 0, 0]).
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="0"} 3.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="1"} 1.0' in text
    assert exposition(registry)["vllm:spec_decode_num_drafts"] == "counter"


def test_prometheus_rejects_bad_buckets() -> None:
    with pytest.raises(ValueError, match="phase_buckets"):
        PrometheusSink(CollectorRegistry(), "m", "p", "fixed", phase_buckets=(0.1, 0.01))


# Trace ---------------------------------------------------------------------------------------------
def write_trace(path: Path) -> SpecStatsRecorder:
    with TraceSink(path, model="smol", proposer="ngram", k_policy="heuristic") as sink:
        recorder = SpecStatsRecorder(k_max=4, sinks=[sink])
        recorder.record_step(["X", "Y"], counts((1, 1, 2), (4, 0, 1)), TIMES)
        recorder.record_step(["X", "Y"], counts((1, 1, 1), (4, 2, 3)), TIMES)
        recorder.record_step(["Y"], counts((0, 0, 1)), TIMES)
        recorder.finish_request("X", "stop")
        recorder.finish_request("Y", "length")
    return recorder


def test_trace_lines_and_recount(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    recorder = write_trace(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 8  # a header, 5 (step, request) lines, 2 finish lines
    assert lines[0] == {"event": "header", "k_max": 4, "model": "smol", "proposer": "ngram", "k_policy": "heuristic",
                        "specd_version": lines[0]["specd_version"]}
    assert lines[2]["request_id"] == "Y" and (lines[2]["k"], lines[2]["accepted"], lines[2]["emitted"]) == (4, 0, 1)
    assert lines[2]["verify_s"] == TIMES.verify_s and lines[2]["step"] == 0
    assert lines[-1] == {"event": "finish", "time": lines[-1]["time"], "request_id": "Y", "finish_reason": "length"}
    records = read_trace(path)
    assert records[0] == TraceHeader(4, "smol", "ngram", "heuristic", lines[0]["specd_version"])  # round-trips
    assert isinstance(records[1], TraceRecord) and isinstance(records[-1], TraceFinish)
    assert [r.finish_reason for r in records if isinstance(r, TraceFinish)] == ["stop", "length"]
    assert recount(records, 4).counters == recorder.snapshot().counters
    with pytest.raises(ValueError, match="k_max"):
        recount(records, 3)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"step": 0}\nnot json\n', r"trace\.jsonl:1: missing field"),
        ("[1, 2]\n", r"trace\.jsonl:1: expected a JSON object"),
        ('\n{"event": "finish", "time": 1.0, "request_id": "a"}\n{oops\n', r"trace\.jsonl:3: not valid JSON"),
        ('{"event": "flush"}\n', "unknown event"),
        (
            '{"step":0,"time":1,"request_id":"a","k":2,"accepted":3,"emitted":1,"propose_s":0,"verify_s":0,'
            '"sample_s":0}\n',
            "accepted <= k",
        ),
        (
            '{"step":0,"time":1,"request_id":"a","k":"2","accepted":0,"emitted":1,"propose_s":0,"verify_s":0,'
            '"sample_s":0}\n',
            "'k' must be an integer",
        ),
    ],
)
def test_read_trace_names_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)


# CLI -----------------------------------------------------------------------------------------------
def test_cli_table_and_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path)
    assert trace_cli.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"drafts\s+4\n", out) and re.search(r"accepted_tokens\s+4\n", out)
    assert re.search(r"acceptance_rate\s+0\.4000\s+0\.6250", out)  # pooled, then mean per request
    assert "j=2" in out and "█" in out and "(1/2, 1/1)" in out


def test_cli_json_equals_recount(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    recorder = write_trace(path)
    assert trace_cli.main([str(path), "--json", "--k-max", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["counters"]["accepted_at"] == [3, 1, 0, 0]
    assert data["counters"]["drafts"] == recorder.snapshot().counters.drafts
    assert data["derived"]["conditional_acceptance_pooled"][3] is None


def test_cli_sizes_arrays_and_tau_buckets_from_the_header_like_the_live_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    with TraceSink(path, model="smol", proposer="ngram", k_policy="fixed") as sink:
        recorder = SpecStatsRecorder(k_max=6, sinks=[sink])  # no step uses k above 4
        drive(recorder)
    assert trace_cli.main([str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    live = recorder.snapshot().to_dict()
    assert data["counters"]["accepted_at"] == live["counters"]["accepted_at"] == [3, 1, 0, 0, 0, 0]
    assert data["per_request"] == live["per_request"]  # tau buckets up to k_max + 1 = 7 on both sides
    assert trace_cli.main([str(path)]) == 0
    assert "model 'smol', proposer ngram, k policy fixed, k_max 6" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv_tail", "content", "message"),
    [
        ([], None, "cannot read trace"),
        ([], '{"step": 0}\n', "trace.jsonl:1: missing field"),
        (["--k-max", "2"], "ok", "--k-max 2 is smaller than the largest k"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv_tail: list[str], content: str | None, message: str
) -> None:
    path = tmp_path / "trace.jsonl"
    if content == "ok":
        write_trace(path)
    elif content is not None:
        path.write_text(content)
    assert trace_cli.main([str(path), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


def test_cli_bad_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_cli.main(["--k-max", "x", "file"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, png = tmp_path / "trace.jsonl", tmp_path / "out.png"
    write_trace(path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert trace_cli.main([str(path), "--plot", str(png)]) == 2
        assert "needs matplotlib" in capsys.readouterr().err
    else:
        assert trace_cli.main([str(path), "--plot", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bar_rendering() -> None:
    assert trace_cli.bar(1.0, width=4) == "████"
    assert trace_cli.bar(0.0, width=4) == "    "
    assert trace_cli.bar(None, width=4) == "    "
    assert trace_cli.bar(0.5625, width=2) == "█▏"


# Grafana -------------------------------------------------------------------------------------------
def test_grafana_dashboard_is_valid_and_queries_exported_metrics() -> None:
    dashboard = json.loads((REPO / "docs/grafana/specd.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    registry = CollectorRegistry()
    drive(SpecStatsRecorder(k_max=4, sinks=[PrometheusSink(registry, "m", "ngram", "fixed")]))
    exported = {
        sample.name
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 8
    used = {name for expr in exprs for name in re.findall(r"specd_spec_decode_\w+", expr)}
    assert used and used <= exported, used - exported
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("acceptance rate", "tau", "accepted length", "per-position", "conditional", "heatmap", "phase"):
        assert topic in titles, topic
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
