"""`spmd report` says what happened, over hand-made events.jsonl records: a job that failed on
another rank than rank 0 shows as failed, with its rank, cause and end time; a gap between
jobs is queue only when the scheduler relates them (one job id, one chain) and "between runs"
otherwise; a fresh start's initialisation is `init`, not `restore`; the timeline is drawn in
time order. And the chain a job belongs to reaches it: `spmd jobscript --chain` submits with
SPMD_CHAIN (a stand-in sbatch on PATH records what it got). A real failed run, and a chained
job whose `started` record carries its chain: tests/multiprocess/test_report_failed_run.py."""

from __future__ import annotations

import json

import pytest

from spmd.rundir.goodput import GAPS, PARTS, build_ledger, gap_kind

# the error of the first run: rank 1 gave up waiting while rank 0 made the data set
GLOO = ("JaxRuntimeError: UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED: "
        "GetKeyValue() timed out with key: cpu:gloo/0,2048/0 and duration: 29.999999934s")


def ev(event: str, t: float, rank: int = 0, **fields) -> dict:
    return {"event": event, "time": t, "rank": rank, "host": "vm", **fields}


def steps(first: int, last: int, t0: float, dt: float) -> list[dict]:
    return [{"step": s, "time": t0 + (s - first + 1) * dt, "loss": 1.0, "step_time_s": dt}
            for s in range(first, last + 1)]


def failed_then_rerun() -> tuple[list[dict], list[dict]]:
    """`spmd run -n 2` twice by hand: the first dies in 46 s when rank 1 gives up waiting
    for rank 0's data (rank 0 is ended without a record of its own); the second trains."""
    events = [
        ev("started", 102, size=2, nodes=1, job_id=None, process_start=100),
        ev("started", 102.2, rank=1, size=2, process_start=100.1),
        ev("failed", 146, rank=1, error=GLOO, exit_code=1, first=True),
        ev("started", 1002, size=2, nodes=1, job_id=None, process_start=1000),
        ev("started", 1002.1, rank=1, size=2, process_start=1000),
        ev("initialized", 1040, step=0, seconds=2.0),
        ev("compiled", 1050, seconds=9.0),
        ev("saved", 1060.5, tier="local", step=20, blocking_s=0.2, waited_s=0.0),
        ev("closed", 1061, seconds={"checkpoint": 0.3}),
        ev("closed", 1061.01, rank=1, seconds={"checkpoint": 0.3}),
        ev("finished", 1061.1, step=20),
    ]
    return events, steps(1, 20, 1050, 0.5)


def test_a_job_that_failed_on_rank_1_shows_as_failed_with_its_rank_cause_and_end():
    ledger = build_ledger(*failed_then_rerun(), batch_size=8)
    first, second = ledger.jobs
    assert first.failure is not None and second.failure is None
    assert (first.failure.rank, first.failure.host, first.failure.error) == (1, "vm", GLOO)
    assert first.reason == f"failed (rank 1 on vm): {GLOO}" and first.exit_status == 1
    assert (first.start, first.end) == (100, 146)   # the failure's time, not rank 0's last
    assert first.began is None and first.restored_step is None
    # it never got to initialise: all its time was bootstrap (rank 0 making the data)
    assert first.parts["bootstrap"] == 46 and first.parts["other"] == 0
    assert sum(ledger.totals.values()) == pytest.approx(ledger.wall_s, rel=1e-12)
    assert (second.reason, second.exit_status, second.began) == ("finished", 0, "init")
    assert second.parts["init"] == 2.0 and second.parts["restore"] == 0.0


def test_two_runs_started_by_hand_are_between_runs_not_queue():
    ledger = build_ledger(*failed_then_rerun())
    second = ledger.jobs[1]
    assert (second.gap_before, second.gap_before_s) == ("between_runs", 1000 - 146)
    assert ledger.totals["queue"] == 0 and ledger.totals["between_runs"] == 854
    assert set(ledger.totals) == {*PARTS, *GAPS}


def test_the_report_shows_the_failure_in_full_and_the_gap_between_runs(tmp_path, capsys):
    from spmd.cli.main import main

    events, metrics = failed_then_rerun()
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("0 ")]
    assert "failed (rank 1 on vm): JaxRuntimeError" in row and "lost" not in row
    assert row.split()[10:13] == ["46.0", "-", "1"]                # wall s, steps, exit
    assert len(row.split("  ")[-1].strip()) <= 72                          # cut in the table ...
    assert f"job 0 failed at {_when(146)}, rank 1 on vm (exit 1): {GLOO}" in out  # not here
    assert "0->1 854.0 s between runs" in out
    assert "  queue " in out and "  between runs " in out
    assert main(["report", str(tmp_path), "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)["jobs"]
    assert jobs[0]["failure"] == {"rank": 1, "host": "vm", "time": 146, "error": GLOO,
                                  "exit_status": 1}
    assert jobs[1]["gap_before"] == "between_runs" and "segments" not in jobs[1]


def _when(t: float) -> str:
    from spmd.cli.report_cmd import _when

    return _when(t)


def test_the_announced_failure_is_the_cause_and_a_clean_end_wins_over_a_late_one():
    events = [ev("started", 10, size=2, process_start=9),
              ev("failed", 20, rank=0, error="RuntimeError: collective aborted", first=False),
              ev("failed", 20.5, rank=1, error="ValueError: bad batch", exit_code=1,
                 first=True)]
    (job,) = build_ledger(events, []).jobs
    assert job.failure.rank == 1 and job.reason.endswith("ValueError: bad batch")
    assert job.end == 20.5
    # records of older runs carry no `first`: the earliest failure is the cause
    older = [{k: v for k, v in e.items() if k != "first"} for e in events]
    assert build_ledger(older, []).jobs[0].failure.rank == 0
    # rank 0 finished; a failure another rank recorded afterwards does not make it failed
    done = [*events[:1], ev("finished", 30, step=5), ev("failed", 31, rank=1, error="x")]
    (job,) = build_ledger(done, []).jobs
    assert (job.reason, job.exit_status, job.failure) == ("finished", 0, None)


@pytest.mark.parametrize("before, after, kind", [
    ({"job_id": "7"}, {"job_id": "7", "restart_count": 1}, "queue"),        # a requeue
    ({"job_id": "41"}, {"job_id": "42", "chain": "41"}, "queue"),           # chained after it
    ({"job_id": "42", "chain": "41"}, {"job_id": "44", "chain": "41"}, "queue"),  # 43 left none
    ({"job_id": "f1"}, {"job_id": "f2", "chain": "f1"}, "queue"),           # resubmitted itself
    ({"job_id": "41"}, {"job_id": "42"}, "between_runs"),                   # unrelated jobs
    ({"job_id": "40"}, {"job_id": "42", "chain": "41"}, "between_runs"),    # another chain
    ({}, {}, "between_runs"),                                               # spmd run by hand
    ({"job_id": "41"}, {}, "between_runs"),
])
def test_a_gap_is_queue_only_when_the_job_ids_relate_the_jobs(before, after, kind):
    events = [ev("started", 10, **before), ev("finished", 20),
              ev("started", 30, **after), ev("finished", 40)]
    ledger = build_ledger(events, [])
    assert gap_kind(*ledger.jobs) == kind == ledger.jobs[1].gap_before
    assert ledger.totals[kind] == 10 and sum(ledger.totals[g] for g in GAPS) == 10


def test_the_segments_are_in_time_order_and_cover_each_job():
    from tests.unit.rundir.test_goodput import three_jobs

    ledger = build_ledger(*three_jobs())
    for job in ledger.jobs:
        seg = job.segments
        assert seg[0][0] == job.start and seg[-1][1] == job.end
        assert all(a < b for a, b, _ in seg)
        assert all(prev[1] == nxt[0] for prev, nxt in zip(seg, seg[1:]))   # no gap, no overlap
        assert all(prev[2] != nxt[2] for prev, nxt in zip(seg, seg[1:]))   # merged
    a, b, _ = ledger.jobs
    order = [part for _, _, part in a.segments]
    # what job 0 did, in the order it did it: the step-0 evaluation before the compile, the
    # step-10 evaluation and saves after training began, and the closing wait at the end
    assert order[:6] == ["bootstrap", "init", "evaluation", "compile", "training",
                         "checkpoint"]
    assert order.index("evaluation", 3) > order.index("training")
    assert a.segments[1] == (103.0, 104.0, "init") and a.segments[3] == (104.5, 106.0,
                                                                          "compile")
    # job 1's lost steps are the last of its loop, after the restore
    assert [p for _, _, p in b.segments][:2] == ["bootstrap", "restore"]
    assert b.segments[-1][2] == "lost" and b.segments[-1][1] == b.end
    # lengths agree with the parts, up to what the records place only roughly
    for job in ledger.jobs:
        for part in ("bootstrap", "init", "restore", "compile", "evaluation"):
            drawn = sum(y - x for x, y, p in job.segments if p == part)
            assert drawn == pytest.approx(job.parts[part], abs=1e-9)


def test_the_timeline_is_drawn_in_time_order(tmp_path):
    from spmd.rundir.timeline import plot_timeline, timeline_figure

    ledger = build_ledger(*failed_then_rerun())
    fig = timeline_figure(ledger)
    bars = [p for p in fig.axes[0].patches if p.get_gid()]
    for job in ledger.jobs:
        row = [p for p in bars if abs(p.get_y() + p.get_height() / 2 - job.index) < 1e-9]
        lefts = [p.get_x() for p in row]
        assert lefts == sorted(lefts) and len(row) == len(job.segments) + (job.index > 0)
        assert [p.get_gid() for p in row] == (
            ([job.gap_before] if job.index else []) + [s[2] for s in job.segments])
    texts = [t.get_text().strip() for t in fig.axes[0].texts]
    assert texts == ["failed (rank 1)", "finished"]
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert plot_timeline(ledger, tmp_path / "t.png").stat().st_size > 0


SBATCH = """#!/bin/sh
echo "$* chain=${SPMD_CHAIN:-none}" >> "$STUB_LOG"
n=$(wc -l < "$STUB_LOG")
echo "$((40 + n));cluster"
"""


def test_jobscript_chain_submits_every_later_job_with_the_chain(tmp_path):
    from spmd.hpc.job_submit import submit_argv, submit_chain

    (tmp_path / "sbatch").write_text(SBATCH)
    (tmp_path / "sbatch").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n")
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "log"),
           "SPMD_CHAIN": "stale"}     # the submitting shell's (inside a job): not passed on
    assert submit_chain("slurm", script, 3, env=env) == ["41", "42", "43"]
    calls = (tmp_path / "log").read_text().splitlines()
    assert calls == [f"--parsable {script} chain=none",
                     f"--parsable --dependency=afterany:41 {script} chain=41",
                     f"--parsable --dependency=afterany:42 {script} chain=41"]
    # where the job does not take the submitting environment: on the command line
    assert submit_argv("pbs", script, "41.pbs", chain_next=True, chain="40.pbs")[0] == [
        "qsub", "-W", "depend=afterany:41.pbs", "-v", "SPMD_CHAIN_NEXT=1,SPMD_CHAIN=40.pbs",
        str(script)]
    assert submit_argv("flux", script, "f2", chain="f1")[0] == [
        "flux", "batch", "--dependency=afterany:f2", "--env=SPMD_CHAIN=f1", str(script)]

