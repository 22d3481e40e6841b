"""Run health with real ranks under `spmd run -n 2` (2 ranks x 1 CPU device, the tiny MLP):
an error on one rank ends every rank at once and is shown; a stopped rank is named, with its
host, by the hang watchdog and the job exits HUNG; SIGTERM to `spmd run` ends even a stuck rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.checkpoint_worker import (
    REPO,
    _env,
    committed_by_all,
    kill_tagged,
    step_blobs,
    tagged_pids,
    train,
    train_cmd,
    wait_for,
)
from tests.helpers.env import run_spmd, side_by_side
from tests.helpers.fault_injection import fault_env

pytestmark = pytest.mark.slow

# no plots at a run's end (about 2 s of matplotlib each, looked at by nothing)
LONG = ("train.steps=100000", "checkpoint.every=10", "checkpoint.keep=2", "run.log_every=10",
        "run.plots=false")


def rank_pid(tag: str, rank: int) -> int:
    """The pid of rank `rank` of the tagged job (not its shim, not mpiexec)."""
    for pid in tagged_pids(tag):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[1:4] == [b"-m", b"spmd.cli", b"train"] and f"PMI_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} among the processes tagged {tag}")


def latest_local(run_dir: Path) -> int | None:
    listing = json.loads(run_spmd("ckpt", "ls", str(run_dir), "--json").stdout)
    return listing["latest"]["local"]


def start(run_dir: Path, tag: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(2, run_dir, *LONG, *overrides), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=_env(1, SPMD_TEST_TAG=tag))


@pytest.mark.parametrize("fault, failed, other", [
    ("prepare:0", "rank 0 on", 1),      # before training: rank 1 waits for the prepared data
    ("hook:1:3", "rank 1 on", 0),       # during training, in a hook of the user's
], ids=["prepare-on-rank-0", "user-hook-on-rank-1"])
def test_an_error_on_one_rank_ends_every_rank_at_once_and_is_shown(tmp_path, fault, failed,
                                                                   other):
    run_dir = tmp_path / "run"
    began = time.monotonic()
    proc = train(2, run_dir, "train.steps=20", devices=1, timeout=120,
                 **fault_env(raise_in=fault))
    seconds = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert seconds < 30, f"{seconds:.0f} s"
    message = f"{failed} {_host()} failed: RuntimeError: SPMD_TEST_RAISE: injected in"
    assert message in proc.stderr                           # shown in spmd run's output
    assert f"ending rank {other} on" in proc.stderr        # the other rank names it and ends
    for bad in ("Terminating process", "Barrier timed out", "DEADLINE_EXCEEDED", "EnforceNotMet"):
        assert bad not in proc.stderr + proc.stdout
    failed_rank = 1 - other
    own = (run_dir / "logs" / f"rank{failed_rank:05d}.log").read_text()
    assert message in own and "Traceback (most recent call last)" in own
    # Whoever is first names it: the other rank itself (its log), or, when spmd run ended that
    # rank before it noticed (a loaded machine), spmd run in its own output; on a slow machine
    # spmd run may end that rank even before it opened its log (before its config was read).
    peer_log = run_dir / "logs" / f"rank{other:05d}.log"
    peer = peer_log.read_text() if peer_log.exists() else ""
    named = f"rank {failed_rank} on {_host()} failed (RuntimeError); ending rank {other}"
    assert named in peer or named in proc.stderr, (peer[-2000:], proc.stderr[-3000:])


def test_a_stopped_rank_is_named_the_job_exits_hung_and_a_rerun_resumes_bit_identical(
        tmp_path):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(run_dir, tag, "launch.step_timeout_s=4")
    try:
        wait_for(lambda: committed_by_all(run_dir, 20), 120, "local step 20", proc)
        stopped_at = time.monotonic()
        rank1 = rank_pid(tag, 1)
        os.kill(rank1, signal.SIGSTOP)
        out, err = proc.communicate(timeout=4 + 60)
        seconds = time.monotonic() - stopped_at
        left = leftovers(tag)
    finally:
        kill_tagged(tag)
    assert proc.returncode == 76, err[-3000:]                  # ExitCode.HUNG
    assert seconds < 4 + 30, f"{seconds:.0f} s"
    # named with its host, though it posted nothing (its host was posted at bootstrap)
    assert "ranks that did not reach step" in err and f"rank 1 on {_host()}: no answer" in err
    assert f"killed rank 1 (pid {rank1}" in err
    hung = json.loads((run_dir / "HUNG").read_text())
    assert hung["stuck"] == {"1": "no answer (stopped, dead, or stuck outside Python)"}
    assert hung["hosts"]["1"] == _host()
    log0 = (run_dir / "logs" / "rank00000.log").read_text()
    assert "no training step completed for" in log0 and "Current thread" in log0  # stacks
    assert not left

    last = latest_local(run_dir)
    assert last is not None and last >= 20
    end = last + 10
    reference = tmp_path / "reference"
    # the rerun and an undisturbed run of as many steps, side by side (independent dirs)
    resumed, whole = side_by_side(
        lambda: train(2, run_dir, *LONG, f"train.steps={end}", devices=1),
        lambda: train(2, reference, *LONG, f"train.steps={end}", devices=1))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert step_blobs(run_dir, end) == step_blobs(reference, end)


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
KILL_WAIT_S = 4                  # launch.kill_wait_s of the stuck jobs (default 30)


@pytest.fixture(scope="module")
def stuck_jobs_signalled(tmp_path_factory) -> dict[str, tuple]:
    """One job per signal, run side by side (each waits out checkpoint.timeout_s +
    launch.kill_wait_s with a stopped rank, idle time the two share): name -> (returncode,
    seconds from the signal to the job's end, stderr, the job's processes still alive
    after it)."""
    procs, tags = {}, {}
    try:
        for name in SIGNALS:
            tags[name] = uuid.uuid4().hex
            run_dir = tmp_path_factory.mktemp(f"stuck_{name}") / "run"
            procs[name] = (run_dir, start(run_dir, tags[name], "launch.step_timeout_s=0",
                                          "checkpoint.timeout_s=2",
                                          f"launch.kill_wait_s={KILL_WAIT_S}"))
        for run_dir, proc in procs.values():
            wait_for(lambda d=run_dir: committed_by_all(d, 10), 120, "local step 10", proc)
        for tag in tags.values():
            os.kill(rank_pid(tag, 1), signal.SIGSTOP)
        time.sleep(0.5)

        def signal_and_wait(name: str) -> tuple:
            proc = procs[name][1]
            sent = time.monotonic()
            proc.send_signal(SIGNALS[name])
            out, err = proc.communicate(timeout=2 + KILL_WAIT_S + 30)
            seconds = time.monotonic() - sent
            return proc.returncode, seconds, err, leftovers(tags[name])

        ended = dict(zip(SIGNALS, side_by_side(
            *(lambda n=name: signal_and_wait(n) for name in SIGNALS)), strict=True))
    finally:
        for tag in tags.values():
            kill_tagged(tag)
    return ended


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_to_spmd_run_ends_a_stuck_rank_within_the_save_timeout_and_kill_wait(
        stuck_jobs_signalled, sig):
    """What a batch system (SIGTERM) or a closed terminal / Ctrl-C (SIGINT) sends: a stuck
    rank is given checkpoint.timeout_s + launch.kill_wait_s, not less, then killed."""
    returncode, seconds, err, left = stuck_jobs_signalled[sig.name]
    assert returncode == 128 + sig, err[-3000:]
    assert 2 + KILL_WAIT_S - 0.5 <= seconds < 2 + KILL_WAIT_S + 10, f"{seconds:.0f} s"
    assert (f"did not stop within {2 + KILL_WAIT_S} s of {sig.name} (checkpoint.timeout_s=2"
            f" + launch.kill_wait_s={KILL_WAIT_S})") in err
    assert not left


def leftovers(tag: str, within_s: float = 10) -> list[int]:
    """The tagged job's processes still alive `within_s` after the job's launcher ended."""
    deadline = time.time() + within_s
    while tagged_pids(tag) and time.time() < deadline:
        time.sleep(0.1)
    return tagged_pids(tag)


def _host() -> str:
    import socket

    return socket.gethostname()


def test_kill_9_of_mpiexec_is_named_by_spmd_run_and_no_rank_survives(tmp_path):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(run_dir, tag, "launch.step_timeout_s=0")
    try:
        wait_for(lambda: committed_by_all(run_dir, 10), 120, "local step 10", proc)
        (mpiexec,) = [pid for pid in tagged_pids(tag)
                      if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                      .endswith(b"mpiexec")]
        os.kill(mpiexec, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        left = leftovers(tag)
    finally:
        kill_tagged(tag)
    assert f"mpiexec (pid {mpiexec}) was killed by SIGKILL" in err, err[-3000:]
    assert "resume from the last committed checkpoint" in err
    assert proc.returncode == 128 + signal.SIGKILL
    assert not left
