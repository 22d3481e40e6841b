"""Seeing inside real 2-rank runs: a profiler trace that `spmd profile` reads, TensorBoard
event files with the right tags and steps and the resolved config as hyper-parameters,
written by rank 0 alone, and `spmd report`'s ledger over four jobs (two preemptions by
signal, a kill -9 of every process of the job, a rerun that finishes) that leaves at most 1%
of the wall time unexplained."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from spmd.rundir.trackers import flatten
from tests.helpers.checkpoint_worker import _env, events, kill_tagged, train_cmd
from tests.helpers.env import REPO, mpiexec_path, run_spmd
from tests.helpers.fault_injection import fault_env
from tests.helpers.records import read_jsonl
from tests.unit.rundir.test_trackers import tensorboard_hparams

pytestmark = pytest.mark.slow


def need_mpiexec() -> None:
    mpiexec_path()


def test_profile_trace_and_tensorboard_of_a_two_rank_run(tmp_path):
    need_mpiexec()
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        train_cmd(2, run_dir, "train.steps=8", "train.eval_every=4", "schedule.warmup_steps=4",
                  "run.profile.steps=[3,5]", "run.profile.ranks=[0,1]",
                  "run.trackers=[tensorboard]", "run.plots=false"),
        capture_output=True, text=True, env=_env(2), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]

    profiled = {e["rank"]: e for e in events(run_dir, "profiled")}
    assert {r: (e["first_step"], e["last_step"]) for r, e in profiled.items()} == {
        0: (3, 5), 1: (3, 5)}
    assert sorted(p.name for p in (run_dir / "profile").glob("memory_rank*_step1.prof")) == [
        "memory_rank00000_step1.prof", "memory_rank00001_step1.prof"]
    summary = run_spmd("profile", str(run_dir), "--json", "--top", "5")
    assert summary.returncode == 0, summary.stderr
    report = json.loads(summary.stdout)
    assert report["rank"] == 0 and report["steps"] == 3 and report["devices"] == 2
    parts = report["compute_s"] + report["collective_s"] + report["idle_s"]
    assert report["window_s"] > 0 and parts == pytest.approx(report["window_s"], rel=1e-6)
    assert report["ops"] and any(op["module"] == "jit_train_step" for op in report["ops"])
    text = run_spmd("profile", str(run_dir), "--rank", "1")
    assert text.returncode == 0 and "collectives (exposed)" in text.stdout, text.stderr

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"loss", "lr", "eval_loss", "samples_per_s", "grad_norm"} <= set(scalars)
    steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in ("loss", "lr", "eval_loss")}
    assert steps == {"loss": list(range(1, 9)), "lr": list(range(1, 9)), "eval_loss": [0, 4, 8]}
    metrics = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    for event in acc.Scalars("lr"):   # warm-up: update k uses lr * (k - 1) / 4
        assert event.value == pytest.approx(min(3e-3 * (event.step - 1) / 4, 3e-3))
        assert metrics[event.step]["lr"] == pytest.approx(event.value)
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(
        [metrics[s]["loss"] for s in range(1, 9)])
    # rank 0 alone writes (rank 1 would add its own events file, with the same scalars)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    # the resolved config, as run.dir/config.yaml has it, in the hparams plugin
    hparams = tensorboard_hparams(run_dir / "tensorboard")
    assert hparams == flatten(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert hparams["train.steps"] == 8 and hparams["run.trackers"] == "['tensorboard']"


def start(run_dir: Path, tag: str, *overrides: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(2, run_dir, "checkpoint.every=5", *overrides),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, start_new_session=True,
                            env=_env(2, SPMD_TEST_TAG=tag, **env))


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record:
            out.append(record["step"])
    return out


def wait_until(predicate, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n"
                                 f"{proc.stderr.read()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_report_over_two_preemptions_a_kill_9_and_a_rerun(tmp_path):
    need_mpiexec()
    run_dir = tmp_path / "run"
    long = "train.steps=100000"
    for n in (1, 2):   # preempted by SIGTERM (forwarded to the ranks), status 75
        before = len(train_steps(run_dir))
        proc = start(run_dir, uuid.uuid4().hex, long)
        wait_until(lambda b=before: len(train_steps(run_dir)) >= b + 8, proc, f"job {n}'s steps")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 75, err[-6000:]

    tag = uuid.uuid4().hex
    saves_before = len(events(run_dir, "saved"))
    # Steps of at least 0.3 s (rank 0 loads its batches slowly), so that the kill lands between
    # two saves (every 5 steps) and not just after one: some steps are lost.
    proc = start(run_dir, tag, long, **fault_env(slow_rank="0:0.3"))
    try:   # a commit in this job, then a few steps past it, then kill -9 every process
        wait_until(lambda: len(events(run_dir, "saved")) > saves_before, proc, "a commit")
        committed = events(run_dir, "saved")[-1]["step"]
        wait_until(lambda: (last := train_steps(run_dir)[-1]) >= committed + 3 and last % 5 >= 2,
                   proc, "steps after it, halfway to the next save")
        assert kill_tagged(tag) >= 3   # the launcher, mpiexec and the ranks
    finally:
        kill_tagged(tag)
        proc.communicate(timeout=60)
    killed_at = train_steps(run_dir)[-1]

    final = subprocess.run(train_cmd(2, run_dir, "checkpoint.every=5", "run.plots=false",
                                     f"train.steps={killed_at + 2}"),
                           capture_output=True, text=True, env=_env(2), timeout=300, cwd=REPO)
    assert final.returncode == 0, final.stderr[-6000:]
    assert not (run_dir / "profile").exists()   # profiling off: nothing written

    result = run_spmd("report", str(run_dir), "--json", "--plot")
    assert result.returncode == 0, result.stderr
    ledger = json.loads(result.stdout)
    jobs = ledger["jobs"]
    assert [j["exit_status"] for j in jobs] == [75, 75, None, 0]
    assert [j["reason"].split()[0] for j in jobs] == ["preempted", "preempted", "lost",
                                                      "finished"]
    assert all(j["ranks"] == 2 for j in jobs)
    last_commit = jobs[3]["restored_step"]
    assert last_commit >= committed and jobs[2]["last_step"] == killed_at
    assert jobs[2]["lost_steps"] == killed_at - last_commit > 0
    assert ledger["lost_steps"] == killed_at - last_commit
    assert ledger["totals"]["lost"] > 0
    assert [j["lost_steps"] for j in (jobs[0], jobs[1], jobs[3])] == [0, 0, 0]
    total = sum(ledger["totals"].values())
    assert total == pytest.approx(ledger["wall_s"], rel=0.01)
    # `other` is the remainder that makes the sum exact: what the records leave unexplained
    assert abs(ledger["totals"]["other"]) <= 0.01 * ledger["wall_s"], ledger["totals"]
    for job in jobs:
        assert sum(job["parts"].values()) == pytest.approx(job["wall_s"], rel=1e-9)
        assert job["parts"]["training"] > 0 and job["parts"]["bootstrap"] > 0
    assert 0 < ledger["goodput"] < 1
    assert (run_dir / "plots" / "timeline.png").stat().st_size > 0
    text = run_spmd("report", str(run_dir))
    assert text.returncode == 0 and "lost (no end record" in text.stdout, text.stderr
