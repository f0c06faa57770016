"""JSONL step trace: a sink that writes one line per (step, request), a reader, and an independent recount.

Three kinds of line, one JSON object each. A step line per (step, request) that sampled; phase times are
the whole step's, repeated on each of its lines:
    {"step": 12, "time": 1733150000.123, "request_id": "req-7", "k": 4, "accepted": 2, "emitted": 3,
     "propose_s": 0.0011, "verify_s": 0.0213, "sample_s": 0.0004, "prefill_s": 0.0}
a prefill line per step whose forward prefilled prompt chunks (before that step's step lines, if any; a
prefill-only step has only this line):
    {"event": "prefill", "step": 11, "time": 1733150000.101, "tokens": 256, "propose_s": 0.0,
     "verify_s": 0.0, "sample_s": 0.0, "prefill_s": 0.0408}
a finish line when the engine finishes (or aborts) a request:
    {"event": "finish", "time": 1733150001.5, "request_id": "req-7", "finish_reason": "length"}
and, first, one header line saying what wrote the trace and the k_max its arrays are sized by:
    {"event": "header", "k_max": 4, "model": "...", "proposer": "ngram", "k_policy": "heuristic",
     "specd_version": "0.1.0"}

`recount` recomputes every counter straight from the lines with plain loops over positions. It shares
no arithmetic with the recorder (which derives per-position counters from a joint histogram), so
comparing the two is a real cross-check.
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, NamedTuple

from specd.errors import SpecdError
from specd.metrics.records import K0_CAUSES, SpecCounters, StepRecord, StepTotals
from specd.metrics.snapshots import PerRequestAggregates, RequestSpecStats, SpecMetricsSnapshot
from specd.metrics.stats import SpecStatsRecorder

_INT_FIELDS = ("step", "k", "accepted", "emitted")
_FLOAT_FIELDS = ("time", "propose_s", "verify_s", "sample_s")
_PREFILL_FIELDS = ("step", "tokens", "time", "propose_s", "verify_s", "sample_s", "prefill_s")


class TraceFormatError(SpecdError, ValueError):
    """A trace file is missing or a line is malformed; names the file and line."""


class TraceRecord(NamedTuple):
    """One step line: one request in one step."""

    step: int
    time: float
    request_id: str
    k: int
    accepted: int
    emitted: int
    propose_s: float
    verify_s: float
    sample_s: float
    prefill_s: float = 0.0  # absent in traces written before prefill was timed apart
    proposed: int | None = None  # the proposer's tokens before cuts; None (absent): k
    grammar_cut: int = 0  # of those, cut by a grammar before verification
    k0_cause: str = "other"  # why k == 0 (only on such lines)
    draft_forwards: int = 0  # the step's drafting work (step-level, repeated on each of its lines; absent: 0)
    draft_tokens_computed: int = 0


class TracePrefill(NamedTuple):
    """One prefill line: the step's forward prefilled `tokens` prompt tokens (all chunks together)."""

    step: int
    time: float
    tokens: int
    propose_s: float
    verify_s: float
    sample_s: float
    prefill_s: float


class TraceFinish(NamedTuple):
    """One finish line: the request's counters are final; its id may be reused afterwards."""

    time: float
    request_id: str
    finish_reason: str | None = None  # absent in traces written before it was recorded


class TraceHeader(NamedTuple):
    """The first line of a trace: what produced it, and the k_max every array and tau bucket is sized by."""

    k_max: int
    model: str
    proposer: str
    k_policy: str
    specd_version: str


TraceLine = TraceRecord | TracePrefill | TraceFinish | TraceHeader


class TraceSink:
    """StatsSink writing the JSONL trace to `path` (truncated on open), starting with a header line once the
    recorder binds it. close() it (or use `with`)."""

    def __init__(self, path: str | Path, model: str = "", proposer: str = "", k_policy: str = "") -> None:
        self.path = Path(path)
        self._meta = (model, proposer, k_policy)
        self._file: IO[str] = self.path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self._quoted_ids: dict[str, str] = {}  # request id -> its JSON string literal, while it runs
        self.k_max: int | None = None

    def bind(self, recorder: SpecStatsRecorder) -> None:
        """Take k_max from the recorder and write the header line."""
        self.k_max = recorder.k_max
        model, proposer, k_policy = self._meta
        header = {"event": "header", "k_max": recorder.k_max, "model": model, "proposer": proposer,
                  "k_policy": k_policy, "specd_version": _specd_version()}
        with self._lock:
            self._file.write(json.dumps(header) + "\n")

    def on_step(self, record: StepRecord) -> None:
        times = record.times
        phases = (f'"propose_s":{times.propose_s!r},"verify_s":{times.verify_s!r},"sample_s":{times.sample_s!r},'
                  f'"prefill_s":{times.prefill_s!r}}}\n')
        head = f'{{"step":{record.step},"time":{record.time_s!r},"request_id":'
        tail = "," + phases
        quoted_ids = self._quoted_ids
        lines = []
        if record.num_prefill_tokens:
            lines.append(f'{{"event":"prefill","step":{record.step},"time":{record.time_s!r},'
                         f'"tokens":{record.num_prefill_tokens},{phases}')
        proposed = record.num_proposed_tokens or record.num_draft_tokens
        grammar_cut = record.num_grammar_cut_tokens
        causes = record.k0_causes
        draft_work = ""
        if record.num_draft_forwards or record.num_computed_draft_tokens:
            draft_work = (f',"draft_forwards":{record.num_draft_forwards},'
                          f'"draft_tokens_computed":{record.num_computed_draft_tokens}')
        for index, (request_id, k, a, e, p) in enumerate(zip(
            record.request_ids, record.num_draft_tokens, record.num_accepted_tokens, record.num_emitted_tokens,
            proposed,
        )):
            quoted = quoted_ids.get(request_id)
            if quoted is None:
                quoted = quoted_ids[request_id] = json.dumps(request_id)
            extra = f',"proposed":{p}'
            if grammar_cut and grammar_cut[index]:
                extra += f',"grammar_cut":{grammar_cut[index]}'
            if not k:
                extra += f',"k0_cause":"{causes[index] if causes else "other"}"'
            if draft_work:  # step-level, repeated on each of its lines like the phase times
                extra += draft_work
            lines.append(f'{head}{quoted},"k":{k},"accepted":{a},"emitted":{e}{extra}{tail}')
        with self._lock:
            self._file.write("".join(lines))

    def on_request_finished(self, request_id: str, stats: RequestSpecStats) -> None:
        quoted = self._quoted_ids.pop(request_id, None) or json.dumps(request_id)
        reason = json.dumps(stats.finish_reason)
        line = f'{{"event":"finish","time":{time.time()!r},"request_id":{quoted},"finish_reason":{reason}}}\n'
        with self._lock:
            self._file.write(line)

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> TraceSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _parse_header(where: str, obj: dict[str, Any]) -> TraceHeader:
    k_max = obj.get("k_max")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
        raise TraceFormatError(f"{where}: header field 'k_max' must be an integer >= 0, got {k_max!r}")
    texts = [obj.get(name, "") for name in ("model", "proposer", "k_policy", "specd_version")]
    if not all(isinstance(text, str) for text in texts):
        raise TraceFormatError(f"{where}: header fields model, proposer, k_policy, specd_version must be strings")
    return TraceHeader(k_max, *texts)


def _specd_version() -> str:
    try:
        return importlib.metadata.version("specd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _parse_prefill(where: str, obj: dict[str, Any]) -> TracePrefill:
    for name in _PREFILL_FIELDS:
        value = obj.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise TraceFormatError(f"{where}: prefill line needs a number >= 0 in {name!r}, got {value!r}")
    for name in ("step", "tokens"):
        if not isinstance(obj[name], int):
            raise TraceFormatError(f"{where}: prefill line field {name!r} must be an integer, got {obj[name]!r}")
    return TracePrefill(
        obj["step"], float(obj["time"]), obj["tokens"],
        *(float(obj[name]) for name in ("propose_s", "verify_s", "sample_s", "prefill_s")),
    )


def _parse_line(path: Path, line_no: int, line: str) -> TraceLine:
    where = f"{path}:{line_no}"
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    event = obj.get("event", "step")
    if event == "finish":
        if not isinstance(obj.get("request_id"), str):
            raise TraceFormatError(f"{where}: finish line needs a string 'request_id'")
        if isinstance(obj.get("time"), bool) or not isinstance(obj.get("time"), (int, float)):
            raise TraceFormatError(f"{where}: finish line needs a number 'time'")
        reason = obj.get("finish_reason")
        if reason is not None and not isinstance(reason, str):
            raise TraceFormatError(f"{where}: finish line's 'finish_reason' must be a string or null")
        return TraceFinish(float(obj["time"]), obj["request_id"], reason)
    if event == "header":
        return _parse_header(where, obj)
    if event == "prefill":
        return _parse_prefill(where, obj)
    if event != "step":
        raise TraceFormatError(f"{where}: unknown event {event!r} (expected 'header', 'step', 'prefill' or 'finish')")
    for name in (*_INT_FIELDS, *_FLOAT_FIELDS, "request_id"):
        if name not in obj:
            raise TraceFormatError(f"{where}: missing field {name!r}")
    for name in _INT_FIELDS:
        if isinstance(obj[name], bool) or not isinstance(obj[name], int) or obj[name] < 0:
            raise TraceFormatError(f"{where}: field {name!r} must be an integer >= 0, got {obj[name]!r}")
    prefill_s = obj.get("prefill_s", 0.0)
    if isinstance(prefill_s, bool) or not isinstance(prefill_s, (int, float)) or prefill_s < 0:
        raise TraceFormatError(f"{where}: field 'prefill_s' must be a number >= 0, got {prefill_s!r}")
    for name in _FLOAT_FIELDS:
        if isinstance(obj[name], bool) or not isinstance(obj[name], (int, float)) or obj[name] < 0:
            raise TraceFormatError(f"{where}: field {name!r} must be a number >= 0, got {obj[name]!r}")
    if not isinstance(obj["request_id"], str):
        raise TraceFormatError(f"{where}: field 'request_id' must be a string")
    k, accepted, emitted = obj["k"], obj["accepted"], obj["emitted"]
    if accepted > k or emitted > accepted + 1:
        raise TraceFormatError(
            f"{where}: need accepted <= k and emitted <= accepted + 1, "
            f"got k={k}, accepted={accepted}, emitted={emitted}"
        )
    proposed, grammar_cut = obj.get("proposed", k), obj.get("grammar_cut", 0)
    draft_forwards, draft_tokens_computed = obj.get("draft_forwards", 0), obj.get("draft_tokens_computed", 0)
    for name, value in (("proposed", proposed), ("grammar_cut", grammar_cut), ("draft_forwards", draft_forwards),
                        ("draft_tokens_computed", draft_tokens_computed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceFormatError(f"{where}: field {name!r} must be an integer >= 0, got {value!r}")
    if not k <= proposed or grammar_cut > proposed - k:
        raise TraceFormatError(f"{where}: need k <= proposed and grammar_cut <= proposed - k, "
                               f"got k={k}, proposed={proposed}, grammar_cut={grammar_cut}")
    k0_cause = obj.get("k0_cause", "other")
    if k0_cause not in K0_CAUSES:
        raise TraceFormatError(f"{where}: field 'k0_cause' must be one of {', '.join(K0_CAUSES)}, got {k0_cause!r}")
    return TraceRecord(
        obj["step"],
        float(obj["time"]),
        obj["request_id"],
        k,
        accepted,
        emitted,
        float(obj["propose_s"]),
        float(obj["verify_s"]),
        float(obj["sample_s"]),
        float(prefill_s),
        proposed,
        grammar_cut,
        k0_cause,
        draft_forwards,
        draft_tokens_computed,
    )


def read_trace(path: str | Path) -> list[TraceLine]:
    """Parse a trace file; blank lines are skipped. Raises TraceFormatError naming the file and line."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            return [_parse_line(path, line_no, line) for line_no, line in enumerate(handle, start=1) if line.strip()]
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read trace ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None


class _Tally:
    """Plain running counts for one window of the recount."""

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.drafts = self.draft_tokens = self.accepted = self.emitted = 0
        self.nonspec_seq_steps = self.nonspec_tokens = 0
        self.drafted_at = [0] * (k_max + 1)  # index j = position j; index 0 unused
        self.reached_at = [0] * (k_max + 1)
        self.accepted_at = [0] * (k_max + 1)
        self.accepted_hist = [0] * (k_max + 1)
        self.joint = [[0] * (k_max + 1) for _ in range(k_max + 1)]  # joint[k][a]; row 0 unused
        self.proposed = self.grammar_cut = 0
        self.by_cause = dict.fromkeys(K0_CAUSES, 0)

    def add(self, k: int, accepted: int, emitted: int, proposed: int, grammar_cut: int, k0_cause: str) -> None:
        self.proposed += proposed
        self.grammar_cut += grammar_cut
        if k == 0:
            self.nonspec_seq_steps += 1
            self.nonspec_tokens += emitted
            self.by_cause[k0_cause] += 1
            return
        self.drafts += 1
        self.draft_tokens += k
        self.accepted += accepted
        self.emitted += emitted
        self.accepted_hist[accepted] += 1
        self.joint[k][accepted] += 1
        for position in range(1, k + 1):
            self.drafted_at[position] += 1
            if accepted >= position - 1:
                self.reached_at[position] += 1
            if accepted >= position:
                self.accepted_at[position] += 1

    def counters(self) -> SpecCounters:
        return SpecCounters(
            self.k_max,
            self.drafts,
            self.draft_tokens,
            self.accepted,
            self.emitted,
            self.nonspec_seq_steps,
            self.nonspec_tokens,
            tuple(self.drafted_at[1:]),
            tuple(self.reached_at[1:]),
            tuple(self.accepted_at[1:]),
            tuple(self.accepted_hist),
            tuple(tuple(row) for row in self.joint[1:]),
            self.proposed,
            self.grammar_cut,
            tuple(self.by_cause[cause] for cause in K0_CAUSES),
        )


def recount(records: Iterable[TraceLine], k_max: int) -> SpecMetricsSnapshot:
    """Recompute a snapshot from trace lines alone.

    Prefill lines count in steps, phase times and the prefill totals. Per-request aggregates cover the
    requests with a finish line, as in the recorder; requests still
    running when the trace ends count in the totals only. Phase times are taken once per step.
    Raises ValueError if a line's k exceeds k_max.
    """
    total = _Tally(k_max)
    per_request: dict[str, _Tally] = {}
    aggregates = PerRequestAggregates.zero(k_max)
    step_times: dict[int, tuple[float, float, float, float]] = {}
    spec_steps: set[int] = set()
    sampled_steps: set[int] = set()
    prefill_tokens: dict[int, int] = {}
    draft_work: dict[int, tuple[int, int]] = {}
    for record in records:
        if isinstance(record, TraceHeader):
            continue
        if isinstance(record, TracePrefill):
            prefill_tokens[record.step] = record.tokens
            step_times.setdefault(
                record.step, (record.propose_s, record.verify_s, record.sample_s, record.prefill_s)
            )
            continue
        if isinstance(record, TraceFinish):
            tally = per_request.pop(record.request_id, None)
            aggregates = aggregates.observe(tally.counters() if tally else SpecCounters.zero(k_max))
            continue
        if record.k > k_max:
            raise ValueError(f"k_max: trace line for step {record.step} has k={record.k} > k_max={k_max}")
        row = (record.k, record.accepted, record.emitted, record.k if record.proposed is None else record.proposed,
               record.grammar_cut, record.k0_cause)
        total.add(*row)
        per_request.setdefault(record.request_id, _Tally(k_max)).add(*row)
        step_times.setdefault(record.step, (record.propose_s, record.verify_s, record.sample_s, record.prefill_s))
        sampled_steps.add(record.step)
        draft_work.setdefault(record.step, (record.draft_forwards, record.draft_tokens_computed))
        if record.k > 0:
            spec_steps.add(record.step)
    totals = StepTotals(
        steps=len(step_times),
        spec_steps=len(spec_steps),
        propose_s=sum(times[0] for times in step_times.values()),
        verify_s=sum(times[1] for times in step_times.values()),
        sample_s=sum(times[2] for times in step_times.values()),
        prefill_steps=len(prefill_tokens),
        prefill_only_steps=len(prefill_tokens.keys() - sampled_steps),
        prefill_tokens=sum(prefill_tokens.values()),
        prefill_s=sum(step_times[step][3] for step in prefill_tokens),
        draft_forwards=sum(work[0] for work in draft_work.values()),
        draft_tokens_computed=sum(work[1] for work in draft_work.values()),
    )
    return SpecMetricsSnapshot(total.counters(), totals, aggregates)
