"""Preempted under a real Slurm: signalled mid-run, saves, is requeued, resumes bit-identical.

Two jobs of the same rendered script (2 ranks via `srun --mpi=pmi2`): one runs undisturbed;
the other gets USR1 (the job script forwards USR2 to the ranks) while a checkpoint save is
held in flight by the SPMD_CKPT_TEST_STALL fault (tests/helpers/fault_injection.py), so the
signal always lands mid-run. It must save the step it stopped at, exit 75, be requeued,
restore that step, and finish with the same final loss and the same final checkpoint bytes
as the undisturbed job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.fault_injection import fault_env
from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "mlp_tiny.yaml"
STEPS = 40
OVERRIDES = (f"train.steps={STEPS}", "checkpoint.every=10", "checkpoint.persistent_every=20",
             "checkpoint.timeout_s=120", "run.progress=false")


def events(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in (json.loads(x) for x in path.read_text().splitlines() if x.strip())
            if e["event"] == name]


def final(run_dir: Path) -> tuple[float, dict[str, bytes]]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loss = [x for x in lines if x.get("step") == STEPS][-1]["loss"]
    blobs = {p.parent.name: p.read_bytes()
             for p in sorted((run_dir / "local" / str(STEPS)).glob("rank?????/shards.bin"))}
    return loss, blobs


def submit(cluster, run_dir: Path, *env: str) -> str:
    env_args = [a for e in ("JAX_NUM_CPU_DEVICES=2", "JAX_PLATFORMS=cpu", *env)
                for a in ("--env", e)]
    r = subprocess.run([sys.executable, "-m", "spmd.cli", "jobscript", str(CONFIG),
                        "--system", "slurm", "--nodes", "1", "--time", "10",
                        "--ranks-per-node", "2", *env_args, "--submit", f"run.dir={run_dir}",
                        *OVERRIDES], cwd=REPO, env=cluster.env, capture_output=True, text=True,
                       timeout=120)
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


def test_signalled_job_saves_requeues_and_resumes_bit_identical(slurm_cluster, tmp_path):  # noqa: F811
    plain_dir, preempted_dir = tmp_path / "plain", tmp_path / "preempted"
    plain = submit(slurm_cluster, plain_dir)
    job = submit(slurm_cluster, preempted_dir,
                 *(f"{k}={v}" for k, v in fault_env(stall="10:8").items()))
    describe = lambda: slurm_cluster.describe(job)  # noqa: E731
    try:
        in_flight = [preempted_dir / "local" / "10" / f"rank{r:05d}.tmp" / "index.json"
                     for r in (0, 1)]
        wait_until(lambda: all(p.exists() for p in in_flight), 240,
                   "the save of step 10 to be in flight on both ranks", describe)
        slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
        wait_until(lambda: len(events(preempted_dir, "preempted")) >= 2, 120,
                   "both ranks to stop", describe)
        stops = events(preempted_dir, "preempted")
        stop_step = stops[0]["step"]
        assert {e["step"] for e in stops} == {stop_step} and 10 <= stop_step < STEPS, stops
        saved = {(e["tier"], e["step"]) for e in events(preempted_dir, "saved")}
        assert ("local", stop_step) in saved and ("persistent", stop_step) in saved, saved

        info = slurm_cluster.wait_finished(job, timeout=300)
        assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, describe()
        restored = events(preempted_dir, "restored")
        assert {(e["rank"], e["step"], e["source"]) for e in restored} == {
            (0, stop_step, "local"), (1, stop_step, "local")}, restored
        # The lease: the preempted attempt released it on its way out (status 75), and the
        # requeued attempt (same job, restart 1) took it without waiting for any staleness.
        (acquired_0, acquired_1) = [e["holder"] for e in events(preempted_dir, "lease_acquired")]
        assert (acquired_0["job_id"], acquired_0["restart_count"]) == (job, 0)
        assert (acquired_1["job_id"], acquired_1["restart_count"]) == (job, 1)
        assert not events(preempted_dir, "lease_taken_over")
        assert not (preempted_dir / "lease.json").exists()
        info = slurm_cluster.wait_finished(plain, timeout=300)
        assert info["JobState"] == "COMPLETED", slurm_cluster.describe(plain, info)
        assert final(preempted_dir) == final(plain_dir)
        assert final(plain_dir)[1], "the final step was not saved locally"
    finally:
        slurm_cluster.run("scancel", job, plain, check=False)
