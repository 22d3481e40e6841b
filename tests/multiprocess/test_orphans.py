"""One writer per run directory and ranks that never outlive their launcher, on real processes.

`spmd run -n 2` (2 ranks x 4 CPU devices) of the tiny MLP; a save held in flight by the
SPMD_CKPT_TEST_STALL fault (tests/helpers/fault_injection.py) keeps a run alive while the
test interferes with it. Every resumed run is compared bit for bit with one uninterrupted
reference run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from spmd.errors import ExitCode
from tests.helpers.checkpoint_worker import (
    REPO,
    _env,
    events,
    tagged_pids,
    train,
    train_cmd,
    wait_for,
)
from tests.helpers.env import run_spmd
from tests.helpers.fault_injection import fault_env
from tests.multiprocess.test_launch_run import need_mpiexec, rank_pids
from tests.multiprocess.test_resume import CKPT, final_blobs, last_loss

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    need_mpiexec()
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = train(2, run_dir, *CKPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return run_dir


def start(run_dir: Path, tag: str, log: Path, *overrides: str, stall: str,
          **env: str) -> subprocess.Popen:
    """`spmd run -n 2` in the background, its output in `log`, its processes tagged."""
    with open(log, "w") as out:
        return subprocess.Popen(train_cmd(2, run_dir, *CKPT, *overrides), stdout=out,
                                stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                env=_env(4, SPMD_TEST_TAG=tag, **fault_env(stall=stall), **env))


def in_flight(run_dir: Path, step: int) -> bool:
    return all((run_dir / "local" / str(step) / f"rank{r:05d}.tmp" / "index.json").exists()
               for r in (0, 1))


def end_tagged(tag: str) -> None:
    for pid in tagged_pids(tag):  # only processes this test started carry its tag
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_second_run_on_a_leased_dir_is_refused_and_the_first_finishes_intact(reference,
                                                                             tmp_path):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    first = start(run_dir, tag, tmp_path / "first.log", stall="6:20")
    try:
        wait_for(lambda: in_flight(run_dir, 6), 240, "the save of step 6 to be in flight", first)
        holder = rank_pids(run_dir)[0]
        t0 = time.monotonic()
        second = train(2, run_dir, *CKPT, timeout=60)
        assert time.monotonic() - t0 < 20
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [x for x in second.stderr.splitlines() if "error" in x.lower()]
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
        assert "is in use by another run" in errors[0]
        assert f"held by pid {holder} on {os.uname().nodename}" in errors[0]
        assert "since 20" in errors[0] and "no job id" in errors[0]
        # The ranks' own check (what srun-started ranks meet): every rank exits, one line.
        from tests.helpers.checkpoint_worker import _mpi

        direct = subprocess.run([*_mpi(2), *train_cmd(1, run_dir, *CKPT)],
                                capture_output=True, text=True, env=_env(4), timeout=120,
                                cwd=REPO)
        assert direct.returncode == 2, direct.stdout[-2000:] + direct.stderr[-3000:]
        assert direct.stderr.count("is in use by another run") == 1, direct.stderr
        assert first.wait(timeout=240) == 0, (tmp_path / "first.log").read_text()[-6000:]
    finally:
        end_tagged(tag)
        first.wait(timeout=60)
    assert [e["event"] for e in events(run_dir) if e["event"].startswith("lease")] == [
        "lease_acquired"]
    assert len(events(run_dir, "started")) == 2  # the refused runs wrote nothing
    assert final_blobs(run_dir, 12) == final_blobs(reference, 12)
    assert last_loss(run_dir) == last_loss(reference)
    assert not (run_dir / "lease.json").exists()


def test_kill_9_of_spmd_run_ends_every_rank_and_the_next_run_takes_over(reference, tmp_path):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(run_dir, tag, tmp_path / "killed.log", stall="9:120")
    try:
        wait_for(lambda: in_flight(run_dir, 9), 240, "the save of step 9 to be in flight", proc)
        ranks = rank_pids(run_dir)
        assert set(ranks) == {0, 1}
        proc.kill()  # SIGKILL to `spmd run` only
        t0 = time.monotonic()
        while tagged_pids(tag) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert not tagged_pids(tag), "ranks, mpiexec or its proxy outlived `spmd run`"
    finally:
        end_tagged(tag)
        proc.wait(timeout=60)
    # (The ranks' own last words go through mpiexec's pipes, which die with it.)
    listing = run_spmd("ckpt", "ls", str(run_dir), timeout=120)
    assert f"held by pid {ranks[0]} on" in listing.stdout and "stale: " in listing.stdout

    resumed = train(2, run_dir, *CKPT)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    (takeover,) = events(run_dir, "lease_taken_over")
    assert takeover["previous"]["pid"] == ranks[0]
    assert f"pid {ranks[0]} is no longer running" in takeover["reason"]
    assert "took over the lease" in resumed.stderr
    assert {(e["rank"], e["step"]) for e in events(run_dir, "restored")} == {(0, 6), (1, 6)}
    assert final_blobs(run_dir, 12) == final_blobs(reference, 12)
    assert last_loss(run_dir) == last_loss(reference)


def test_killing_one_rank_ends_the_other_naming_it(reference, tmp_path):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    heartbeat = 10
    tmp = tmp_path / "tmp"  # the job's $TMPDIR: `spmd run` must leave nothing there
    tmp.mkdir()
    proc = start(run_dir, tag, tmp_path / "rank.log", f"launch.heartbeat_timeout_s={heartbeat}",
                 stall="9:120", TMPDIR=str(tmp))
    try:
        wait_for(lambda: in_flight(run_dir, 9), 240, "the save of step 9 to be in flight", proc)
        ranks = rank_pids(run_dir)
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(timeout=heartbeat + 30)
        assert time.monotonic() - t0 < heartbeat + 15
    finally:
        end_tagged(tag)
        proc.wait(timeout=60)
    log = (tmp_path / "rank.log").read_text()
    assert code != 0, log
    assert f"rank 0 on {os.uname().nodename}: lost rank 1 (pid {ranks[1]}" in log, log
    assert "lost rank 1" in (run_dir / "logs" / "rank00000.log").read_text()  # and in its log
    # Hydra's proxy no longer SIGKILLs the survivor (its shim exits with a status): it ends by
    # its own watchdog (69), and `spmd run` repeats its error at the end. Hydra's mpiexec
    # exits with the bitwise OR of the statuses it collected (137 | 69 = 205); `spmd run`
    # decides from the ranks' own statuses: the table's 69 (issue 38)
    assert code == ExitCode.ORPHANED, code
    # its temporary folder (the ranks' statuses, the survivor's exit marks) is gone with it
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("spmd-")], list(tmp.iterdir())
    assert "spmd run: the ranks' errors" in log, log
    summary = log[log.index("spmd run: the ranks' errors"):]
    # the rank log's format (spmd.rundir.metrics.setup_logging):
    # "<time> rank R <host> LEVEL name: ..."
    assert (f"rank 0 {socket.gethostname()} ERROR spmd.launch: rank 0 on "
            f"{os.uname().nodename}: lost rank 1") in summary, summary
    assert not tagged_pids(tag)
    assert not list((run_dir / "local").glob("9/rank*/COMMITTED"))

    resumed = train(2, run_dir, *CKPT)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert len(events(run_dir, "lease_taken_over")) == 1
    assert {(e["rank"], e["step"]) for e in events(run_dir, "restored")} == {(0, 6), (1, 6)}
    assert final_blobs(run_dir, 12) == final_blobs(reference, 12)
    assert last_loss(run_dir) == last_loss(reference)


def test_rank_watchdog_alone_ends_a_rank_whose_launcher_was_killed(tmp_path):
    """Without mpiexec in between: a process started with SPMD_LAUNCHER_PID of a killed parent."""
    import sys

    child = ("import sys, time; from spmd.launch.watchdog import watch_launcher; "
             "import os; watch_launcher(os.environ, 'rank 0 on test'); "
             "print('watching', flush=True); time.sleep(120)")
    parent = ("import subprocess, sys; from spmd.launch.watchdog import launcher_environ; "
              "import os; env = dict(os.environ, **launcher_environ()); "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env=env, "
              "stdout=sys.stdout, stderr=sys.stderr); print(p.pid, flush=True); p.wait()")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(1))
    rank_pid = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "watching"
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    while Path(f"/proc/{rank_pid}").exists() and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not Path(f"/proc/{rank_pid}").exists(), "the rank outlived its launcher"
    err = proc.stderr.read()
    assert f"rank 0 on test: its launcher (`spmd run`, pid {proc.pid}) is gone" in err
    assert "status 69" in err
