"""`spmd report RUN_DIR [--json] [--plot]`: the goodput ledger of a run, over every job.

Reads the whole history of a run directory (events.jsonl, metrics.jsonl and the records a
resume moved to metrics.replayed.jsonl, config.yaml) and
prints one row per job (first submission, requeues, chained jobs, reruns) with how it ended
(a failed job: which rank, when, and its error, in full below the table), the gaps between
jobs (queue, or between runs), the parts the wall time splits into, and the goodput
(spmd.rundir.goodput defines every part), then the ranks named as stragglers
(spmd.rundir.stragglers_report). `--plot` also draws RUN_DIR/plots/timeline.png, the jobs'
parts in the order they happened (spmd.rundir.timeline).

Recoveries inside the allocation (run.dir/recovery.jsonl, written by the job script's
supervisor, spmd.launch.supervisor) each get a row of their own: the failed rank and node, the
cause, and the seconds spent detecting (the failure's first trace -> the try ended),
relaunching (-> the new try's processes started), bootstrapping, restoring and compiling, the
steps computed twice, and the seconds from the failure to the first resumed step. The gap
before a relaunched try is counted as `relaunch`, not as queue.
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
    recovered = recoveries(_records(run_dir / RECOVERY_RECORDS), ledger, records)
    slow = stragglers(events)
    if not ledger.jobs:
        raise SpmdError(f"{events_path}: no job has started in this run directory yet")
    plot = None
    if args.plot:
        from spmd.rundir.timeline import plot_timeline

        plot = plot_timeline(ledger, run_dir / "plots" / "timeline.png")
    if args.json:
        print(json.dumps({"run_dir": str(run_dir), **ledger.as_dict(),
                          "recoveries": recovered,
                          "stragglers": [s.as_dict() for s in slow],
                          "plot": str(plot) if plot else None}, indent=1))
        return 0
    print(format_ledger(ledger, recovered))
    if recovered:
        print(format_recoveries(recovered))
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


RECOVERY_RECORDS = "recovery.jsonl"   # spmd.launch.recovery.RECORDS_NAME
REASON_WIDTH = 72   # the table's "why it ended"; a failure's whole cause is printed below it
GAP_NAMES = {"queue": "queue", "between_runs": "between runs"}


def _short(text: str, width: int = REASON_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def recoveries(decisions: list[dict], ledger, metrics: list[dict]) -> list[dict]:
    """One row per recovery decision of the supervisor, timed against the ledger's jobs: the
    try that failed is the last job started before the failure was seen (before the try
    ended, when no failure time is known), the relaunched try the job after it in the
    ledger. Not by comparing start times with the try's end: a job's start is its process'
    creation time, which the kernel gives to about a second (boot time in whole seconds),
    so a relaunched try can seem to start a moment before the old one ended."""
    out = []
    for d in (r for r in decisions if r.get("event") == "recovery"):
        ended = float(d.get("ended_at", d["time"]))
        failed_at = d.get("failed_at")
        began = float(failed_at) if failed_at is not None else ended
        before = [j for j in ledger.jobs if j.start <= began]
        failed = before[-1] if before else None
        following = ledger.jobs[failed.index + 1:] if failed is not None else ledger.jobs
        after = following[0] if following else None
        if d.get("action") not in ("relaunch", "shrink"):
            after = None
        row = {"attempt": d.get("attempt"), "kind": d.get("kind"), "action": d.get("action"),
               "cause": d.get("cause"), "failed_rank": d.get("failed_rank"),
               "failed_hosts": d.get("failed_hosts") or [], "status": d.get("status"),
               "nodes_before": d.get("nodes_before"), "nodes_after": d.get("nodes") or None,
               "failed_job": failed.index if failed else None,
               "relaunched_job": after.index if after else None,
               "detect_s": max(ended - began, 0.0),
               "steps_computed_twice": failed.lost_steps if failed else None}
        if after is not None:
            first = next((float(r["time"]) for r in metrics if "loss" in r
                          and float(r.get("time", 0)) >= after.start), None)
            row.update(relaunch_s=max(after.start - ended, 0.0),   # creation time: ~1 s
                       bootstrap_s=after.parts.get("bootstrap"),
                       restore_s=after.parts.get("restore"), compile_s=after.parts.get("compile"),
                       restored_step=after.restored_step,
                       to_first_step_s=None if first is None else first - began)
        out.append(row)
    return out


def format_recoveries(rows: list[dict]) -> str:
    def s(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    table = [("try", "failed", "cause", "action", "detect s", "relaunch s", "bootstrap s",
              "restore s", "compile s", "steps twice", "to 1st step s")]
    for r in rows:
        who = ("rank " + str(r["failed_rank"]) if r["failed_rank"] is not None else "?") + (
            f" on {','.join(r['failed_hosts'])}" if r["failed_hosts"] else "")
        action = r["action"] + (f" ({r['nodes_before']}->{r['nodes_after']} nodes)"
                                if r["action"] == "shrink" else "")
        table.append((str(r["attempt"]), who, str(r["kind"]), action, s(r["detect_s"]),
                      s(r.get("relaunch_s")), s(r.get("bootstrap_s")), s(r.get("restore_s")),
                      s(r.get("compile_s")), "-" if r["steps_computed_twice"] is None
                      else str(r["steps_computed_twice"]), s(r.get("to_first_step_s"))))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["", f"recoveries inside the job ({RECOVERY_RECORDS}):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
              for row in table]
    lines += [f"  try {r['attempt']}: {r['cause']}" for r in rows]
    return "\n".join(lines)


def format_ledger(ledger, recovered: list[dict] | None = None) -> str:
    from spmd.rundir.goodput import GAPS, PARTS

    relaunched = {r["relaunched_job"] for r in recovered or [] if r.get("relaunched_job")}

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
            f"{j.index - 1}->{j.index} {j.gap_before_s:.1f} s "
            f"{'relaunch' if j.index in relaunched else GAP_NAMES[j.gap_before]}"
            for j in gaps))
    wall = ledger.wall_s or 1.0
    totals = dict(ledger.totals)
    moved = 0.0
    for j in ledger.jobs:   # a relaunch inside the job is no wait in the queue
        if j.index in relaunched and j.gap_before is not None:
            totals[j.gap_before] -= j.gap_before_s
            moved += j.gap_before_s
    totals["relaunch"] = moved
    lines += ["", f"wall time {ledger.wall_s:.1f} s (first start -> last end):"]
    for part in (*PARTS, *GAPS, *(("relaunch",) if moved else ())):
        seconds = totals[part]
        name = GAP_NAMES.get(part, part)
        lines.append(f"  {name:<12} {seconds:10.1f} s  {100 * seconds / wall:5.1f}%")
    lines.append(f"goodput {100 * ledger.goodput:.1f}% (productive training / wall time); "
                 f"lost steps {ledger.lost_steps}")
    tp = ledger.throughput
    if tp:
        lines.append("throughput: " + ", ".join(f"{k} {v:,.4g}" for k, v in tp.items()))
    return "\n".join(lines)
