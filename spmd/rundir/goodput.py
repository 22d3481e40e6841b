"""The goodput ledger of a run directory: every second of every job, accounted for.

Why: a run that lives through requeues, chained jobs and crashes spends its allocation on more
than training. `spmd report` splits the wall time, from the first job's start to the last
job's end, into parts that add up exactly, and states the goodput (productive training time
over that wall time). Pure functions over the records of events.jsonl and metrics.jsonl.

A job is what one rank-0 `started` event opens (one `spmd train` on every rank: a first
submission, a requeue, a chained job, a rerun by hand). Its start is rank 0's process start
(`process_start`; `run_start` for a process that lived long before it; older runs: the
`started` event); the records of the other ranks belong to the job whose start precedes
them. It ends with rank 0's finished / preempted / stopped record, or with the `failed`
record of the rank that failed (rank 0 is ended by another rank's failure without a record of
its own), or, for a job killed with kill -9, with whatever any rank wrote last ("lost"). Its
end is the last record any rank wrote in it. Within a job:

    bootstrap   start -> the restore begins (imports, jax.distributed, lease, data
                preparation, task, runtime); a job that never got that far: all of it
    restore     restoring a checkpoint (the `restored` event)
    init        initializing the state of a fresh start (the `initialized` event)
    compile     the train step's compilation (the `compiled` event)
    training    productive training: update time of steps that were kept
    evaluation  every evaluation (`evaluated` events' `seconds`)
    checkpoint  time the loop was blocked by saves (`saved`: blocking_s + waited_s, per step)
                and the wait for the last saves when the job closed (`closed`)
    lost        update time of steps computed after the last checkpoint the run kept and
                redone by a later job (or never committed at all)
    other       whatever the records do not explain (the remainder: the parts sum exactly)

and between two jobs, from one's end to the next one's start, a gap that is

    queue         when the scheduler says they are one job: the same job id (a requeue), or
                  the same chain (`started`'s `chain`: the first job id of a chain that
                  `spmd jobscript --chain` submitted, or of a job script that resubmitted
                  itself)
    between_runs  otherwise: runs started by hand, or jobs the scheduler does not relate

A step is kept when a later job resumes from it or later (its `restored` step), or, for the
last job, when it finished or committed it (`saved`). Each job also gets its `segments`: the
parts placed at the times the records say they happened, for the timeline (spmd.rundir.
timeline).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

# A process that started longer than this before its Trainer.run is a long-lived interpreter
# (spmd.train from a notebook or a test session): its job starts at `run_start` instead.
PROCESS_START_LIMIT_S = 900.0
PARTS = ("bootstrap", "restore", "init", "compile", "training", "evaluation", "checkpoint",
         "lost", "other")
GAPS = ("queue", "between_runs")
ENDS = {"finished": 0, "stopped": 0, "preempted": 75}
LOST = "lost (no end record: killed, or the node died)"


@dataclass
class Failure:
    """The `failed` record that ended a job: which rank, where, when, and its error."""

    rank: int
    host: str | None
    time: float
    error: str
    exit_status: int


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
    chain: str | None = None           # the scheduler chain it belongs to (first job's id)
    began: str | None = None           # "restore", "init", or None: never got that far
    failure: Failure | None = None     # the failed rank's record, for a job that failed
    lost_steps: int = 0
    parts: dict[str, float] = field(default_factory=dict)
    gap_before_s: float = 0.0          # from the previous job's end to this one's start
    gap_before: str | None = None      # "queue" or "between_runs" (None: the first job)
    # (start, end, part): the parts where they happened, in time order; for the timeline
    segments: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def productive_steps(self) -> int:
        if self.last_step is None or self.restored_step is None:
            return 0
        return max(self.last_step - self.restored_step - self.lost_steps, 0)


@dataclass
class Ledger:
    """Every job, and the totals of the whole run directory."""

    jobs: list[Job]
    totals: dict[str, float]           # PARTS and GAPS, summed over jobs: they sum to wall_s
    wall_s: float                      # last end - first start
    goodput: float                     # productive training / wall
    lost_steps: int
    throughput: dict[str, float]       # samples/s etc. over productive time, MFU where logged

    def as_dict(self) -> dict[str, Any]:
        jobs = []
        for job in self.jobs:
            d = asdict(job)
            del d["segments"]            # the timeline's: many, and derived from the records
            d["wall_s"] = job.wall_s
            d["productive_steps"] = job.productive_steps
            jobs.append(d)
        return {"jobs": jobs, "totals": self.totals, "wall_s": self.wall_s,
                "goodput": self.goodput, "lost_steps": self.lost_steps,
                "throughput": self.throughput}


def _split_jobs(events: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """(rank-0 records, other ranks' records) per job: each rank-0 `started` opens one; another
    rank's record belongs to the last job that started before it (the first, if none did)."""
    jobs: list[tuple[list[dict], list[dict]]] = []
    others: list[dict] = []
    for e in events:
        if "time" not in e:
            continue
        if e.get("rank", 0) != 0:
            others.append(e)
            continue
        if e.get("event") == "started":
            jobs.append(([], []))
        if jobs:
            jobs[-1][0].append(e)
    if jobs:
        starts = [job_start(records[0]) for records, _ in jobs]
        for e in others:
            jobs[max(bisect_right(starts, float(e["time"])) - 1, 0)][1].append(e)
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


def _failure(records: list[dict], others: list[dict]) -> Failure | None:
    """The failure that ended the job: the rank whose failure was announced to the others
    (`first`), else the earliest `failed` record of any rank."""
    failed = sorted((e for e in records + others if e.get("event") == "failed"),
                    key=lambda e: (not e.get("first", False), float(e["time"])))
    if not failed:
        return None
    e = failed[0]
    return Failure(rank=int(e.get("rank", 0)), host=e.get("host"), time=float(e["time"]),
                   error=str(e.get("error", "?")), exit_status=int(e.get("exit_code", 1)))


def _ending(records: list[dict], failure: Failure | None) -> tuple[int | None, str]:
    end = next((e for e in reversed(records) if e.get("event") in ENDS), None)
    if end is not None:
        name, detail = end["event"], end.get("reason")
        return int(end.get("exit_code", ENDS[name])), name + (f" ({detail})" if detail else "")
    if failure is not None:
        where = f"rank {failure.rank}" + (f" on {failure.host}" if failure.host else "")
        return failure.exit_status, f"failed ({where}): {failure.error}"
    return None, LOST


def _checkpoint_saves(records: list[dict]) -> dict[int, tuple[float, float]]:
    """{step: (time of its last `saved` record, blocking + waiting seconds)}."""
    per_step: dict[int, tuple[float, float]] = {}
    for e in records:
        if e.get("event") == "saved" and "blocking_s" in e:
            per_step[int(e["step"])] = (float(e["time"]),
                                        float(e["blocking_s"]) + float(e.get("waited_s", 0.0)))
    return per_step


def _checkpoint_blocking(records: list[dict], before_step: int | None) -> tuple[float, float]:
    """(blocking of saves at steps < before_step: inside the loop, of the later ones)."""
    per_step = {s: v for s, (_, v) in _checkpoint_saves(records).items()}
    inside = sum(v for s, v in per_step.items() if before_step is not None and s < before_step)
    return inside, sum(per_step.values()) - inside


def _job(index: int, records: list[dict], others: list[dict], metrics: list[dict],
         stop: float) -> Job:
    started = records[0]
    start = job_start(started)
    train = _train_records(metrics, start, stop)
    end = max([float(e["time"]) for e in records + others]
              + [float(r["time"]) for r in train])
    failure = _failure(records, others)
    status, reason = _ending(records, failure)
    first = _first(records, "restored", "initialized")
    began = None if first is None else "restore" if first["event"] == "restored" else "init"
    return Job(index=index, job_id=started.get("job_id"),
               restart_count=int(started.get("restart_count") or 0),
               nodes=started.get("nodes"), ranks=started.get("size"), start=start, end=end,
               exit_status=status, reason=reason,
               restored_step=int(first["step"]) if first is not None else None,
               last_step=int(train[-1]["step"]) if train else None,
               chain=started.get("chain"), began=began,
               failure=failure if reason.startswith("failed") else None)


def _parts(job: Job, records: list[dict], train: list[dict], keep_step: int | None) -> None:
    """Fill job.parts, job.lost_steps and job.segments; `keep_step`: steps above it were
    lost."""
    parts = dict.fromkeys(PARTS, 0.0)
    first = _first(records, "restored", "initialized")
    if first is not None:
        seconds = float(first.get("seconds", 0.0))
        parts[job.began or "restore"] = seconds
        parts["bootstrap"] = max(float(first["time"]) - seconds - job.start, 0.0)
    compiled = _first(records, "compiled")
    if compiled is not None:
        parts["compile"] = float(compiled.get("seconds", 0.0))
    evals = [e for e in records if e.get("event") == "evaluated"]
    parts["evaluation"] = sum(float(e.get("seconds", 0.0)) for e in evals)
    inside, after = _checkpoint_blocking(records, job.last_step)
    closed = _first(records, "closed")
    closing = float((closed or {}).get("seconds", {}).get("checkpoint", 0.0))
    parts["checkpoint"] = inside + after + closing
    loop: tuple[float, float, float] | None = None   # (start, lost from, end) of the loop
    if compiled is not None and train:
        loop_start, loop_end = float(compiled["time"]), float(train[-1]["time"])
        eval_inside = sum(float(e.get("seconds", 0.0)) for e in evals
                          if loop_start < float(e["time"]) <= loop_end)
        training = max(loop_end - loop_start - eval_inside - inside, 0.0)
        lost_s, lost_steps = _lost(train, job.restored_step or 0, keep_step)
        parts["lost"] = min(lost_s, training)
        parts["training"] = training - parts["lost"]
        job.lost_steps = lost_steps
        loop = (loop_start, max(loop_end - parts["lost"], loop_start), loop_end)
    if first is None:   # it never got to the restore: it was bootstrapping all along
        parts["bootstrap"] = max(job.wall_s - sum(parts.values()), 0.0)
    parts["other"] = job.wall_s - sum(parts.values())
    job.parts = parts
    job.segments = _segments(job, records, first, compiled, evals, closed, loop)


def _segments(job: Job, records: list[dict], first: dict | None, compiled: dict | None,
              evals: list[dict], closed: dict | None,
              loop: tuple[float, float, float] | None) -> list[tuple[float, float, str]]:
    """The job's parts where its records place them, in time order, covering [start, end]:
    each timed record ends at its time and lasts its `seconds`; what lies between them is
    training (or lost, the loop's last `lost` seconds) inside the train loop, else other."""
    marks: list[tuple[float, float, str]] = []
    if first is not None:
        began = float(first["time"]) - float(first.get("seconds", 0.0))
        marks += [(job.start, began, "bootstrap"), (began, float(first["time"]),
                                                     job.began or "restore")]
    else:
        marks.append((job.start, job.end, "bootstrap"))
    timed = [(e, float(e.get("seconds", 0.0)), "evaluation") for e in evals]
    if compiled is not None:
        timed.append((compiled, float(compiled.get("seconds", 0.0)), "compile"))
    if closed is not None:
        timed.append((closed, float((closed.get("seconds") or {}).get("checkpoint", 0.0)),
                      "checkpoint"))
    marks += [(float(e["time"]) - s, float(e["time"]), part) for e, s, part in timed]
    marks += [(t - s, t, "checkpoint") for t, s in _checkpoint_saves(records).values()]

    out: list[tuple[float, float, str]] = []

    def add(a: float, b: float, part: str) -> None:
        if b <= a:
            return
        if out and out[-1][2] == part and abs(out[-1][1] - a) < 1e-9:
            out[-1] = (out[-1][0], b, part)
        else:
            out.append((a, b, part))

    def fill(a: float, b: float) -> None:   # time no record claims
        edges = [a, b]
        if loop is not None:
            edges += [t for t in loop if a < t < b]
        for x, y in zip(sorted(edges), sorted(edges)[1:]):
            mid = (x + y) / 2
            part = "other"
            if loop is not None and loop[0] <= mid < loop[2]:
                part = "training" if mid < loop[1] else "lost"
            add(x, y, part)

    cursor = job.start
    for a, b, part in sorted(marks, key=lambda m: (m[0], m[1])):
        a, b = max(a, cursor), min(b, job.end)
        if b <= a:
            continue
        fill(cursor, a)
        add(a, b, part)
        cursor = b
    fill(cursor, job.end)
    return out


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


def gap_kind(before: Job, after: Job) -> str:
    """"queue" when the scheduler relates the two jobs (one job id: a requeue; one chain),
    "between_runs" otherwise (no job ids: runs started by hand; unrelated job ids)."""
    if after.job_id is not None and after.job_id == before.job_id:
        return "queue"
    chain = after.chain
    if chain is not None and chain in (before.chain, before.job_id):
        return "queue"
    return "between_runs"


def build_ledger(events: list[dict], metrics: list[dict], batch_size: int | None = None
                 ) -> Ledger:
    """The ledger of a run directory's events.jsonl and metrics.jsonl records."""
    groups = _split_jobs(events)
    if not groups:
        return Ledger([], dict.fromkeys((*PARTS, *GAPS), 0.0), 0.0, 0.0, 0, {})
    stops = [job_start(g[0][0]) for g in groups[1:]]
    stops.append(float("inf"))
    jobs = [_job(i, records, others, metrics, stop)
            for i, ((records, others), stop) in enumerate(zip(groups, stops))]
    committed = max((int(e["step"]) for e in events if e.get("event") == "saved"), default=0)
    for i, (job, (records, _)) in enumerate(zip(jobs, groups)):
        if i + 1 < len(jobs) and jobs[i + 1].restored_step is not None:
            keep = jobs[i + 1].restored_step     # what the next job resumed from
        elif job.exit_status is None or job.failed:
            keep = committed                     # the last job died: its last commit stays
        else:
            keep = None                          # ended cleanly, and nothing redid its steps
        _parts(job, records, _train_records(metrics, job.start, stops[i]), keep)
        if i:
            job.gap_before_s = job.start - jobs[i - 1].end
            job.gap_before = gap_kind(jobs[i - 1], job)
    totals = {p: sum(j.parts.get(p, 0.0) for j in jobs) for p in PARTS}
    for gap in GAPS:
        totals[gap] = sum(j.gap_before_s for j in jobs if j.gap_before == gap)
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
