"""The training report of `specd train-draft`: report.json always, report.png when matplotlib is installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(directory: Path, report: dict[str, Any]) -> list[Path]:
    """Write report.json (and report.png: loss curve + held-out per-position acceptance); returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "report.json"]
    written[0].write_text(json.dumps(report, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    curve = report["loss_curve"]
    fig, (loss_ax, accept_ax) = plt.subplots(1, 2, figsize=(11, 4))
    loss_ax.plot(curve["steps"], curve["train_loss"], lw=0.8, label="train (all depths)")
    if curve["held_out_loss"]:
        steps, losses = zip(*curve["held_out_loss"])
        loss_ax.plot(steps, losses, "o-", label="held-out")
    loss_ax.set_xlabel("optimiser step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("training loss")
    loss_ax.legend()
    positions = range(1, len(report["held_out_acceptance_per_position"]) + 1)
    accept_ax.bar([p - 0.2 for p in positions], report["held_out_acceptance_per_position_untrained"], 0.4,
                  label="untrained" if report.get("init_from") is None else "before (--init-from)")
    accept_ax.bar([p + 0.2 for p in positions], report["held_out_acceptance_per_position"], 0.4, label="trained")
    accept_ax.set_xlabel("draft position")
    accept_ax.set_ylabel("P(accepted up to here), greedy")
    tau = report["held_out_tau"]["k=4"]
    accept_ax.set_title(f"held-out acceptance (tau at k=4: {tau:.2f})")
    accept_ax.legend()
    fig.tight_layout()
    png = directory / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    written.append(png)
    return written
