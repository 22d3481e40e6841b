"""A real Open MPI (Debian's openmpi-bin, tests/helpers/openmpi.py) under `spmd run`.

Open MPI's mpirun aborts a job on SIGTERM: it SIGKILLs the ranks 1 s after passing the signal
on (odls_base_sigkill_timeout) and exits 1, so a preemption save was lost. `spmd run` passes
SIGTERM to it as SIGUSR1, which it forwards, and gives it the save's time before any SIGKILL.
A SIGTERM to every process of the job (mpirun too) makes mpirun wait out that time after the
ranks have saved and exited; `spmd run` ends it once every rank has left its status.
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid

import psutil
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


def signalled(run_dir, env: dict[str, str], whole: bool, *overrides: str) -> dict:
    """A job under Open MPI, signalled with SIGTERM once every rank committed step 10: `spmd
    run` alone, or (`whole`) every process of the job at once, as Slurm's scancel and a
    node's shutdown do (spmd run, mpirun, the rank shims, the ranks)."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(train_cmd(2, run_dir, "train.steps=100000", *LONG, *overrides),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=_env(1, SPMD_TEST_TAG=tag, **env))
    try:
        wait_for(lambda: committed_by_all(run_dir, 10), 180, "local step 10", proc)
        targets = [psutil.Process(proc.pid)]
        if whole:
            targets += psutil.Process(proc.pid).children(recursive=True)
        names = [p.name() for p in targets]
        sent = time.monotonic()
        for p in targets:
            p.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
        seconds = time.monotonic() - sent
    finally:
        kill_tagged(tag)
    return dict(code=proc.returncode, seconds=seconds, err=err, names=names)


def test_sigterm_under_open_mpi_saves_exits_75_and_resumes_bit_identical(ompi_env, tmp_path):
    """SIGTERM to `spmd run`, and to every process of another job at once (issue 38: mpirun,
    signalled itself, waited out odls_base_sigkill_timeout, 630 s, and the job exited 143
    with a false "did not stop" line). Both exit 75 and resume bit-identically."""
    doctor = run_spmd("doctor", env={**_env(1), **ompi_env})
    assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]
    assert "odls_base_sigkill_timeout" in doctor.stdout   # what a bare mpirun needs

    run_dir, whole_dir = tmp_path / "run", tmp_path / "whole"
    # mpirun's grace is then 60 + 30 s: a job that waited for it would take over 90 s
    save = ("checkpoint.timeout_s=60",)
    one, whole = side_by_side(lambda: signalled(run_dir, ompi_env, False),
                              lambda: signalled(whole_dir, ompi_env, True, *save))
    stops = {}
    for name, job, folder in (("spmd run", one, run_dir), ("whole job", whole, whole_dir)):
        assert job["code"] == 75, (name, job["err"][-4000:])
        assert "did not stop" not in job["err"], (name, job["err"][-4000:])
        assert f"via {ompi_env['SPMD_MPIEXEC']}" in job["err"]
        assert {e["launcher"] for e in events(folder, "started")} == {"openmpi"}
        preempted = events(folder, "preempted")
        assert len(preempted) == 2 and len({e["step"] for e in preempted}) == 1, name
        stops[name] = preempted[0]["step"]
        assert committed_by_all(folder, stops[name]), name   # saved where it stopped
    assert "mpirun.openmpi" in whole["names"] and len(whole["names"]) >= 6, whole["names"]
    # the ranks' save and exit, and at most run_cmd.OUTLIVE_S more for mpirun: not 90 s
    assert whole["seconds"] < 60, f"{whole['seconds']:.0f} s\n{whole['err'][-4000:]}"

    end = max(stops.values()) + 10
    mpich = tmp_path / "mpich"
    # the resumes under Open MPI and the reference under MPICH, side by side (separate dirs)
    resumed, resumed_whole, reference = side_by_side(
        lambda: train(2, run_dir, f"train.steps={end}", *LONG, devices=1, **ompi_env),
        lambda: train(2, whole_dir, f"train.steps={end}", *LONG, *save, devices=1,
                      **ompi_env),
        lambda: train(2, mpich, f"train.steps={end}", *LONG, devices=1))
    for name, job, folder in (("spmd run", resumed, run_dir),
                              ("whole job", resumed_whole, whole_dir)):
        assert job.returncode == 0, (name, job.stderr[-4000:])
        assert [e["step"] for e in events(folder, "restored")] == [stops[name]] * 2, name
    assert reference.returncode == 0, reference.stderr[-4000:]
    assert {e["launcher"] for e in events(mpich, "started")} == {"hydra"}
    assert step_blobs(run_dir, end) == step_blobs(mpich, end)
    assert step_blobs(whole_dir, end) == step_blobs(mpich, end)
