"""Sinks cannot hurt requests or each other, and every sink takes its k_max from the recorder."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from specd.config import EngineConfig, SpeculationConfig
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.records import StepPhaseTimes, StepRecord
from specd.metrics.snapshots import RequestSpecStats
from specd.metrics.stats import SpecStatsRecorder
from specd.sampling.params import SamplingParams
from specd.testing import tiny_llm

TIMES = StepPhaseTimes(0.001, 0.02, 0.0005)


class Broken:
    """A sink that fails every call (a trace file on a full disk)."""

    def __init__(self) -> None:
        self.calls = 0

    def bind(self, recorder: SpecStatsRecorder) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def on_request_finished(self, request_id: str, stats: RequestSpecStats) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")


class Keeper:
    """A sink keeping what it was handed."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.finished: list[str] = []
        self.k_max: int | None = None

    def bind(self, recorder: SpecStatsRecorder) -> None:
        self.k_max = recorder.k_max

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record.step)

    def on_request_finished(self, request_id: str, stats: RequestSpecStats) -> None:
        self.finished.append(request_id)


def test_a_raising_sink_is_counted_logged_once_and_other_sinks_see_every_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken, keeper = Broken(), Keeper()
    recorder = SpecStatsRecorder(k_max=3, sinks=[broken, keeper])
    with caplog.at_level(logging.DEBUG, logger="specd.metrics"):
        for _ in range(4):
            recorder.record_counts(["a", "b"], [2, 0], [1, 0], [2, 1], TIMES)
        recorder.finish_request("a")
    assert keeper.k_max == 3
    assert keeper.steps == [0, 1, 2, 3] and keeper.finished == ["a"]
    assert broken.calls == 5 and recorder.sink_errors == 5
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Broken" in errors[0].getMessage() and errors[0].exc_info is not None
    assert recorder.snapshot().counters.drafts == 4  # the recorder's own counts are untouched


def test_a_raising_sink_leaves_every_request_finishing_normally_and_is_exported() -> None:
    registry = CollectorRegistry()
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=3)
    llm = tiny_llm(EngineConfig(speculation=spec, max_model_len=128, max_num_seqs=4),
                   stats_sinks=[Broken(), PrometheusSink(registry, "tiny", "ngram", "fixed")])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(["abcabcabc", "hello hello", "xyz", "one two one two"], params)
    assert [out.outputs[0].finish_reason for out in outputs] == ["length"] * 4
    assert all(len(out.outputs[0].token_ids) == 12 for out in outputs)
    metrics = llm.get_metrics()
    steps = metrics["counters"]["steps"]
    assert steps > 0 and metrics["sink_errors"] == steps + 4  # every step and every finish failed once
    text = generate_latest(registry).decode()
    assert f'specd_stats_sink_errors_total{{k_policy="fixed",model="tiny",proposer="ngram"}} {float(steps + 4)}' in text
    assert f'specd_spec_decode_steps_total{{k_policy="fixed",model="tiny",proposer="ngram"}} {float(steps)}' in text


def test_prometheus_sink_takes_k_max_from_the_recorder_once() -> None:
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, "m", "ngram", "fixed")
    assert generate_latest(registry) == b""  # nothing registered before the recorder binds it
    recorder = SpecStatsRecorder(k_max=6, sinks=[sink])
    recorder.record_counts(["r"], [6], [6], [7], TIMES)
    text = generate_latest(registry).decode()
    assert ('specd_spec_decode_accepted_at_position_total{k_policy="fixed",model="m",position="6",proposer="ngram"} '
            '1.0') in text
    assert 'position="7"' not in text
    with pytest.raises(ValueError, match="recorder: this PrometheusSink is already bound"):
        SpecStatsRecorder(k_max=6, sinks=[sink])
    # A k above the recorder's k_max is refused before any sink sees it.
    with pytest.raises(ValueError, match="k_max=6"):
        recorder.record_counts(["r"], [7], [0], [1], TIMES)
    text = generate_latest(registry).decode()
    assert 'specd_spec_decode_steps_total{k_policy="fixed",model="m",proposer="ngram"} 1.0' in text
