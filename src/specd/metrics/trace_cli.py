"""`specd stats FILE`: recount a JSONL step trace; print every counter, derived value, per-position chart.

Exit codes: 0 on success, 2 on bad input (missing file, malformed line, bad option), with a message on
stderr that names the file and line and no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from specd.metrics.records import SCALAR_METRICS
from specd.metrics.snapshots import SpecMetricsSnapshot
from specd.metrics.trace import (
    TraceFinish,
    TraceFormatError,
    TraceHeader,
    TracePrefill,
    TraceRecord,
    read_trace,
    recount,
)

_BAR_WIDTH = 30
_EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(fraction: float | None, width: int = _BAR_WIDTH) -> str:
    """A unicode bar of `width` cells filled to `fraction` (eighth-cell resolution); blank when undefined."""
    if fraction is None:
        return " " * width
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, rest = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[rest] if rest else "")).ljust(width)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def render_table(snapshot: SpecMetricsSnapshot, out: TextIO) -> None:
    """Write the counters, derived values and per-position chart of a snapshot as plain text."""
    counters, totals = snapshot.counters, snapshot.step_totals
    rows: list[tuple[str, str]] = [
        ("steps", str(totals.steps)),
        ("spec_steps", str(totals.spec_steps)),
        ("drafts", str(counters.drafts)),
        ("draft_tokens", str(counters.draft_tokens)),
        ("accepted_tokens", str(counters.accepted_tokens)),
        ("emitted_tokens", str(counters.emitted_tokens)),
        ("nonspec_seq_steps", str(counters.nonspec_seq_steps)),
        ("nonspec_tokens", str(counters.nonspec_tokens)),
        ("target_forward_seq_steps", str(counters.target_forward_seq_steps)),
        ("proposed_tokens", str(counters.proposed_tokens)),
        ("cut_policy_tokens", str(counters.cut_policy_tokens)),
        ("cut_grammar_tokens", str(counters.cut_grammar_tokens)),
        ("rejected_tokens", str(counters.rejected_tokens)),
        ("past_stop_tokens", str(counters.past_stop_tokens)),
        ("draft_forwards", str(totals.draft_forwards)),
        ("draft_tokens_computed", str(totals.draft_tokens_computed)),
        ("requests", str(snapshot.per_request.finished_requests)),
        ("propose_s", f"{totals.propose_s:.6f}"),
        ("verify_s", f"{totals.verify_s:.6f}"),
        ("sample_s", f"{totals.sample_s:.6f}"),
        ("prefill_steps", str(totals.prefill_steps)),
        ("prefill_only_steps", str(totals.prefill_only_steps)),
        ("prefill_tokens", str(totals.prefill_tokens)),
        ("prefill_s", f"{totals.prefill_s:.6f}"),
    ]
    key_width = max(len(key) for key, _ in rows)
    out.write("counters\n")
    for key, value in rows:
        out.write(f"  {key:<{key_width}}  {value:>14}\n")
    out.write(f"\nderived{'pooled':>35}  {'mean per request':>16}\n")
    for metric in SCALAR_METRICS:
        out.write(
            f"  {metric:<30}  {_fmt(getattr(counters, metric)):>8}  {_fmt(snapshot.per_request.mean(metric)):>16}\n"
        )
    out.write(f"  {'tokens_per_target_forward':<30}  {_fmt(snapshot.tokens_per_target_forward):>8}  {'':>16}\n")
    out.write(
        "\naccepted length histogram (a: drafts)\n  "
        + "  ".join(f"{a}: {count}" for a, count in enumerate(counters.accepted_length_hist))
        + "\n"
    )
    out.write(
        f"\n  {'pos':<6}│{'accepted_at / drafted_at':<{_BAR_WIDTH}}│ {'':>6}   "
        f"│{'accepted_at / reached_at':<{_BAR_WIDTH}}│ (conditional)\n"
    )
    for position, (rate, conditional) in enumerate(
        zip(counters.per_position_acceptance, counters.conditional_acceptance), start=1
    ):
        out.write(
            f"  j={position:<3} │{bar(rate)}│ {_fmt(rate):>6}   │{bar(conditional)}│ {_fmt(conditional):>6}"
            f"   ({counters.accepted_at[position - 1]}/{counters.drafted_at[position - 1]},"
            f" {counters.accepted_at[position - 1]}/{counters.reached_at[position - 1]})\n"
        )


def plot_png(snapshot: SpecMetricsSnapshot, path: str) -> None:
    """Per-position acceptance and conditional acceptance as a bar chart PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counters = snapshot.counters
    positions = list(range(1, counters.k_max + 1))
    figure, axis = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    axis.bar(
        [p - width / 2 for p in positions],
        [v or 0.0 for v in counters.per_position_acceptance],
        width,
        label="accepted_at / drafted_at",
    )
    axis.bar(
        [p + width / 2 for p in positions],
        [v or 0.0 for v in counters.conditional_acceptance],
        width,
        label="accepted_at / reached_at",
    )
    axis.set_xlabel("draft position j")
    axis.set_ylabel("acceptance")
    axis.set_ylim(0, 1)
    axis.set_xticks(positions)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd stats", description="Speculation statistics of a JSONL step trace.")
    parser.add_argument("file", help="trace written by TraceSink (one JSON object per line)")
    parser.add_argument("--json", action="store_true", help="print the snapshot as JSON instead of a table")
    parser.add_argument("--plot", metavar="OUT.png", help="also write a per-position bar chart (needs matplotlib)")
    parser.add_argument("--k-max", type=int, default=None, help="k_max (default: the header's, else the largest k)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed its message
        return exc.code if isinstance(exc.code, int) else 2
    try:
        records = read_trace(args.file)
    except TraceFormatError as exc:
        print(f"specd stats: {exc}", file=sys.stderr)
        return 2
    largest_k = max((record.k for record in records if isinstance(record, TraceRecord)), default=0)
    header = next((record for record in records if isinstance(record, TraceHeader)), None)
    # The header's k_max sizes arrays and tau buckets as the live snapshot did; old traces fall back to the largest k.
    default_k_max = header.k_max if header is not None else largest_k
    k_max = default_k_max if args.k_max is None else args.k_max
    if k_max < largest_k:
        print(
            f"specd stats: --k-max {k_max} is smaller than the largest k ({largest_k}) in {args.file}",
            file=sys.stderr,
        )
        return 2
    snapshot = recount(records, k_max)
    if args.json:
        json.dump(snapshot.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        num_steps = sum(1 for record in records if isinstance(record, TraceRecord))
        num_finish = sum(1 for record in records if isinstance(record, TraceFinish))
        num_prefill = sum(1 for record in records if isinstance(record, TracePrefill))
        if header is not None:
            sys.stdout.write(f"{args.file}: model {header.model!r}, proposer {header.proposer}, k policy "
                             f"{header.k_policy}, k_max {header.k_max}, specd {header.specd_version}\n")
        sys.stdout.write(f"{args.file}: {num_steps} step lines, {num_prefill} prefill lines, "
                         f"{num_finish} finish lines\n\n")
        render_table(snapshot, sys.stdout)
    if args.plot:
        try:
            plot_png(snapshot, args.plot)
        except ImportError:
            print(
                "specd stats: --plot needs matplotlib; install it with `pip install 'specd[plot]'`",
                file=sys.stderr,
            )
            return 2
        except OSError as exc:
            print(f"specd stats: cannot write {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
