"""`spmd profile RUN_DIR`: where the step time went in a run's profiler trace, as text.

Reads the newest trace of a rank (run.profile.steps wrote it to RUN_DIR/profile/rank<r>/) and
prints the device time split into compute, exposed collectives and idle, and the top ops
(spmd.rundir.trace_summary). For the full timeline, open the same directory in TensorBoard's
profile plugin / XProf, or the perfetto_trace.json.gz in https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spmd.errors import SpmdError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="summarize a run's profiler trace: top ops, compute vs "
                                       "collectives vs idle")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (run.dir)")
    p.add_argument("--rank", type=int, default=None,
                   help="whose trace (default: the lowest rank that has one)")
    p.add_argument("--top", type=int, default=15, help="how many ops to list (default 15)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.rundir.metrics import read_jsonl
    from spmd.rundir.trace_summary import find_traces, summarize

    run_dir = Path(args.run_dir)
    traces = find_traces(run_dir / "profile")
    if not traces:
        raise SpmdError(f"{run_dir / 'profile'}: no profiler trace; train with "
                        f"run.profile.steps=[START,STOP] (and run.profile.ranks) to write one")
    rank = min(traces) if args.rank is None else args.rank
    if rank not in traces:
        raise SpmdError(f"no trace of rank {rank} in {run_dir / 'profile'}; ranks with one: "
                        f"{sorted(traces)} (run.profile.ranks)")
    profiled = [e for e in read_jsonl(run_dir / "events.jsonl")
                if e.get("event") == "profiled" and e.get("rank") == rank]
    steps = (profiled[-1]["last_step"] - profiled[-1]["first_step"] + 1) if profiled else None
    summary = summarize(traces[rank], steps)
    if args.json:
        print(json.dumps({"rank": rank, **summary.as_dict(args.top)}, indent=1))
    else:
        print(f"rank {rank}: " + summary.format(args.top))
    return 0
