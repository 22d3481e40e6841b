"""The goodput ledger of a run directory: every second of every job, accounted for.

Why: a run that lives through requeues, chained jobs and crashes spends its allocation on more
than training. `spmd report` splits the wall time, from the first job's start to the last
job's end, into parts that add up exactly, and states the goodput (productive training time
over that wall time). Pure functions over the records of events.jsonl and metrics.jsonl.

A job is what one rank-0 `started` event opens (one `spmd train` on every rank: a first
submission, a requeue, a chained job, a rerun by hand). Its start is rank 0's process start
(`process_start`; `run_start` for a process that lived long before it; older runs: the
`started` event), its end its last record: the
finished / preempted / stopped / failed event, or, for a job killed with kill -9, whatever it
wrote last ("lost"). Within a job:

    bootstrap   start -> the restore begins (imports, jax.distributed, lease, task, runtime)
    restore     the restore or the initialization of the state
    compile     the train step's compilation (the `compiled` event)
    training    productive training: update time of steps that were kept
    evaluation  every evaluation (`evaluated` events' `seconds`)
    checkpoint  time the loop was blocked by saves (`saved`: blocking_s + waited_s, per step)
                and the wait for the last saves when the job closed (`closed`)
    lost        update time of steps computed after the last checkpoint the run kept and
                redone by a later job (or never committed at all)
    other       whatever the records do not explain (the remainder: the parts sum exactly)

and between jobs, `queue`: from one job's end to the next one's start. A step is kept when a
later job resumes from it or later (its `restored` step), or, for the last job, when it
finished or committed it (`saved`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

# A process that started longer than this before its Trainer.run is a long-lived interpreter
# (spmd.train from a notebook or a test session): its job starts at `run_start` instead.
PROCESS_START_LIMIT_S = 900.0
PARTS = ("bootstrap", "restore", "compile", "training", "evaluation", "checkpoint", "lost",
         "other")
ENDS = {"finished": 0, "stopped": 0, "preempted": 75, "failed": None}


@dataclass
class Job:
    """One job of the run: who, when, how it ended, and its parts (seconds)."""

    index: int
    job_id: str | None
    restart_count: int
    nodes: int | None
    ranks: int | None
    start: float
    end: float
    exit_status: int | None
    reason: str
    restored_step: int | None          # the step this job started from (0: initialized)
    last_step: int | None              # the last train step it logged
    lost_steps: int = 0
    parts: dict[str, float] = field(default_factory=dict)
    queue_before_s: float = 0.0        # gap after the previous job's end

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def productive_steps(self) -> int:
        if self.last_step is None or self.restored_step is None:
            return 0
        return max(self.last_step - self.restored_step - self.lost_steps, 0)


@dataclass
class Ledger:
    """Every job, and the totals of the whole run directory."""

    jobs: list[Job]
    totals: dict[str, float]           # PARTS and "queue", summed over jobs
    wall_s: float                      # last end - first start
    goodput: float                     # productive training / wall
    lost_steps: int
    throughput: dict[str, float]       # samples/s etc. over productive time, MFU where logged

    def as_dict(self) -> dict[str, Any]:
        jobs = []
        for job in self.jobs:
            d = asdict(job)
            d["wall_s"] = job.wall_s
            d["productive_steps"] = job.productive_steps
            jobs.append(d)
        return {"jobs": jobs, "totals": self.totals, "wall_s": self.wall_s,
                "goodput": self.goodput, "lost_steps": self.lost_steps,
                "throughput": self.throughput}


def _split_jobs(events: list[dict]) -> list[list[dict]]:
    """Events grouped by job: each rank-0 `started` opens one; rank-0 records only."""
    jobs: list[list[dict]] = []
    for e in events:
        if e.get("rank", 0) != 0 or "time" not in e:
            continue
        if e.get("event") == "started":
            jobs.append([])
        if jobs:
            jobs[-1].append(e)
    return jobs


def job_start(started: dict) -> float:
    """A job's start: rank 0's process start, its run start, or (older runs) `started`."""
    run_start = float(started.get("run_start") or started["time"])
    process_start = started.get("process_start")
    if process_start is not None and run_start - float(process_start) <= PROCESS_START_LIMIT_S:
        return float(process_start)
    return run_start


def _first(records: list[dict], *names: str) -> dict | None:
    return next((e for e in records if e.get("event") in names), None)


def _train_records(metrics: list[dict], start: float, stop: float) -> list[dict]:
    """metrics.jsonl train records (they carry `time`) written in [start, stop)."""
    return [r for r in metrics if "loss" in r and isinstance(r.get("time"), int | float)
            and start <= r["time"] < stop]


def _ending(records: list[dict]) -> tuple[int | None, str]:
    end = next((e for e in reversed(records) if e.get("event") in ENDS), None)
    if end is None:
        return None, "lost (no end record: killed, or the node died)"
    name = end["event"]
    if name == "failed":
        return 1, f"failed: {end.get('error', '?')}"
    detail = end.get("reason")
    return int(end.get("exit_code", ENDS[name])), name + (f" ({detail})" if detail else "")


def _checkpoint_blocking(records: list[dict], before_step: int | None) -> tuple[float, float]:
    """(blocking of saves at steps < before_step: inside the loop, of the later ones)."""
    per_step: dict[int, float] = {}
    for e in records:
        if e.get("event") == "saved" and "blocking_s" in e:
            per_step[int(e["step"])] = float(e["blocking_s"]) + float(e.get("waited_s", 0.0))
    inside = sum(v for s, v in per_step.items() if before_step is not None and s < before_step)
    return inside, sum(per_step.values()) - inside


def _job(index: int, records: list[dict], metrics: list[dict], stop: float) -> Job:
    started = records[0]
    start = job_start(started)
    train = _train_records(metrics, start, stop)
    end = max([float(e["time"]) for e in records] + [float(r["time"]) for r in train])
    status, reason = _ending(records)
    first = _first(records, "restored", "initialized")
    return Job(index=index, job_id=started.get("job_id"),
               restart_count=int(started.get("restart_count") or 0),
               nodes=started.get("nodes"), ranks=started.get("size"), start=start, end=end,
               exit_status=status, reason=reason,
               restored_step=int(first["step"]) if first is not None else None,
               last_step=int(train[-1]["step"]) if train else None)


def _parts(job: Job, records: list[dict], train: list[dict], keep_step: int | None) -> None:
    """Fill job.parts and job.lost_steps; `keep_step`: steps above it were lost."""
    parts = dict.fromkeys(PARTS, 0.0)
    first = _first(records, "restored", "initialized")
    if first is not None:
        seconds = float(first.get("seconds", 0.0))
        parts["restore"] = seconds
        parts["bootstrap"] = max(float(first["time"]) - seconds - job.start, 0.0)
    else:
        parts["bootstrap"] = max(float(records[0]["time"]) - job.start, 0.0)
    compiled = _first(records, "compiled")
    if compiled is not None:
        parts["compile"] = float(compiled.get("seconds", 0.0))
    evals = [e for e in records if e.get("event") == "evaluated"]
    parts["evaluation"] = sum(float(e.get("seconds", 0.0)) for e in evals)
    inside, after = _checkpoint_blocking(records, job.last_step)
    closed = _first(records, "closed")
    closing = float((closed or {}).get("seconds", {}).get("checkpoint", 0.0))
    parts["checkpoint"] = inside + after + closing
    if compiled is not None and train:
        loop_start, loop_end = float(compiled["time"]), float(train[-1]["time"])
        eval_inside = sum(float(e.get("seconds", 0.0)) for e in evals
                          if loop_start < float(e["time"]) <= loop_end)
        training = max(loop_end - loop_start - eval_inside - inside, 0.0)
        lost_s, lost_steps = _lost(train, job.restored_step or 0, keep_step)
        parts["lost"] = min(lost_s, training)
        parts["training"] = training - parts["lost"]
        job.lost_steps = lost_steps
    parts["other"] = job.wall_s - sum(parts.values())
    job.parts = parts


def _lost(train: list[dict], restored: int, keep_step: int | None) -> tuple[float, int]:
    """(seconds, steps) of the logged steps above `keep_step`."""
    if keep_step is None or not train or train[-1]["step"] <= keep_step:
        return 0.0, 0
    seconds, previous = 0.0, restored
    for r in train:
        step = int(r["step"])
        if step > keep_step:
            seconds += float(r.get("step_time_s", 0.0)) * (step - max(previous, keep_step))
        previous = step
    return seconds, int(train[-1]["step"]) - max(keep_step, restored)


def build_ledger(events: list[dict], metrics: list[dict], batch_size: int | None = None
                 ) -> Ledger:
    """The ledger of a run directory's events.jsonl and metrics.jsonl records."""
    groups = _split_jobs(events)
    if not groups:
        return Ledger([], {**dict.fromkeys(PARTS, 0.0), "queue": 0.0}, 0.0, 0.0, 0, {})
    stops = [job_start(g[0]) for g in groups[1:]]
    stops.append(float("inf"))
    jobs = [_job(i, g, metrics, stop) for i, (g, stop) in enumerate(zip(groups, stops))]
    committed = max((int(e["step"]) for e in events if e.get("event") == "saved"), default=0)
    for i, (job, records) in enumerate(zip(jobs, groups)):
        if i + 1 < len(jobs) and jobs[i + 1].restored_step is not None:
            keep = jobs[i + 1].restored_step     # what the next job resumed from
        elif job.exit_status is None or job.reason.startswith("failed"):
            keep = committed                     # the last job died: its last commit stays
        else:
            keep = None                          # ended cleanly, and nothing redid its steps
        _parts(job, records, _train_records(metrics, job.start, stops[i]), keep)
        if i:
            job.queue_before_s = job.start - jobs[i - 1].end
    totals = {p: sum(j.parts.get(p, 0.0) for j in jobs) for p in PARTS}
    totals["queue"] = sum(j.queue_before_s for j in jobs)
    wall = jobs[-1].end - jobs[0].start
    goodput = totals["training"] / wall if wall > 0 else 0.0
    return Ledger(jobs, totals, wall, goodput, sum(j.lost_steps for j in jobs),
                  _throughput(jobs, metrics, totals["training"], batch_size, goodput))


def _throughput(jobs: list[Job], metrics: list[dict], productive_s: float,
                batch_size: int | None, goodput: float) -> dict[str, float]:
    """Samples/s over productive time; tokens/s, model FLOP/s and MFU: medians as logged, and
    the MFU the whole allocation achieved (median MFU x goodput)."""
    out: dict[str, float] = {}
    steps = sum(j.productive_steps for j in jobs)
    if batch_size and productive_s > 0 and steps:
        out["samples_per_s"] = batch_size * steps / productive_s
    train = [r for r in metrics if "loss" in r]
    for key in ("tokens_per_s", "model_flops_per_s", "mfu"):
        values = [float(r[key]) for r in train if isinstance(r.get(key), int | float)]
        if values:
            out[f"median_{key}"] = median(values)
    if "median_mfu" in out:
        out["allocation_mfu"] = out["median_mfu"] * goodput
    waited = [r for r in train if isinstance(r.get("input_wait_s"), int | float)]
    if waited:   # logged steps only (every run.log_every): the time the loop waited for data
        out["input_wait_s"] = sum(float(r["input_wait_s"]) for r in waited)
        stepped = sum(float(r.get("step_time_s", 0.0)) for r in waited)
        if stepped > 0:
            out["input_wait_fraction"] = out["input_wait_s"] / stepped
    return out
