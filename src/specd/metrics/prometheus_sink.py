"""Prometheus writer for speculation metrics, registered in a CollectorRegistry the caller owns.

Additive quantities are counters; ratios are left to PromQL (docs/metrics.md has the recipes). The
per-step counters and the accepted-length histogram are kept as running integer cells and turned into
metric families at scrape time (a custom collector), so a step costs a few list increments instead of
dozens of locked Counter.inc() calls, and a scrape always sees one consistent step boundary. Labels are
`model`, `proposer` and `k_policy` (the engine's configured k policy) on everything, never per request. With
vllm_compat=True the vLLM-v1 names (`vllm:spec_decode_*`, labels model_name and engine, 0-based position) are
exported as well, but only while the engine speculates (`speculating`): vLLM has no spec families with
speculation off either.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from specd.metrics.records import K0_CAUSES, StepRecord
from specd.metrics.snapshots import RequestSpecStats, tau_bucket_bounds
from specd.metrics.stats import CounterCells, SpecStatsRecorder

NAMESPACE = "specd_spec_decode"
DEFAULT_PHASE_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


class PrometheusSink:
    """StatsSink that exports specd_spec_decode_* metrics (and optionally vllm:spec_decode_*)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model: str,
        proposer: str,
        k_policy: str,
        vllm_compat: bool = False,
        vllm_engine: str = "0",
        phase_buckets: Sequence[float] = DEFAULT_PHASE_BUCKETS,
        speculating: bool = True,
    ) -> None:
        """Nothing is registered until the recorder binds the sink (its k_max sizes every family).

        k_policy: the engine's configured k policy, the `k_policy` label of every family (requests that pick
        another policy with SpecOverride count under it too: the recorder does not split by policy).
        speculating: False when the engine runs with speculation off: then no vllm:spec_decode_* family exists.
        """
        if list(phase_buckets) != sorted(set(phase_buckets)) or not phase_buckets:
            raise ValueError("phase_buckets: must be a non-empty strictly increasing sequence")
        for name, value in (("model", model), ("proposer", proposer), ("k_policy", k_policy)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: must be a non-empty string (a label value), got {value!r}")
        self._registry = registry
        self._phase_buckets = tuple(phase_buckets)
        self._labels = {"model": model, "proposer": proposer, "k_policy": k_policy}
        self._vllm_labels = {"model_name": model, "engine": vllm_engine} if vllm_compat and speculating else None
        self._lock = threading.Lock()
        self._recorder: SpecStatsRecorder | None = None
        self._steps = 0
        self._spec_steps = 0
        self._prefill_steps = 0
        self._prefill_tokens = 0
        self._draft_forwards = 0
        self._draft_tokens_computed = 0
        self._speedup_decode_s = 0.0
        self._speedup_plain_decode_s = 0.0

    def bind(self, recorder: SpecStatsRecorder) -> None:
        """Take k_max from the recorder and register in the registry (once: a sink serves one recorder)."""
        if self._recorder is not None:
            raise ValueError("recorder: this PrometheusSink is already bound to a recorder")
        label_names = tuple(self._labels)
        label_values = tuple(self._labels.values())
        registry = self._registry
        self.k_max = recorder.k_max
        self._cells = CounterCells(recorder.k_max)
        registry.register(self)
        self._recorder = recorder
        phase = Histogram(
            f"{NAMESPACE}_phase_seconds",
            "Seconds per step spent in each speculation phase.",
            labelnames=(*label_names, "phase"),
            buckets=self._phase_buckets,
            registry=registry,
        )
        self._propose = phase.labels(*label_values, "propose")
        self._verify = phase.labels(*label_values, "verify")
        self._sample = phase.labels(*label_values, "sample")
        self._prefill = phase.labels(*label_values, "prefill")
        self._request_tau = Histogram(
            f"{NAMESPACE}_request_mean_acceptance_length",
            "Mean acceptance length (tau = 1 + accepted/drafts) of each finished request that drafted.",
            labelnames=label_names,
            buckets=tau_bucket_bounds(recorder.k_max),
            registry=registry,
        ).labels(*label_values)

    # StatsSink -----------------------------------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        with self._lock:
            self._cells.add_step(record)
            self._steps += 1
            if any(record.num_draft_tokens):
                self._spec_steps += 1
            if record.num_prefill_tokens:
                self._prefill_steps += 1
                self._prefill_tokens += record.num_prefill_tokens
            self._speedup_decode_s += record.speedup_decode_s
            self._speedup_plain_decode_s += record.speedup_plain_decode_s
            self._draft_forwards += record.num_draft_forwards
            self._draft_tokens_computed += record.num_computed_draft_tokens
        self._propose.observe(record.times.propose_s)
        self._verify.observe(record.times.verify_s)
        self._sample.observe(record.times.sample_s)
        if record.num_prefill_tokens:  # observed on steps that prefill only, like the counters above
            self._prefill.observe(record.times.prefill_s)

    def on_request_finished(self, request_id: str, stats: RequestSpecStats) -> None:
        tau = stats.mean_acceptance_length
        if tau is not None:
            self._request_tau.observe(tau)

    # Collector -----------------------------------------------------------------------------------
    def describe(self) -> list[Metric]:
        """Names only (for the registry's duplicate check); no samples."""
        return list(self._families(with_samples=False))

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        if self._recorder is None:
            return
        with self._lock:
            counters = self._cells.freeze()
            steps, spec_steps = self._steps, self._spec_steps
            prefill_steps, prefill_tokens = self._prefill_steps, self._prefill_tokens
            speedup_decode_s, speedup_plain_decode_s = self._speedup_decode_s, self._speedup_plain_decode_s
            draft_forwards, draft_tokens_computed = self._draft_forwards, self._draft_tokens_computed
        sink_errors = self._recorder.sink_errors
        names, values = list(self._labels), list(self._labels.values())

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=names)
            if with_samples:
                family.add_metric(values, value)
            return family

        yield counter("drafts", "Drafts: (sequence, step) pairs with at least one draft token.", counters.drafts)
        yield counter("draft_tokens", "Draft tokens proposed.", counters.draft_tokens)
        yield counter(
            "accepted_tokens",
            "Draft tokens accepted by the verifier (before stop truncation).",
            counters.accepted_tokens,
        )
        yield counter(
            "emitted_tokens",
            "Tokens emitted by drafts (after stop truncation, bonus included).",
            counters.emitted_tokens,
        )
        sink_family = CounterMetricFamily(
            "specd_stats_sink_errors",
            "Exceptions raised by stats sinks (log, Prometheus, trace); each skipped one sink call, no request.",
            labels=names,
        )
        if with_samples:
            sink_family.add_metric(values, sink_errors)
        yield sink_family
        yield counter(
            "speedup_decode_seconds",
            "Seconds of decode steps with a plain-step cost estimate (propose + verify + sample).",
            speedup_decode_s,
        )
        yield counter(
            "speedup_plain_decode_seconds",
            "Estimated seconds plain decoding would have spent on the same tokens (docs/metrics.md, speed-up).",
            speedup_plain_decode_s,
        )
        yield counter("steps", "Engine steps recorded (every forward, prefill-only steps included).", steps)
        yield counter("spec_steps", "Steps with at least one draft.", spec_steps)
        yield counter("prefill_steps", "Steps whose forward prefilled at least one prompt chunk.", prefill_steps)
        yield counter("prefill_tokens", "Prompt tokens prefilled.", prefill_tokens)
        yield counter("nonspec_seq_steps", "Sequence-steps with no draft (k = 0).", counters.nonspec_seq_steps)
        yield counter("nonspec_tokens", "Tokens emitted by sequence-steps with no draft.", counters.nonspec_tokens)
        yield counter(
            "proposed_tokens",
            "Draft tokens the proposer produced, before the k policy or a grammar cut any (= verified + cut).",
            counters.proposed_tokens,
        )
        yield counter(
            "rejected_tokens", "Verified draft tokens the verifier rejected (draft_tokens - accepted_tokens).",
            counters.rejected_tokens,
        )
        yield counter(
            "past_stop_tokens",
            "Tokens computed and kept by the verifier, then thrown away by a stop token/string or max_tokens.",
            counters.past_stop_tokens,
        )
        yield counter(
            "draft_forwards", "Draft-model forward passes run to propose (batched passes count once; 0 for ngram).",
            draft_forwards,
        )
        yield counter(
            "draft_tokens_computed",
            "Draft positions computed by draft-model forwards, including those a stop rule (confidence) dropped.",
            draft_tokens_computed,
        )
        cut = CounterMetricFamily(
            f"{NAMESPACE}_cut_tokens", "Proposed draft tokens cut before verification, by cause.",
            labels=[*names, "cause"],
        )
        by_cause = CounterMetricFamily(
            f"{NAMESPACE}_nonspec_seq_steps_by_cause",
            "Sequence-steps with k = 0 by cause (sums to nonspec_seq_steps); docs/metrics.md lists the causes.",
            labels=[*names, "cause"],
        )
        if with_samples:
            cut.add_metric([*values, "policy"], counters.cut_policy_tokens)
            cut.add_metric([*values, "grammar"], counters.cut_grammar_tokens)
            for cause, count in zip(K0_CAUSES, counters.nonspec_by_cause):
                by_cause.add_metric([*values, cause], count)
        yield cut
        yield by_cause
        for name, doc, per_position in (
            ("drafted_at_position", "Drafts that proposed position j (k >= j).", counters.drafted_at),
            (
                "reached_at_position",
                "Drafts that proposed position j with positions < j accepted.",
                counters.reached_at,
            ),
            ("accepted_at_position", "Drafts whose position j was accepted (a >= j).", counters.accepted_at),
        ):
            family = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=[*names, "position"])
            if with_samples:
                for position, value in enumerate(per_position, start=1):
                    family.add_metric([*values, str(position)], value)
            yield family
        histogram = HistogramMetricFamily(
            f"{NAMESPACE}_accepted_length", "Accepted draft tokens per draft (a, 0..k_max).", labels=names
        )
        if with_samples:
            cumulative, buckets = 0, []
            for length, count in enumerate(counters.accepted_length_hist):
                cumulative += count
                buckets.append((str(float(length)), cumulative))
            buckets.append(("+Inf", cumulative))
            histogram.add_metric(values, buckets, sum_value=counters.accepted_tokens)
        yield histogram
        if self._vllm_labels is not None:
            yield from self._vllm_families(
                counters.drafts,
                counters.draft_tokens,
                counters.accepted_tokens,
                counters.accepted_at,
                with_samples,
            )

    def _vllm_families(
        self,
        drafts: int,
        draft_tokens: int,
        accepted_tokens: int,
        accepted_at: Sequence[int],
        with_samples: bool,
    ) -> Iterator[Metric]:
        assert self._vllm_labels is not None
        names, values = list(self._vllm_labels), list(self._vllm_labels.values())
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            if with_samples:
                family.add_metric(values, value)
            yield family
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*names, "position"],
        )
        if with_samples:
            for position, value in enumerate(accepted_at):  # vLLM's position label is 0-based
                family.add_metric([*values, str(position)], value)
        yield family
