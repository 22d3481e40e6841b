"""Where the step time went, from a JAX profiler trace, without a GUI (`spmd profile`).

Why: on a login node there is no browser for TensorBoard or Perfetto, and the first questions
are always the same: which operations take the time, and how much of it is computation,
exposed communication, or the devices waiting. This module reads the Perfetto trace that
`jax.profiler.start_trace(..., create_perfetto_trace=True)` writes next to the XPlane file
(`perfetto_trace.json.gz`: Chrome trace-event JSON, read with json and gzip), and splits each
device's time.

What counts as a device op: a complete event ("ph": "X") carrying an `hlo_op` argument (the
CPU backend puts every device's ops in the host process, told apart by `device_ordinal`), or,
in a `/device:...` process (GPU), an event of its "XLA Ops" line when it has one. Per device,
over the window from the first op to the last on any device:

    compute     time when at least one non-collective op runs
    collective  time when only collectives run (communication not hidden behind compute)
    idle        the rest (host overhead, input waits, imbalance between devices)

so compute + collective + idle = window exactly. Op times are inclusive (a loop op's time
includes its body's ops) and averaged over the devices of the trace.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spmd.errors import SpmdError

TRACE_NAME = "perfetto_trace.json.gz"
COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                        r"collective-broadcast|^send|^recv|nccl|psum|ppermute", re.IGNORECASE)
OPS_LINE = "XLA Ops"


@dataclass(frozen=True)
class OpTime:
    """One HLO op's time, averaged over devices."""

    name: str
    module: str
    category: str        # "compute" or "collective"
    seconds: float       # per device, over the whole trace window
    count: float         # executions per device


@dataclass(frozen=True)
class TraceSummary:
    """The split of a trace's device time, per device on average."""

    path: str
    devices: int
    window_s: float
    compute_s: float
    collective_s: float
    idle_s: float
    ops: list[OpTime]
    steps: int | None = None       # updates in the trace, when the run's events say

    def as_dict(self, top: int | None = None) -> dict[str, Any]:
        out = asdict(self)
        out["ops"] = [asdict(op) for op in self.ops[:top]]
        return out

    def format(self, top: int = 15) -> str:
        window = self.window_s or 1.0
        lines = [f"trace {self.path}", f"  {self.devices} device(s); window {self.window_s:.4f} s"
                 + (f" over {self.steps} step(s): {self.window_s / self.steps * 1e3:.2f} ms "
                    f"per step" if self.steps else "")]
        for name, seconds in (("compute", self.compute_s), ("collectives (exposed)",
                              self.collective_s), ("idle", self.idle_s)):
            lines.append(f"  {name:<22} {seconds:10.4f} s  {100 * seconds / window:5.1f}%")
        lines.append(f"  top {min(top, len(self.ops))} ops by time (per device, inclusive):")
        lines.append(f"    {'seconds':>10} {'%':>6} {'count':>7}  {'category':<10} op (module)")
        for op in self.ops[:top]:
            lines.append(f"    {op.seconds:10.5f} {100 * op.seconds / window:5.1f}% "
                         f"{op.count:7.1f}  {op.category:<10} {op.name} ({op.module})")
        return "\n".join(lines)


def load_trace(path: Path) -> list[dict]:
    """The trace events of a Chrome/Perfetto trace JSON file (gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise SpmdError(f"{path}: not a readable trace file ({e}); was the trace cut short "
                        f"(the job killed while writing it)?") from e
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise SpmdError(f"{path}: no traceEvents list; not a Chrome/Perfetto trace")
    return events


def device_ops(events: list[dict]) -> dict[str, list[dict]]:
    """Device name -> its op events (see the module docstring for what counts)."""
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    with_ops_line = {pid for (pid, _), name in threads.items() if name == OPS_LINE}
    out: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or str(e.get("name", "")).startswith("end: "):
            continue
        pid, args = e.get("pid"), e.get("args") or {}
        process = processes.get(pid, str(pid))
        if process.startswith("/device:") and pid in with_ops_line:
            if threads.get((pid, e.get("tid"))) == OPS_LINE:
                out[process].append(e)
        elif "hlo_op" in args:
            ordinal = args.get("device_ordinal")
            out[process if ordinal is None else f"{process} device {ordinal}"].append(e)
    return dict(out)


def covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def category(name: str) -> str:
    return "collective" if COLLECTIVE.search(name) else "compute"


def summarize(path: Path, steps: int | None = None) -> TraceSummary:
    """The split of `path`'s device time (trace timestamps are microseconds)."""
    devices = device_ops(load_trace(path))
    if not devices:
        raise SpmdError(f"{path}: no device operations in the trace (no event with an hlo_op "
                        f"argument, no XLA Ops line): were any steps traced?")
    start = min(float(e["ts"]) for ops in devices.values() for e in ops)
    stop = max(float(e["ts"]) + float(e["dur"]) for ops in devices.values() for e in ops)
    n = len(devices)
    window = (stop - start) / 1e6
    compute = collective = 0.0
    per_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ops in devices.values():
        spans = {"compute": [], "collective": []}
        for e in ops:
            args = e.get("args") or {}
            name = str(args.get("hlo_op") or e.get("name"))
            a = float(e["ts"])
            spans[category(name)].append((a, a + float(e["dur"])))
            total = per_op[(name, str(args.get("hlo_module", "")))]
            total[0] += float(e["dur"]) / 1e6
            total[1] += 1
        busy_compute = covered(spans["compute"]) / 1e6
        compute += busy_compute
        collective += covered(spans["compute"] + spans["collective"]) / 1e6 - busy_compute
    compute, collective = compute / n, collective / n
    ops = sorted((OpTime(name, module, category(name), seconds / n, count / n)
                  for (name, module), (seconds, count) in per_op.items()),
                 key=lambda op: -op.seconds)
    return TraceSummary(str(path), n, window, compute, collective,
                        max(window - compute - collective, 0.0), ops, steps)


def find_traces(profile_dir: Path) -> dict[int, Path]:
    """rank -> its newest trace file under profile_dir/rank<r>/plugins/profile/<time>/."""
    out: dict[int, Path] = {}
    for rank_dir in sorted(profile_dir.glob("rank*")):
        if not rank_dir.name[4:].isdigit():
            continue
        traces = sorted(rank_dir.glob(f"plugins/profile/*/{TRACE_NAME}"),
                        key=lambda p: p.stat().st_mtime)
        if traces:
            out[int(rank_dir.name[4:])] = traces[-1]
    return out
