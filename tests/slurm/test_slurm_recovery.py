"""Recovery inside the allocation under a real Slurm (the one-node test cluster).

- A rank killed with kill -9 mid-run: the job script's supervisor (spmd.launch.supervisor)
  reads srun's report ("task 1: Killed") and the node's state (up: nothing to leave out),
  starts the ranks again in the same job, they restore the last checkpoint and finish; Slurm
  never requeues the job, and `spmd report` shows the recovery with its seconds.
- An exception in the task on every rank (tests/helpers/failing_task.py): an error in the
  code, not a lost node. With launch.max_restarts=2 it is not tried again (launch.retry_errors
  is off; with it on, the same error twice ends the job: tests/unit/hpc/test_recovery.py), and the
  job ends FAILED with that error in its output.

Node loss with spares (srun --exclude) needs several nodes: tests/multinode.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd.errors import ExitCode
from tests.helpers.failing_task import MESSAGE
from tests.helpers.fault_injection import fault_env
from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "mlp_tiny.yaml"
STEPS = 40


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in jsonl(run_dir / "events.jsonl") if e.get("event") == name]


def submit(cluster, run_dir: Path, *overrides: str, env: tuple[str, ...] = ()) -> str:
    env_args = [a for e in ("JAX_NUM_CPU_DEVICES=1", "JAX_PLATFORMS=cpu", *env)
                for a in ("--env", e)]
    r = subprocess.run([sys.executable, "-m", "spmd.cli", "jobscript", str(CONFIG),
                        "--system", "slurm", "--nodes", "1", "--time", "10",
                        "--ranks-per-node", "2", "--check", "none", *env_args, "--submit",
                        f"run.dir={run_dir}", "run.progress=false", *overrides],
                       cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (job,) = r.stdout.split()
    return job


def wait_until(predicate, timeout: float, what: str, describe) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                                 f"{describe()}")
        time.sleep(0.2)


def rank_pid(job: str, rank: int) -> int | None:
    """The pid of `rank` of Slurm job `job` (its `spmd.cli train` process), from /proc."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"SLURM_JOB_ID={job}".encode() in environ
                and f"SLURM_PROCID={rank}".encode() in environ
                and b"spmd.cli\0train" in cmdline):
            return int(proc.name)
    return None


def output(run_dir: Path, job: str) -> str:
    path = run_dir / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_killed_rank_is_relaunched_inside_the_job(slurm_cluster, tmp_path):  # noqa: F811
    import os
    import signal

    run_dir = tmp_path / "run"
    # rank 0 loads each batch 0.15 s late: the run lasts long enough to be killed mid-way
    job = submit(slurm_cluster, run_dir, f"train.steps={STEPS}", "checkpoint.every=10",
                 "checkpoint.persistent_every=20", "launch.max_restarts=2",
                 env=tuple(f"{k}={v}" for k, v in fault_env(slow_rank="0:0.15").items()))
    describe = lambda: slurm_cluster.describe(job) + "\n" + output(run_dir, job)  # noqa: E731
    try:
        wait_until(lambda: any(e["step"] == 10 and e.get("tier") == "local"
                               for e in events(run_dir, "saved")), 240,
                   "the checkpoint of step 10", describe)
        pid = rank_pid(job, 1)
        assert pid is not None, describe()
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        info = slurm_cluster.wait_finished(job, timeout=300)
        log = output(run_dir, job)
        assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 0, describe()
        assert "requeue" not in log.split("ranks exited with status")[-1], log

        decisions = [r for r in jsonl(run_dir / "recovery.jsonl") if r["event"] == "recovery"]
        assert len(decisions) == 1, decisions
        (d,) = decisions
        assert (d["kind"], d["action"], d["failed_rank"]) == ("process_lost", "relaunch", 1), d
        assert d["exclude"] == [] and d["ended_at"] - killed_at < 60, d
        assert "rank 1" in d["cause"] and "Killed" in d["cause"], d
        starts = [e for e in events(run_dir, "started") if e["rank"] == 0]
        assert len(starts) == 2 and {e["job_id"] for e in starts} == {job}, starts
        restored = [e for e in events(run_dir, "restored") if e["rank"] == 0]
        assert len(restored) == 1 and restored[0]["step"] >= 10, restored
        train = [r for r in jsonl(run_dir / "metrics.jsonl") if "loss" in r]
        assert train[-1]["step"] == STEPS, train[-1]

        r = subprocess.run([sys.executable, "-m", "spmd.cli", "report", str(run_dir),
                            "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        (rec,) = report["recoveries"]
        assert rec["failed_rank"] == 1 and rec["relaunched_job"] == 1, rec
        assert rec["restored_step"] == restored[0]["step"]
        for key in ("detect_s", "relaunch_s", "bootstrap_s", "restore_s", "compile_s",
                    "to_first_step_s"):
            assert rec[key] is not None and rec[key] >= 0, (key, rec)
        assert rec["steps_computed_twice"] >= 0
        text = subprocess.run([sys.executable, "-m", "spmd.cli", "report", str(run_dir)],
                              capture_output=True, text=True, timeout=120).stdout
        assert "recoveries inside the job" in text and "process_lost" in text, text
        assert " relaunch " in text.split("wall time")[1], text
    finally:
        slurm_cluster.run("scancel", job, check=False)


def test_an_error_in_the_task_is_not_retried_past_max_restarts(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    job = submit(slurm_cluster, run_dir, "task=tests.helpers.failing_task:FailingTask",
                 "launch.max_restarts=2")
    try:
        info = slurm_cluster.wait_finished(job, timeout=300)
        log = output(run_dir, job)
        assert info["JobState"] == "FAILED" and int(info["Restarts"]) == 0, (info, log)
        records = jsonl(run_dir / "recovery.jsonl")
        launches = [r for r in records if r["event"] == "launch"]
        decisions = [r for r in records if r["event"] == "recovery"]
        assert len(launches) == 1 and len(decisions) == 1, records   # no restart
        assert (decisions[0]["action"], decisions[0]["kind"]) == ("stop", "error"), decisions
        assert decisions[0]["failed_rank"] == 0 and "retry_errors" in decisions[0]["cause"]
        status = decisions[-1]["status"]
        assert status not in (0, int(ExitCode.PREEMPTED), int(ExitCode.HUNG))
        assert info["ExitCode"].split(":")[0] == str(status), (info, decisions)
        assert MESSAGE in decisions[-1]["cause"] and MESSAGE in log, log
        assert f"ending the job with status {status}" in log, log
    finally:
        slurm_cluster.run("scancel", job, check=False)
