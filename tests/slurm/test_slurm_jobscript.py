"""Rendered Slurm scripts on a real one-node Slurm (tests/helpers/slurm_cluster.py).

Chained submission, the USR1 -> USR2 forward -> exit 75 -> `scontrol requeue` protocol with
fake ranks, and `spmd train` end to end: 2 ranks through `srun --mpi=pmi2`, to completion and
through a preemption and requeue. Every wait is bounded; a failure prints the job's record,
its output file and the daemon logs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd.errors import ExitCode
from spmd.hpc.batch_scripts import make_request, write_script
from spmd.hpc.job_submit import submit
from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)
from tests.unit.hpc.test_jobscript import FAKE_RANK

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "mlp_tiny.yaml"
CPU_ENV = ("--env", "JAX_NUM_CPU_DEVICES=2", "--env", "JAX_PLATFORMS=cpu")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def wait_until(predicate, timeout: float, what: str, describe=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{describe()}")


def spmd_jobscript(cluster, *args: str) -> list[str]:
    """Run the real CLI against the test cluster; the job ids it printed."""
    r = subprocess.run([sys.executable, "-m", "spmd.cli", "jobscript", *args], cwd=REPO,
                       env=cluster.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_srun_pmi2_gives_mpi4py_its_ranks(slurm_cluster):  # noqa: F811
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; print(c.Get_rank(), c.Get_size())"
    r = slurm_cluster.run("srun", "--mpi=pmi2", "-N1", "-n2", sys.executable, "-c", code,
                          timeout=120)
    assert sorted(r.stdout.split("\n")[:2]) == ["0 2", "1 2"], r.stdout + r.stderr


def test_chain_of_three_with_afterany(slurm_cluster, tmp_path):  # noqa: F811
    ids = spmd_jobscript(slurm_cluster, str(CONFIG), "--system", "slurm", "--nodes", "1",
                         "--time", "5", "--chain", "3", "--submit", *CPU_ENV,
                         f"run.dir={tmp_path / 'run'}", "train.steps=1")
    try:
        assert len(ids) == 3 and all(i.isdigit() for i in ids), ids
        for before, job in zip(ids, ids[1:], strict=False):
            info = slurm_cluster.job_info(job)
            assert info.get("Dependency", "").startswith(f"afterany:{before}"), \
                slurm_cluster.describe(job, info)
        script = tmp_path / "run" / "job.slurm.sh"
        assert all(slurm_cluster.job_info(j).get("Command") == str(script) for j in ids)
        assert all(i.isdigit() and int(i) >= slurm_cluster.first_job_id for i in ids)
    finally:
        slurm_cluster.run("scancel", *ids, check=False)
        for job in ids:
            slurm_cluster.wait_finished(job, timeout=60)


def test_usr1_is_forwarded_to_every_rank_and_job_requeued(slurm_cluster, tmp_path):  # noqa: F811
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    rank = tmp_path / "fake_rank.py"
    rank.write_text(FAKE_RANK)
    req = make_request(CONFIG, system="slurm", nodes=1, time="5", ranks_per_node=2,
                       overrides=[f"run.dir={run_dir}"], workdir=REPO,
                       env={"FAKE_OUT": str(out), "FAKE_RUN_DIR": str(run_dir),
                            "FAKE_WAIT_S": "60"})
    req = dataclasses.replace(req, command=(sys.executable, str(rank)))
    job = submit("slurm", write_script(req), env=slurm_cluster.env)
    describe = lambda: slurm_cluster.describe(job)  # noqa: E731
    try:
        wait_until(lambda: (out / "ready.0").exists() and (out / "ready.1").exists(), 90,
                   "both fake ranks to start", describe)
        time.sleep(0.3)
        slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
        wait_until(lambda: all((out / f"signals.{r}").exists() for r in (0, 1)), 30,
                   "the ranks to get the forwarded signal", describe)
        assert [(out / f"signals.{r}").read_text() for r in (0, 1)] == ["SIGUSR2"] * 2
        info = slurm_cluster.wait_for(job, lambda i: int(i.get("Restarts", 0)) >= 1, 60,
                                      "the job to be requeued")
        # the requeued run (SLURM_RESTART_COUNT=1) exits 0 at once: the job completes
        info = slurm_cluster.wait_finished(job, timeout=120)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", describe()
        assert int(info["Restarts"]) == 1, describe()
        log = (run_dir / f"slurm-{job}.out").read_text()
        assert "ranks exited with status 75" in log and f"requeued job {job}" in log, log
        assert json.loads((out / "ready.0").read_text())["restart"] == "1", log
    finally:
        slurm_cluster.run("scancel", job, check=False)


def test_spmd_train_two_ranks_to_completion(slurm_cluster, tmp_path):  # noqa: F811
    """The usual habit: render to a file, then `sbatch` it by hand (run.dir does not exist)."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "spmd.cli", "jobscript", str(CONFIG), "--system",
                        "slurm", "--nodes", "1", "--time", "5", "--ranks-per-node", "2",
                        *CPU_ENV, f"run.dir={run_dir}", "train.steps=6", "run.progress=false"],
                       cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sh"
    script.write_text(r.stdout)
    sbatch = slurm_cluster.run("sbatch", "--parsable", str(script), cwd=tmp_path)
    job = sbatch.stdout.strip().split(";")[0]
    assert job.isdigit(), sbatch.stdout
    try:
        info = slurm_cluster.wait_finished(job, timeout=240)
        assert info["JobState"] == "COMPLETED", slurm_cluster.describe(job, info)
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert metrics and metrics[-1]["step"] == 6, metrics
        assert all({"step", "loss", "step_time_s"} <= set(m) for m in metrics)
        ev = events(run_dir)
        started = {e["rank"]: e for e in ev if e["event"] == "started"}
        assert set(started) == {0, 1}, ev
        assert all(e["launcher"] == "slurm" and e["size"] == 2 for e in started.values()), ev
        assert {e["rank"] for e in ev if e["event"] == "finished"} == {0, 1}, ev
    finally:
        slurm_cluster.run("scancel", job, check=False)


def test_spmd_train_preempted_stops_together_and_requeues(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    (job,) = spmd_jobscript(slurm_cluster, str(CONFIG), "--system", "slurm", "--nodes", "1",
                            "--time", "10", "--ranks-per-node", "2", *CPU_ENV, "--submit",
                            f"run.dir={run_dir}", "train.steps=10000000", "run.log_every=10",
                            "run.progress=false")
    describe = lambda: slurm_cluster.describe(job)  # noqa: E731
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and metrics.stat().st_size > 0, 180,
                   "training to log a step", describe)
        slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)

        def preempted() -> list[dict]:
            return [e for e in events(run_dir) if e["event"] == "preempted"]

        wait_until(lambda: len(preempted()) >= 2, 90, "both ranks to report preemption",
                   describe)
        stops = preempted()
        assert {e["rank"] for e in stops} == {0, 1}, stops
        assert len({e["step"] for e in stops}) == 1, f"ranks stopped at different steps: {stops}"
        assert all(e["exit_code"] == ExitCode.PREEMPTED for e in stops), stops
        stop_step = stops[0]["step"]

        slurm_cluster.wait_for(job, lambda i: int(i.get("Restarts", 0)) >= 1, 60,
                               "the job to be requeued")

        def restarted() -> set[int]:
            return {e["rank"] for e in events(run_dir)
                    if e["event"] == "started" and e.get("restart_count") == 1}

        wait_until(lambda: restarted() == {0, 1}, 150, "the requeued job to start both ranks",
                   describe)
        log = (run_dir / f"slurm-{job}.out").read_text()
        assert "got SIGUSR1" in log and f"requeued job {job}" in log, log
        # Once the run has checkpoints, the second run must resume where the first stopped.
        def later() -> list[dict]:
            return [e for e in events(run_dir) if e.get("time", 0) > stops[-1]["time"]
                    and e["event"] in ("restored", "initialized")]

        wait_until(lambda: bool(later()), 120, "the requeued run to restore or initialize",
                   describe)
        for e in later():
            if e["event"] == "restored":
                assert e["step"] == stop_step, (e, stops)
    finally:
        slurm_cluster.run("scancel", job, check=False)
        slurm_cluster.wait_finished(job, timeout=60)
        if os.environ.get("SPMD_KEEP_RUNS"):
            print(f"run dir kept: {run_dir}")


def test_mpich_shm_name_hash():
    """MPICH 5.0.2 named the segment a killed step 7.0 left behind mpich_shm_14f46f28_0."""
    from tests.helpers.slurm_cluster import fnv1a32

    assert fnv1a32("7.0") == "14f46f28"
