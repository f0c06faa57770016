"""Speculation statistics, computed in one place: the recorder the engine calls once per step.

Pure computation, no exporter imports. Sinks (log line, Prometheus, JSONL trace) only write what the
recorder hands them. The hot path (`record_counts`, or `record_step` for counts in one [3, num_seqs] tensor,
which costs one device-to-host copy) does a few integer increments per sequence; everything derived is
computed lazily when a snapshot is taken.

Running counters live in a flat list of ints ("cells"): cell k * (k_max + 1) + a counts sequence-steps
with (k_i, a_i) = (k, a) (cell 0 is the non-speculative sequence-steps), followed by the tokens emitted by
drafts and the tokens emitted by non-speculative sequence-steps. Every counter in SpecCounters is a
function of these cells, so the hot path touches three ints per sequence and window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence

import torch

from specd.metrics.fanout import SinkFanout, StatsSink
from specd.metrics.records import K0_CAUSES, K0Cause, SpecCounters, StepDetail, StepPhaseTimes, StepRecord, StepTotals
from specd.metrics.snapshots import PerRequestAggregates, RequestSpecStats, SpecMetricsSnapshot
from specd.metrics.speedup import PlainStepCost, SpeedupTotals, VerifyStepCost

__all__ = [
    "CounterCells",
    "RequestSpecStats",
    "SpecMetricsSnapshot",
    "SpecStatsRecorder",
    "StatsSink",
    "StepPhaseTimes",
    "StepRecord",
]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_CAUSE_INDEX: dict[str, int] = {cause: index for index, cause in enumerate(K0_CAUSES)}
_OTHER = _CAUSE_INDEX["other"]


class CounterCells:
    """Mutable running counters of one window in the flat cell layout; `freeze()` gives SpecCounters."""

    __slots__ = ("cause_base", "cells", "emitted_slot", "grammar_slot", "k_max", "nonspec_slot", "proposed_slot",
                 "width")

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.width = k_max + 1
        self.emitted_slot = self.width * self.width
        self.nonspec_slot = self.emitted_slot + 1
        self.proposed_slot = self.nonspec_slot + 1
        self.grammar_slot = self.proposed_slot + 1
        self.cause_base = self.grammar_slot + 1
        self.cells = [0] * (self.cause_base + len(K0_CAUSES))

    def add_step(self, record: StepRecord) -> None:
        """Add one already validated step record (a sink's copy of the recorder's counts)."""
        cells, width = self.cells, self.width
        causes = record.k0_causes
        for index, (k, a, e) in enumerate(
            zip(record.num_draft_tokens, record.num_accepted_tokens, record.num_emitted_tokens)
        ):
            cells[k * width + a] += 1
            if k:
                cells[self.emitted_slot] += e
            else:
                cells[self.nonspec_slot] += e
                cells[self.cause_base + (_CAUSE_INDEX[causes[index]] if causes else _OTHER)] += 1
        cells[self.proposed_slot] += sum(record.num_proposed_tokens or record.num_draft_tokens)
        cells[self.grammar_slot] += sum(record.num_grammar_cut_tokens)

    def freeze(self) -> SpecCounters:
        return counters_from_cells(self.cells, self.k_max)


def counters_from_cells(cells: Sequence[int], k_max: int) -> SpecCounters:
    """Derive every SpecCounters field from the flat cell layout (see module docstring).

    Per-position counters use difference arrays: a draft (k, a) adds 1 to drafted_at[1..k],
    reached_at[1..min(k, a + 1)] and accepted_at[1..a].
    """
    width = k_max + 1
    joint = [list(cells[k * width : (k + 1) * width]) for k in range(1, width)]  # [k_max][k_max + 1]
    drafted_diff = [0] * (k_max + 2)
    reached_diff = [0] * (k_max + 2)
    accepted_diff = [0] * (k_max + 2)
    accepted_hist = [0] * width
    drafts = draft_tokens = accepted_tokens = 0
    for k, row in enumerate(joint, start=1):
        for a, count in enumerate(row):
            if not count:
                continue
            drafts += count
            draft_tokens += k * count
            accepted_tokens += a * count
            accepted_hist[a] += count
            drafted_diff[1] += count
            drafted_diff[k + 1] -= count
            reached_diff[1] += count
            reached_diff[min(k, a + 1) + 1] -= count
            accepted_diff[1] += count
            accepted_diff[a + 1] -= count

    def prefix(diff: list[int]) -> tuple[int, ...]:
        out, running = [], 0
        for j in range(1, width):
            running += diff[j]
            out.append(running)
        return tuple(out)

    return SpecCounters(
        k_max=k_max,
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted_tokens,
        emitted_tokens=cells[width * width],
        nonspec_seq_steps=cells[0],
        nonspec_tokens=cells[width * width + 1],
        drafted_at=prefix(drafted_diff),
        reached_at=prefix(reached_diff),
        accepted_at=prefix(accepted_diff),
        accepted_length_hist=tuple(accepted_hist),
        joint_hist=tuple(tuple(row) for row in joint),
        proposed_tokens=cells[width * width + 2],
        cut_grammar_tokens=cells[width * width + 3],
        nonspec_by_cause=tuple(cells[width * width + 4 : width * width + 4 + len(K0_CAUSES)]),
    )


class SpecStatsRecorder:
    """Counts drafts, acceptances and emitted tokens per step, per request, per interval and in total.

    Thread-safe: the engine thread records steps while a server thread may take snapshots. Only one
    consumer should call take_interval() (normally the PeriodicLogger); others use snapshot().
    """

    def __init__(
        self,
        k_max: int,
        sinks: Sequence[StatsSink] = (),
    ) -> None:
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
            raise ValueError(f"k_max: must be an integer >= 0, got {k_max!r}")
        self.k_max = k_max
        self._sinks = tuple(sinks)
        self._fanout = SinkFanout(self._sinks)
        self._lock = threading.Lock()
        self._next_step = 0
        self._live: dict[str, CounterCells] = {}
        self._detail: dict[str, list[StepDetail]] = {}
        self._base = SpecMetricsSnapshot.zero(k_max)  # every closed interval, summed
        self._plain_cost = PlainStepCost()  # all-time: the speed-up estimate's denominator model
        self._verify_cost = VerifyStepCost()  # all-time: its fallback before any plain step is measured
        self._reset_interval()
        for sink in self._sinks:
            sink.bind(self)

    @property
    def sink_errors(self) -> int:
        """Exceptions raised by sinks so far (each one skipped that sink's call, nothing else)."""
        return self._fanout.errors

    def _reset_interval(self) -> None:
        self._interval = CounterCells(self.k_max)
        self._interval_steps = 0
        self._interval_spec_steps = 0
        self._interval_propose_s = 0.0
        self._interval_verify_s = 0.0
        self._interval_sample_s = 0.0
        self._interval_prefill_steps = 0
        self._interval_prefill_only_steps = 0
        self._interval_prefill_tokens = 0
        self._interval_prefill_s = 0.0
        self._interval_draft_forwards = 0
        self._interval_draft_tokens_computed = 0
        self._interval_requests = PerRequestAggregates.zero(self.k_max)
        self._interval_decode_s = 0.0  # the speed-up sums (metrics/speedup.py)
        self._interval_plain_decode_s = 0.0
        self._interval_unestimated_decode_steps = 0
        self._interval_modelled_decode_steps = 0

    def record_step(
        self,
        request_ids: Sequence[str],
        counts: torch.Tensor,  # [3, num_seqs] integer: rows k_i, a_i, e_i
        times: StepPhaseTimes,
        detail_request_ids: Collection[str] = frozenset(),
        num_prefill_tokens: int = 0,
        num_proposed: Sequence[int] = (),
        num_grammar_cut: Sequence[int] = (),
        k0_causes: Sequence[K0Cause] = (),
        num_draft_forwards: int = 0,
        num_computed_draft_tokens: int = 0,
    ) -> None:
        """`record_counts` for counts held in one tensor (e.g. on a device): one device-to-host copy.

        Raises ValueError, changing nothing, if the shape or dtype is wrong.
        """
        num_seqs = len(request_ids)
        if counts.dim() != 2 or counts.shape[0] != 3 or counts.shape[1] != num_seqs:
            raise ValueError(f"counts: expected shape [3, {num_seqs}], got {list(counts.shape)}")
        if counts.dtype not in _INT_DTYPES:
            raise ValueError(f"counts: expected an integer tensor, got {counts.dtype}")
        num_draft, num_accepted, num_emitted = counts.tolist()
        self.record_counts(
            request_ids, num_draft, num_accepted, num_emitted, times, detail_request_ids, num_prefill_tokens,
            num_proposed, num_grammar_cut, k0_causes, num_draft_forwards, num_computed_draft_tokens,
        )

    def record_counts(
        self,
        request_ids: Sequence[str],
        num_draft: Sequence[int],  # k_i per sequence
        num_accepted: Sequence[int],  # a_i
        num_emitted: Sequence[int],  # e_i
        times: StepPhaseTimes,
        detail_request_ids: Collection[str] = frozenset(),
        num_prefill_tokens: int = 0,
        num_proposed: Sequence[int] = (),  # p_i >= k_i: the proposer's tokens before cuts; () means p_i = k_i
        num_grammar_cut: Sequence[int] = (),  # g_i <= p_i - k_i: of those, cut by a grammar; () means 0
        k0_causes: Sequence[K0Cause] = (),  # why k_i == 0 (read only there); () means "other"
        num_draft_forwards: int = 0,  # draft-model forwards run to propose this step (Proposal.num_draft_forwards)
        num_computed_draft_tokens: int = 0,  # draft positions they computed (Proposal.num_computed_draft_tokens)
    ) -> None:
        """Add one engine step to every window and hand its record to every sink.

        Sequences with k_i == 0 are included (they count as non-speculative sequence-steps, by cause). A step
        that only prefilled prompt chunks has no sequences and num_prefill_tokens > 0: it counts in steps, the
        prefill totals and the phase times. p_i - k_i - g_i tokens were cut by the k policy. Raises ValueError,
        changing nothing, if the lengths differ or any value is out of range.
        """
        num_seqs = len(request_ids)
        if isinstance(num_prefill_tokens, bool) or not isinstance(num_prefill_tokens, int) or num_prefill_tokens < 0:
            raise ValueError(f"num_prefill_tokens: must be an integer >= 0, got {num_prefill_tokens!r}")
        for name, value in (("num_draft_forwards", num_draft_forwards),
                            ("num_computed_draft_tokens", num_computed_draft_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if num_seqs == 0 and num_prefill_tokens == 0:
            raise ValueError("request_ids: a step samples at least one sequence or prefills a prompt chunk")
        if not len(num_draft) == len(num_accepted) == len(num_emitted) == num_seqs:
            raise ValueError(f"counts: expected {num_seqs} (k_i, a_i, e_i) per sequence")
        num_draft, num_accepted, num_emitted = list(num_draft), list(num_accepted), list(num_emitted)
        num_proposed = list(num_proposed) if num_proposed else num_draft
        num_grammar_cut = list(num_grammar_cut)
        k0_causes = list(k0_causes)
        for name, values in (("num_proposed", num_proposed), ("num_grammar_cut", num_grammar_cut),
                             ("k0_causes", k0_causes)):
            if values and len(values) != num_seqs:
                raise ValueError(f"{name}: expected {num_seqs} values (one per sequence) or none")
        k_max = self.k_max
        for index, (k, a, e, p) in enumerate(zip(num_draft, num_accepted, num_emitted, num_proposed)):
            g = num_grammar_cut[index] if num_grammar_cut else 0
            if not (0 <= a <= k <= k_max and 0 <= e <= a + 1 and k <= p <= k_max and 0 <= g <= p - k):
                raise ValueError(
                    f"counts: sequence {index} ({request_ids[index]!r}) has k={k}, a={a}, e={e}, proposed={p}, "
                    f"grammar_cut={g}; need 0 <= a <= k <= proposed <= k_max={k_max}, 0 <= e <= a + 1 and "
                    f"0 <= grammar_cut <= proposed - k"
                )
            if k0_causes and k0_causes[index] not in _CAUSE_INDEX:
                raise ValueError(f"k0_causes: sequence {index} has {k0_causes[index]!r}; expected one of {K0_CAUSES}")
        now = time.time()
        with self._lock:
            step = self._next_step
            self._next_step += 1
            interval = self._interval
            cells, width = interval.cells, interval.width
            emitted_slot, nonspec_slot = interval.emitted_slot, interval.nonspec_slot
            proposed_slot, grammar_slot, cause_base = interval.proposed_slot, interval.grammar_slot, interval.cause_base
            live = self._live
            for index, (request_id, k, a, e, p) in enumerate(
                zip(request_ids, num_draft, num_accepted, num_emitted, num_proposed)
            ):
                cell = k * width + a
                request = live.get(request_id)
                if request is None:
                    request = live[request_id] = CounterCells(k_max)
                request_cells = request.cells
                cells[cell] += 1
                request_cells[cell] += 1
                if k:
                    cells[emitted_slot] += e
                    request_cells[emitted_slot] += e
                else:
                    cause = cause_base + (_CAUSE_INDEX[k0_causes[index]] if k0_causes else _OTHER)
                    cells[nonspec_slot] += e
                    request_cells[nonspec_slot] += e
                    cells[cause] += 1
                    request_cells[cause] += 1
                cells[proposed_slot] += p
                request_cells[proposed_slot] += p
                if num_grammar_cut and num_grammar_cut[index]:
                    cells[grammar_slot] += num_grammar_cut[index]
                    request_cells[grammar_slot] += num_grammar_cut[index]
            if detail_request_ids:
                self._record_detail(step, request_ids, num_draft, num_accepted, num_emitted, detail_request_ids)
            self._interval_steps += 1
            if any(num_draft):
                self._interval_spec_steps += 1
            self._interval_propose_s += times.propose_s
            self._interval_verify_s += times.verify_s
            self._interval_sample_s += times.sample_s
            if num_prefill_tokens:
                self._interval_prefill_steps += 1
                self._interval_prefill_only_steps += num_seqs == 0
                self._interval_prefill_tokens += num_prefill_tokens
                self._interval_prefill_s += times.prefill_s
            if num_draft_forwards or num_computed_draft_tokens:
                self._interval_draft_forwards += num_draft_forwards
                self._interval_draft_tokens_computed += num_computed_draft_tokens
            decode_s, plain_decode_s = self._add_speedup_locked(num_draft, num_emitted, times, num_prefill_tokens)
        if self._sinks:
            record = StepRecord(
                step, now, request_ids, num_draft, num_accepted, num_emitted, times, num_prefill_tokens,
                num_proposed, num_grammar_cut, k0_causes, decode_s, plain_decode_s, num_draft_forwards,
                num_computed_draft_tokens,
            )
            self._fanout.on_step(record)

    def _add_speedup_locked(
        self, num_draft: list[int], num_emitted: list[int], times: StepPhaseTimes, num_prefill_tokens: int
    ) -> tuple[float, float]:
        """Measure a plain decode step, add a decode step to the speed-up sums (metrics/speedup.py).

        Returns the step's (decode_s, plain_decode_s) contributions, (0, 0) when it adds none.
        """
        num_seqs = len(num_draft)
        if not num_seqs:
            return 0.0, 0.0
        if not num_prefill_tokens:
            num_drafted = sum(num_draft)
            if num_drafted:
                self._verify_cost.observe(num_seqs + num_drafted, times.verify_s + times.sample_s)
            else:
                self._plain_cost.observe(num_seqs, times.verify_s + times.sample_s)
        plain_step_s = self._plain_cost.estimate(num_seqs)
        if plain_step_s is None:
            plain_step_s = self._verify_cost.estimate(num_seqs)
            if plain_step_s is None:
                self._interval_unestimated_decode_steps += 1
                return 0.0, 0.0
            self._interval_modelled_decode_steps += 1
        decode_s = times.propose_s + times.verify_s + times.sample_s
        plain_decode_s = plain_step_s * sum(num_emitted) / num_seqs
        self._interval_decode_s += decode_s
        self._interval_plain_decode_s += plain_decode_s
        return decode_s, plain_decode_s

    def _record_detail(
        self,
        step: int,
        request_ids: Sequence[str],
        num_draft: list[int],
        num_accepted: list[int],
        num_emitted: list[int],
        detail_request_ids: Collection[str],
    ) -> None:
        for request_id, k, a, e in zip(request_ids, num_draft, num_accepted, num_emitted):
            if request_id in detail_request_ids:
                self._detail.setdefault(request_id, []).append(StepDetail(step, k, a, e))

    def _request_stats_locked(self, request_id: str, pop: bool, finish_reason: str | None = None) -> RequestSpecStats:
        cells = self._live.pop(request_id, None) if pop else self._live.get(request_id)
        detail = self._detail.pop(request_id, None) if pop else self._detail.get(request_id)
        counters = cells.freeze() if cells is not None else SpecCounters.zero(self.k_max)
        return RequestSpecStats(request_id, counters, tuple(detail) if detail is not None else None, finish_reason)

    def request_stats(self, request_id: str) -> RequestSpecStats:
        """Live counters of a running request (zero counters if it has not been in a step yet)."""
        with self._lock:
            return self._request_stats_locked(request_id, pop=False)

    def finish_request(self, request_id: str, finish_reason: str | None = None) -> RequestSpecStats:
        """Forget a finished or aborted request, add it to the per-request aggregates, notify sinks.

        A request that was never in a step is still counted as finished, with zero counters. finish_reason is
        carried on the returned stats (and the trace's finish line).
        """
        with self._lock:
            stats = self._request_stats_locked(request_id, pop=True, finish_reason=finish_reason)
            self._interval_requests = self._interval_requests.observe(stats.counters)
        if self._sinks:
            self._fanout.on_request_finished(request_id, stats)
        return stats

    def _interval_snapshot_locked(self) -> SpecMetricsSnapshot:
        totals = StepTotals(
            self._interval_steps,
            self._interval_spec_steps,
            self._interval_propose_s,
            self._interval_verify_s,
            self._interval_sample_s,
            self._interval_prefill_steps,
            self._interval_prefill_only_steps,
            self._interval_prefill_tokens,
            self._interval_prefill_s,
            self._interval_draft_forwards,
            self._interval_draft_tokens_computed,
        )
        speedup = SpeedupTotals(
            self._interval_decode_s, self._interval_plain_decode_s, self._interval_unestimated_decode_steps,
            self._interval_modelled_decode_steps,
        )
        return SpecMetricsSnapshot(self._interval.freeze(), totals, self._interval_requests, speedup)

    def snapshot(self) -> SpecMetricsSnapshot:
        """Cumulative counters since the recorder was created."""
        with self._lock:
            return self._base + self._interval_snapshot_locked()

    def take_interval(self) -> SpecMetricsSnapshot:
        """Counters since the previous take_interval() (or creation); starts a new interval."""
        with self._lock:
            interval = self._interval_snapshot_locked()
            self._base = self._base + interval
            self._reset_interval()
            return interval

    @property
    def live_request_ids(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._live)
