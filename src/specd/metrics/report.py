"""Human-readable text for one request's speculation stats (`specd generate --stats`)."""

from __future__ import annotations

from specd.metrics.records import SCALAR_METRICS
from specd.metrics.snapshots import RequestSpecStats
from specd.metrics.trace_cli import bar


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_request_stats(stats: RequestSpecStats) -> str:
    c = stats.counters
    lines = [
        f"speculation stats for {stats.request_id}:",
        f"  drafts={c.drafts} draft_tokens={c.draft_tokens} accepted_tokens={c.accepted_tokens} "
        f"emitted_tokens={c.emitted_tokens} nonspec_seq_steps={c.nonspec_seq_steps} nonspec_tokens={c.nonspec_tokens}",
    ]
    lines += [f"  {metric:<28} {_fmt(getattr(c, metric))}" for metric in SCALAR_METRICS]
    lines.append("  accepted length histogram: " + " ".join(f"{a}:{n}" for a, n in enumerate(c.accepted_length_hist)))
    lines.append("  per position: accepted_at/drafted_at | accepted_at/reached_at (conditional)")
    for j, (rate, cond) in enumerate(zip(c.per_position_acceptance, c.conditional_acceptance), start=1):
        if c.drafted_at[j - 1] == 0:
            continue
        lines.append(f"  j={j:<2} {bar(rate)} {_fmt(rate):>6} | {bar(cond)} {_fmt(cond):>6}")
    if stats.steps:
        lines.append("  steps (step: k, accepted, emitted): "
                     + ", ".join(f"{s.step}:{s.k},{s.accepted},{s.emitted}" for s in stats.steps))
    return "\n".join(lines)
