"""The goodput timeline: one bar per job of a run, coloured by where its time went.

Drawn by `spmd report RUN_DIR --plot` into RUN_DIR/plots/timeline.png from a ledger
(spmd.rundir.goodput). A bar starts at the job's start (seconds since the run's first job
started) and is as long as the job; its segments are the job's parts in the order a job goes
through them (bootstrap, restore, compile, training, evaluation, checkpoint, lost, other), so
segment lengths are exact and positions inside the bar are schematic. Gaps between bars are
the queue waits.
"""

from __future__ import annotations

from pathlib import Path

from spmd.rundir.goodput import PARTS, Ledger

COLOURS = {"bootstrap": "#9467bd", "restore": "#8c564b", "compile": "#e377c2",
           "training": "#2ca02c", "evaluation": "#1f77b4", "checkpoint": "#ff7f0e",
           "lost": "#d62728", "other": "#c7c7c7"}


def plot_timeline(ledger: Ledger, path: Path) -> Path:
    """Write the timeline PNG of `ledger` to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = ledger.jobs[0].start if ledger.jobs else 0.0
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.45 * max(len(ledger.jobs), 1)), dpi=110)
    for job in ledger.jobs:
        left = job.start - origin
        for part in PARTS:
            width = max(job.parts.get(part, 0.0), 0.0)
            if width > 0:
                ax.barh(job.index, width, left=left, color=COLOURS[part], edgecolor="none",
                        label=part)
                left += width
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="center left", fontsize=8,
              bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_yticks([j.index for j in ledger.jobs],
                  [f"job {j.index} ({j.job_id or '-'})" for j in ledger.jobs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first job started")
    ax.set_title(f"goodput {100 * ledger.goodput:.1f}% of {ledger.wall_s:,.0f} s")
    ax.grid(True, axis="x", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
