"""`spmd report RUN_DIR [--json] [--plot]`: the goodput ledger of a run, over every job.

Reads the whole history of a run directory (events.jsonl, metrics.jsonl and the records a
resume moved to metrics.replayed.jsonl, config.yaml) and
prints one row per job (first submission, requeues, chained jobs, reruns) with how it ended
(a failed job: which rank, when, and its error, in full below the table), the gaps between
jobs (queue, or between runs), the parts the wall time splits into, and the goodput
(spmd.rundir.goodput defines every part), then the ranks named as stragglers
(spmd.rundir.stragglers_report). `--plot` also draws RUN_DIR/plots/timeline.png, the jobs'
parts in the order they happened (spmd.rundir.timeline).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from spmd.errors import SpmdError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="goodput ledger of a run: every job, where the time "
                                      "went, failures, lost work, the gaps between jobs")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (run.dir)")
    p.add_argument("--json", action="store_true", help="print the ledger as JSON")
    p.add_argument("--plot", action="store_true",
                   help="also draw RUN_DIR/plots/timeline.png (one bar per job, its "
                        "parts in the order they happened)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.rundir.goodput import build_ledger
    from spmd.rundir.metrics import read_jsonl, replayed_path
    from spmd.rundir.stragglers_report import format_stragglers, stragglers

    run_dir = Path(args.run_dir)
    events_path = run_dir / "events.jsonl"
    if not events_path.is_file():
        raise SpmdError(f"{events_path}: no events; is {run_dir} a run directory (run.dir)?")
    events = read_jsonl(events_path)
    # the records a resume moved aside (steps trained again) still count for the job that
    # wrote them: lost time
    metrics = run_dir / "metrics.jsonl"
    records = sorted(_records(replayed_path(metrics)) + _records(metrics),
                     key=lambda r: r.get("time", 0.0))
    ledger = build_ledger(events, records, _batch_size(run_dir))
    slow = stragglers(events)
    if not ledger.jobs:
        raise SpmdError(f"{events_path}: no job has started in this run directory yet")
    plot = None
    if args.plot:
        from spmd.rundir.timeline import plot_timeline

        plot = plot_timeline(ledger, run_dir / "plots" / "timeline.png")
    if args.json:
        print(json.dumps({"run_dir": str(run_dir), **ledger.as_dict(),
                          "stragglers": [s.as_dict() for s in slow],
                          "plot": str(plot) if plot else None}, indent=1))
        return 0
    print(format_ledger(ledger))
    print(format_stragglers(slow))
    if plot is not None:
        print(plot)
    return 0


def _records(path: Path) -> list[dict]:
    """metrics.jsonl, skipping a line cut short by a killed run."""
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def _batch_size(run_dir: Path) -> int | None:
    import yaml

    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    train = (yaml.safe_load(config.read_text()) or {}).get("train") or {}
    return train.get("batch_size")


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


REASON_WIDTH = 72   # the table's "why it ended"; a failure's whole cause is printed below it
GAP_NAMES = {"queue": "queue", "between_runs": "between runs"}


def _short(text: str, width: int = REASON_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def format_ledger(ledger) -> str:
    from spmd.rundir.goodput import GAPS, PARTS

    rows = [("job", "job id", "restarts", "nodes x ranks", "start", "end", "wall s", "steps",
             "exit", "why it ended")]
    for j in ledger.jobs:
        began = "-" if j.restored_step is None else f"{j.restored_step}"
        steps = ("-" if j.restored_step is None and j.last_step is None
                 else f"{began}->{'-' if j.last_step is None else j.last_step}")
        rows.append((str(j.index), str(j.job_id or "-"), str(j.restart_count),
                     f"{j.nodes or '?'} x {j.ranks or '?'}", _when(j.start), _when(j.end),
                     f"{j.wall_s:.1f}", steps,
                     "-" if j.exit_status is None else str(j.exit_status), _short(j.reason)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for j in ledger.jobs:
        if j.failure is not None:
            f = j.failure
            host = f" on {f.host}" if f.host else ""
            lines.append(f"job {j.index} failed at {_when(f.time)}, rank {f.rank}{host} "
                         f"(exit {f.exit_status}): {f.error}")
    gaps = [j for j in ledger.jobs if j.gap_before is not None]
    if gaps:
        lines.append("gaps: " + ", ".join(
            f"{j.index - 1}->{j.index} {j.gap_before_s:.1f} s {GAP_NAMES[j.gap_before]}"
            for j in gaps))
    wall = ledger.wall_s or 1.0
    lines += ["", f"wall time {ledger.wall_s:.1f} s (first start -> last end):"]
    for part in (*PARTS, *GAPS):
        seconds = ledger.totals[part]
        name = GAP_NAMES.get(part, part)
        lines.append(f"  {name:<12} {seconds:10.1f} s  {100 * seconds / wall:5.1f}%")
    lines.append(f"goodput {100 * ledger.goodput:.1f}% (productive training / wall time); "
                 f"lost steps {ledger.lost_steps}")
    tp = ledger.throughput
    if tp:
        lines.append("throughput: " + ", ".join(f"{k} {v:,.4g}" for k, v in tp.items()))
    return "\n".join(lines)
