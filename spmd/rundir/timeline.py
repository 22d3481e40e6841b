"""The goodput timeline: one row per job of a run, its time coloured by part, in time order.

Drawn by `spmd report RUN_DIR --plot` into RUN_DIR/plots/timeline.png from a ledger
(spmd.rundir.goodput). The x axis is seconds since the run's first job started. Each job's
row holds its `segments`: the parts where its records place them (an evaluation, a compile, a
save ends at its record's time and lasts its `seconds`; the train loop's unclaimed time is
training, its last `lost` seconds lost work), so the bar reads left to right in the order
things happened. The gap before a job (queue, or between runs) is drawn on its row, hatched.
Each bar ends with how the job ended (finished, preempted, failed on rank r, lost).
"""

from __future__ import annotations

from pathlib import Path

from spmd.rundir.goodput import GAPS, PARTS, Job, Ledger

COLOURS = {"bootstrap": "#9467bd", "restore": "#8c564b", "init": "#bcbd22",
           "compile": "#e377c2", "training": "#2ca02c", "evaluation": "#1f77b4",
           "checkpoint": "#ff7f0e", "lost": "#d62728", "other": "#c7c7c7",
           "queue": "#e8e8e8", "between_runs": "#ffffff"}
LABELS = {"between_runs": "between runs"}


def ending(job: Job) -> str:
    """How the job ended, in a word or three: the label at the end of its bar."""
    if job.failure is not None:
        return f"failed (rank {job.failure.rank})"
    return job.reason.split(" (")[0].split(":")[0]


def plot_timeline(ledger: Ledger, path: Path) -> Path:
    """Write the timeline PNG of `ledger` to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = timeline_figure(ledger)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def timeline_figure(ledger: Ledger):
    """The timeline's matplotlib figure: per job, its gap, then its segments left to right
    (each a bar whose `get_gid()` is its part)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = ledger.jobs[0].start if ledger.jobs else 0.0
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.45 * max(len(ledger.jobs), 1)), dpi=110)
    used: set[str] = set()
    previous_end = None
    for job in ledger.jobs:
        if previous_end is not None and job.gap_before and job.start > previous_end:
            ax.barh(job.index, job.start - previous_end, left=previous_end - origin,
                    color=COLOURS[job.gap_before], edgecolor="#999999", hatch="//",
                    linewidth=0.5, gid=job.gap_before)
            used.add(job.gap_before)
        for a, b, part in job.segments:
            ax.barh(job.index, b - a, left=a - origin, color=COLOURS[part], edgecolor="none",
                    gid=part)
            used.add(part)
        ax.text(job.end - origin, job.index, f" {ending(job)}", va="center", fontsize=7,
                color="#d62728" if job.failure is not None else "#333333")
        previous_end = job.end
    handles = [Patch(facecolor=COLOURS[p], edgecolor="#999999" if p in GAPS else "none",
                     hatch="//" if p in GAPS else None, label=LABELS.get(p, p))
               for p in (*PARTS, *GAPS) if p in used]
    ax.legend(handles=handles, loc="center left", fontsize=8, bbox_to_anchor=(1.01, 0.5),
              frameon=False)
    ax.set_yticks([j.index for j in ledger.jobs],
                  [f"job {j.index} ({j.job_id or '-'})" for j in ledger.jobs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first job started")
    ax.set_title(f"goodput {100 * ledger.goodput:.1f}% of {ledger.wall_s:,.0f} s")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlim(0, 1.15 * max(ledger.wall_s, 1e-3))   # room for the last bar's label
    fig.tight_layout()
    return fig
