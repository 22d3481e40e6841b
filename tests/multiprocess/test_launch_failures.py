"""Launch failures are clear and quick: non-zero exit, a message naming what to fix, no
traceback, never a hang."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from tests.helpers.env import clean_env, mpiexec_path, run_spmd


def assert_clean_failure(result, *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_allocation_but_not_a_step():
    result = run_spmd("doctor", env=clean_env(SLURM_JOB_ID="4242", SLURM_NNODES="2"), timeout=60)
    assert_clean_failure(result, "SLURM_JOB_ID=4242", "SLURM_PROCID is not set",
                         "run it under srun")
    result = run_spmd("doctor", env=clean_env(LSB_JOBID="77"), timeout=60)
    assert_clean_failure(result, "LSB_JOBID=77", "run it under jsrun")
    result = run_spmd("doctor", env=clean_env(PBS_JOBID="9.pbs"), timeout=60)
    assert_clean_failure(result, "PBS_JOBID=9.pbs", "PALS_RANKID / PMI_RANK",
                         "run it under mpiexec")


def test_environment_and_mpi_disagree_on_size():
    env = clean_env(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0")
    result = subprocess.run([mpiexec_path(), "-n", "2", "-launcher", "fork", sys.executable, "-m",
                             "spmd.cli", "doctor"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert_clean_failure(result, "SLURM_PROCID=0, SLURM_NTASKS=4", "rank 1 of 2",
                         "MPI COMM_WORLD (MPICH")


def test_unreachable_coordinator_fails_within_timeout():
    port = closed_port()
    env = clean_env(SPMD_RANK="1", SPMD_SIZE="2", SPMD_COORDINATOR=f"127.0.0.1:{port}")
    start = time.monotonic()
    result = run_spmd("doctor", "--connect", "--timeout", "5", env=env, timeout=60)
    elapsed = time.monotonic() - start
    assert_clean_failure(result, "rank 1 on", f"the coordinator 127.0.0.1:{port} did not answer "
                         "within 5 s", "launch.init_timeout_s")
    assert 5 <= elapsed < 5 + 10, elapsed


def test_rank0_waiting_for_missing_ranks_fails_within_timeout():
    # jax would abort from C++ after its own timeout; our watchdog speaks first.
    port = closed_port()
    env = clean_env(SPMD_RANK="0", SPMD_SIZE="2", SPMD_COORDINATOR=f"127.0.0.1:{port}")
    start = time.monotonic()
    result = run_spmd("doctor", "--connect", "--timeout", "4", env=env, timeout=60)
    elapsed = time.monotonic() - start
    assert_clean_failure(result, "rank 0 on", "did not finish within 4 s",
                         f"127.0.0.1:{port}", "2 ranks")
    assert "Check failure" not in result.stderr
    assert 4 <= elapsed < 4 + 10, elapsed


def test_no_coordinator_without_mpi_or_job_says_what_to_set():
    result = run_spmd("doctor", "--json", env=clean_env(SPMD_RANK="1", SPMD_SIZE="2"), timeout=60)
    assert result.returncode == 1
    assert "Set SPMD_COORDINATOR=host:port" in result.stdout
