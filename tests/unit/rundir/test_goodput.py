"""The goodput ledger over hand-made records: three jobs (preempted, killed, finished), the
parts of each, lost work after the last kept step, the gaps between jobs (queue for a requeue,
between runs for a rerun by hand), and an older run directory whose records carry less.
Failed jobs, chains and the timeline's order: tests/unit/rundir/test_report_ledger.py."""

from __future__ import annotations

import pytest

from spmd.rundir.goodput import PARTS, build_ledger


def ev(event: str, t: float, rank: int = 0, **fields) -> dict:
    return {"event": event, "time": t, "rank": rank, "host": "h", **fields}


def steps(first: int, last: int, t0: float, dt: float) -> list[dict]:
    return [{"step": s, "time": t0 + (s - first + 1) * dt, "loss": 1.0, "step_time_s": dt}
            for s in range(first, last + 1)]


def three_jobs() -> tuple[list[dict], list[dict]]:
    events = [
        ev("started", 102, size=2, nodes=1, job_id="7", restart_count=0, process_start=100),
        ev("started", 102.1, rank=1, size=2, process_start=100),
        ev("initialized", 104, step=0, seconds=1.0),
        ev("evaluated", 104.5, step=0, eval_loss=1.0, seconds=0.5),
        ev("compiled", 106, seconds=1.5),
        ev("saved", 109, tier="local", step=5, blocking_s=0.1, waited_s=0.0),
        ev("evaluated", 111.2, step=10, eval_loss=0.5, seconds=0.2),
        ev("saved", 111.5, tier="local", step=10, blocking_s=0.05, waited_s=0.0, shared=True),
        ev("saved", 111.6, tier="persistent", step=10, blocking_s=0.05, waited_s=0.0,
           shared=True),
        ev("closed", 111.9, seconds={"checkpoint": 0.3, "metrics": 0.01}),
        ev("preempted", 112, step=10, reason="SIGTERM", exit_code=75),
        ev("started", 121, size=2, nodes=1, job_id="7", restart_count=1, process_start=120),
        ev("restored", 123, step=10, source="local", seconds=0.5),
        ev("compiled", 124, seconds=0.5),
        ev("saved", 129.5, tier="local", step=15, blocking_s=0.2, waited_s=0.1),
        ev("started", 141, size=2, nodes=1, job_id="9", restart_count=0, process_start=140),
        ev("restored", 142, step=15, source="local", seconds=0.5),
        ev("compiled", 143, seconds=0.5),
        ev("closed", 148.5, seconds={"checkpoint": 0.1}),
        ev("finished", 149, step=20),
    ]
    metrics = [{"step": 0, "eval_loss": 1.0}, *steps(1, 10, 106, 0.5),
               *steps(11, 16, 124, 1.0), *steps(16, 20, 143, 1.0)]
    return events, metrics


def test_jobs_parts_lost_work_and_queue():
    ledger = build_ledger(*three_jobs(), batch_size=8)
    a, b, c = ledger.jobs
    assert [(j.job_id, j.restart_count, j.exit_status) for j in ledger.jobs] == [
        ("7", 0, 75), ("7", 1, None), ("9", 0, 0)]
    assert [j.began for j in ledger.jobs] == ["init", "restore", "restore"]
    assert a.reason == "preempted (SIGTERM)" and b.reason.startswith("lost")
    assert (a.start, a.end, b.start, b.end, c.start, c.end) == (100, 112, 120, 130, 140, 149)
    assert a.parts == pytest.approx({
        "bootstrap": 3.0, "init": 1.0, "restore": 0.0, "compile": 1.5, "evaluation": 0.7,
        "checkpoint": 0.1 + 0.05 + 0.3, "training": 5.0 - 0.1, "lost": 0.0, "other": 0.45})
    # job b: steps 11..16, the next job resumed from 15: step 16 (1 s) was lost
    assert (b.restored_step, b.last_step, b.lost_steps) == (10, 16, 1)
    assert b.parts["lost"] == pytest.approx(1.0)
    assert b.parts["training"] == pytest.approx(6.0 - 0.3 - 1.0)
    assert b.productive_steps == 5 and c.productive_steps == 5 and a.productive_steps == 10
    assert (b.gap_before_s, c.gap_before_s) == (8.0, 10.0)
    # b is job 7 requeued: queue; c (job 9) is unrelated to it: a rerun, between runs
    assert (a.gap_before, b.gap_before, c.gap_before) == (None, "queue", "between_runs")
    assert (ledger.totals["queue"], ledger.totals["between_runs"]) == (8.0, 10.0)
    assert b.parts["restore"] == 0.5 and b.parts["init"] == 0.0
    assert ledger.lost_steps == 1
    assert ledger.wall_s == 49.0
    assert sum(ledger.totals.values()) == pytest.approx(ledger.wall_s, rel=1e-12)
    assert ledger.goodput == pytest.approx(ledger.totals["training"] / 49.0)
    assert ledger.throughput["samples_per_s"] == pytest.approx(
        8 * 20 / ledger.totals["training"])


def test_a_killed_last_job_loses_what_it_did_after_its_last_commit():
    events, metrics = three_jobs()
    events, metrics = events[:-5], metrics[:-5]   # the run ends with the killed job b
    ledger = build_ledger(events, metrics)
    assert len(ledger.jobs) == 2
    assert ledger.jobs[1].lost_steps == 1          # saved 15, logged 16
    assert sum(ledger.totals.values()) == pytest.approx(ledger.wall_s)


def test_an_older_run_directory_is_reported_with_what_it_has():
    events = [ev("started", 10, size=1), ev("initialized", 11, step=0),
              ev("compiled", 12, seconds=0.5), ev("finished", 20, step=4)]
    metrics = [{"step": s, "loss": 1.0, "step_time_s": 0.1} for s in range(1, 5)]  # no time
    ledger = build_ledger(events, metrics)
    (job,) = ledger.jobs
    assert (job.start, job.end, job.exit_status) == (10, 20, 0)
    assert set(job.parts) == set(PARTS)
    assert job.parts["bootstrap"] == 1.0 and job.parts["compile"] == 0.5
    assert sum(job.parts.values()) == pytest.approx(10.0)
    assert ledger.goodput == 0.0


def test_no_job_yet():
    ledger = build_ledger([], [])
    assert ledger.jobs == [] and ledger.wall_s == 0.0


def test_spmd_report_prints_the_table_and_draws_the_timeline(tmp_path, capsys):
    import json

    from spmd.cli.main import main

    events, metrics = three_jobs()
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics)
                                            + '{"step": 21, "lo')   # cut short by a kill
    (tmp_path / "config.yaml").write_text("train:\n  batch_size: 8\n")
    assert main(["report", str(tmp_path), "--plot"]) == 0
    out = capsys.readouterr().out
    assert "preempted (SIGTERM)" in out and "lost (no end record" in out
    assert "goodput" in out and "samples_per_s" in out
    assert "0->1 8.0 s queue, 1->2 10.0 s between runs" in out
    assert "  init " in out and "  queue " in out and "  between runs " in out
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 0
    assert main(["report", str(tmp_path / "missing")]) != 0
    assert "no events" in capsys.readouterr().err


def test_a_long_lived_interpreter_starts_its_job_at_run_start():
    from spmd.rundir.goodput import job_start

    assert job_start({"time": 50, "process_start": 40, "run_start": 45}) == 40
    assert job_start({"time": 5000, "process_start": 40, "run_start": 4990}) == 4990
    assert job_start({"time": 50}) == 50


def test_the_time_waited_for_data_is_summed_over_logged_steps():
    events, metrics = three_jobs()
    for r in metrics:
        if "loss" in r:
            r["input_wait_s"] = 0.1 * r["step_time_s"]   # 10% of every step waits for data
    tp = build_ledger(events, metrics, batch_size=8).throughput
    assert tp["input_wait_s"] == pytest.approx(0.1 * sum(r["step_time_s"] for r in metrics
                                                         if "loss" in r))
    assert tp["input_wait_fraction"] == pytest.approx(0.1)
    assert "input_wait_s" not in build_ledger(*three_jobs(), batch_size=8).throughput


def two_recorded_jobs() -> tuple[list[dict], list[dict]]:
    """A preempted job and its requeue whose records explain all but the last 30 ms of each
    job (teardown after the last record of the closing): what a healthy run writes."""
    events = [
        ev("started", 101, size=2, nodes=1, job_id="7", restart_count=0, process_start=100),
        ev("initialized", 102, step=0, seconds=1.0),
        ev("evaluated", 102.5, step=0, eval_loss=1.0, seconds=0.5),
        ev("compiled", 104.5, seconds=2.0),
        ev("saved", 107.1, tier="local", step=5, blocking_s=0.1, waited_s=0.0),
        ev("closed", 109.95, seconds={"checkpoint": 0.3}),
        ev("preempted", 109.97, step=10, reason="SIGTERM", exit_code=75),
        ev("started", 121, size=2, nodes=1, job_id="7", restart_count=1, process_start=120),
        ev("restored", 122, step=10, source="local", seconds=0.5),
        ev("compiled", 123, seconds=1.0),
        ev("evaluated", 128.2, step=20, eval_loss=0.5, seconds=0.2),
        ev("saved", 128.4, tier="persistent", step=20, blocking_s=0.2, waited_s=0.0),
        ev("closed", 128.95, seconds={"checkpoint": 0.5}),
        ev("finished", 128.97, step=20),
    ]
    metrics = [{"step": 0, "eval_loss": 1.0}, *steps(1, 5, 104.5, 0.5),
               *steps(6, 10, 107.1, 0.5), *steps(11, 20, 123, 0.5)]
    return events, metrics


def test_the_parts_explain_the_wall_time_to_within_one_percent():
    """`other` is the remainder, so the parts always sum to the wall time: what says that
    the ledger accounts for the time is that the unexplained rest stays under 1%."""
    ledger = build_ledger(*two_recorded_jobs(), batch_size=8)
    assert [j.reason for j in ledger.jobs] == ["preempted (SIGTERM)", "finished"]
    assert sum(ledger.totals.values()) == pytest.approx(ledger.wall_s, rel=0.01)
    assert 0 <= ledger.totals["other"] <= 0.01 * ledger.wall_s
    for job in ledger.jobs:
        assert sum(job.parts.values()) == pytest.approx(job.wall_s, rel=1e-9)
        assert 0 <= job.parts["other"] <= 0.01 * job.wall_s
    assert ledger.totals["training"] == pytest.approx(10.0)   # 20 steps of 0.5 s
    assert ledger.totals["queue"] == pytest.approx(120 - 109.97)


def test_mfu_and_model_flops_reach_the_report_when_the_task_gives_flops(tmp_path, capsys):
    import json

    from spmd.cli.main import main

    events, metrics = two_recorded_jobs()
    for r in metrics:
        if "loss" in r:   # what MetricsHook logs for a task with FLOPs on a known device
            r.update(mfu=0.38 + 0.01 * (r["step"] % 5), model_flops_per_s=4e12,
                     tokens_per_s=2048.0)
    ledger = build_ledger(events, metrics, batch_size=8)
    tp = ledger.throughput
    assert tp["median_mfu"] == pytest.approx(0.40)
    assert tp["median_model_flops_per_s"] == 4e12 and tp["median_tokens_per_s"] == 2048.0
    assert tp["allocation_mfu"] == pytest.approx(0.40 * ledger.goodput)
    assert tp["samples_per_s"] == pytest.approx(8 * 20 / 10.0)

    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (tmp_path / "config.yaml").write_text("train:\n  batch_size: 8\n")
    assert main(["report", str(tmp_path)]) == 0
    (line,) = [s for s in capsys.readouterr().out.splitlines() if s.startswith("throughput:")]
    assert "samples_per_s 16," in line and "median_tokens_per_s 2,048," in line
    assert "median_model_flops_per_s 4e+12," in line and "median_mfu 0.4," in line
    assert line.endswith(f"allocation_mfu {0.40 * ledger.goodput:.4g}")
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["throughput"] == pytest.approx(tp)

    # FLOPs but no known peak for the device (a CPU): FLOP/s, and no MFU to report
    for r in metrics:
        r.pop("mfu", None)
    tp = build_ledger(events, metrics, batch_size=8).throughput
    assert tp["median_model_flops_per_s"] == 4e12
    assert "median_mfu" not in tp and "allocation_mfu" not in tp
