"""A real Open MPI (Debian's openmpi-bin, tests/helpers/openmpi.py) under `spmd run`.

Open MPI's mpirun aborts a job on SIGTERM: it SIGKILLs the ranks 1 s after passing the signal
on (odls_base_sigkill_timeout) and exits 1, so a preemption save was lost. `spmd run` passes
SIGTERM to it as SIGUSR1, which it forwards, and gives it the save's time before any SIGKILL.
"""

from __future__ import annotations

import signal
import subprocess
import uuid

import pytest

from tests.helpers.checkpoint_worker import (
    REPO,
    _env,
    committed_by_all,
    events,
    kill_tagged,
    step_blobs,
    train,
    train_cmd,
    wait_for,
)
from tests.helpers.env import require, run_spmd, side_by_side
from tests.helpers.openmpi import OpenMPIUnavailable, open_mpi, open_mpi_env

pytestmark = pytest.mark.slow

LONG = ("checkpoint.every=10", "checkpoint.keep=2", "run.log_every=10")


@pytest.fixture(scope="module")
def ompi_env() -> dict[str, str]:
    try:
        return open_mpi_env(open_mpi())
    except OpenMPIUnavailable as e:
        require(False, str(e))
        raise


def test_sigterm_under_open_mpi_saves_exits_75_and_resumes_bit_identical(ompi_env, tmp_path):
    doctor = run_spmd("doctor", env={**_env(1), **ompi_env})
    assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]
    assert "odls_base_sigkill_timeout" in doctor.stdout   # what a bare mpirun needs

    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = subprocess.Popen(train_cmd(2, run_dir, "train.steps=100000", *LONG),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=_env(1, SPMD_TEST_TAG=tag, **ompi_env))
    try:
        wait_for(lambda: committed_by_all(run_dir, 10), 180, "local step 10", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        kill_tagged(tag)
    assert proc.returncode == 75, err[-4000:]
    assert f"via {ompi_env['SPMD_MPIEXEC']}" in err
    started = [e for e in events(run_dir, "started")]
    assert {e["launcher"] for e in started} == {"openmpi"}
    stops = events(run_dir, "preempted")
    assert len(stops) == 2 and len({e["step"] for e in stops}) == 1
    stop = stops[0]["step"]
    assert committed_by_all(run_dir, stop)   # saved where it stopped

    end = stop + 10
    mpich = tmp_path / "mpich"
    # the resume under Open MPI and the reference under MPICH, side by side (separate dirs)
    resumed, reference = side_by_side(
        lambda: train(2, run_dir, f"train.steps={end}", *LONG, devices=1, **ompi_env),
        lambda: train(2, mpich, f"train.steps={end}", *LONG, devices=1))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [e["step"] for e in events(run_dir, "restored")] == [stop, stop]
    assert reference.returncode == 0, reference.stderr[-4000:]
    assert {e["launcher"] for e in events(mpich, "started")} == {"hydra"}
    assert step_blobs(run_dir, end) == step_blobs(mpich, end)
