"""A preemption signal is honoured at every moment of a job's start-up (issue 38), on real
processes: `spmd run -n 2` of the tiny MLP whose rank 0 prepares its data for 15 s
(tests/helpers/slow_prepare_task.py).

- SIGTERM to `spmd run` while rank 0 is inside `Task.prepare`: every rank ends at once with
  75 (there is nothing new to save before the first step), nothing is checkpointed, and a
  rerun trains to the end. Before issue 38, JAX's own preemption notifier took the signal
  and the job trained to the end with status 0.
- SIGTERM to `spmd run` half a second after it starts: 75 with a line, not a silent 143.
  (Half a second, or as soon as its Python catches SIGTERM if that is later on a loaded
  machine: before its first instruction no program can act on a signal.)
- SIGTERM to `spmd run` just after it started the ranks (they are importing, not yet
  watching for preemption: spmd.cli.early_signal keeps the signal for them): 75.
- SIGUSR1 to rank 1 alone while rank 0 prepares: rank 0, which never saw a signal, ends
  too (no rank waits for a collective that will not come), with 75.
- Then, on the same run (trained to step 3 by the rerun), SIGTERM during a restore (rank
  0's listing of the persistent tier made slow by SPMD_CKPT_TEST_SLOW_LISTING): 75 at once,
  nothing saved or dropped.

The jobs run side by side, each with its own $TMPDIR: `spmd run` leaves no temporary folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spmd.errors import ExitCode
from tests.helpers.checkpoint_worker import REPO, _env, events, train, train_cmd
from tests.helpers.env import side_by_side
from tests.helpers.fault_injection import fault_env
from tests.helpers.slow_prepare_task import ENV
from tests.multiprocess.test_launch_run import need_mpiexec, rank_pids

pytestmark = pytest.mark.slow

TASK = "task=tests.helpers.slow_prepare_task:SlowPrepareTask"
STEPS = "train.steps=3"


def start(run_dir: Path, tmp: Path, prepare_s: float, *overrides: str,
          **env: str) -> tuple[subprocess.Popen, Path]:
    """`spmd run -n 2` in the background; its output in a file, its temporaries in `tmp`."""
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp.parent / f"{tmp.name}.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(train_cmd(2, run_dir, TASK, *(overrides or (STEPS,))),
                                stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                env=_env(1, TMPDIR=str(tmp), **{ENV: str(prepare_s)}, **env))
    return proc, log


def wait_until(predicate, timeout_s: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"ended ({proc.returncode}) before {what}:\n" + \
            log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s:\n" + \
            log.read_text()[-4000:]
        time.sleep(0.1)


def preparing(run_dir: Path) -> bool:
    path = run_dir / "logs" / "rank00000.log"
    return path.exists() and "making the slow data: 2/15" in path.read_text()


def leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("spmd-"))


def sigterm_during_prepare(tmp_path: Path) -> dict:
    run_dir, tmp = tmp_path / "prepare", tmp_path / "tmp-prepare"
    proc, log = start(run_dir, tmp, 15)
    code, seconds = signal_when(
        proc, lambda: wait_until(lambda: preparing(run_dir), 120, "rank 0 preparing (2 s in)",
                                 proc, log),
        lambda: proc.send_signal(signal.SIGTERM))
    out, stopped = log.read_text(), [e["event"] for e in events(run_dir)]
    committed = list((run_dir / "local").glob("*/rank*/COMMITTED"))
    rerun = train(2, run_dir, TASK, STEPS, devices=1, timeout=300, TMPDIR=str(tmp))
    restore = sigterm_during_restore(run_dir, tmp) if rerun.returncode == 0 else None
    return dict(code=code, seconds=seconds, out=out, run_dir=run_dir, rerun=rerun, tmp=tmp,
                stopped=stopped, committed=committed, restore=restore)


def signal_when(proc: subprocess.Popen, ready: Callable[[], None], send: Callable[[], None],
                timeout: float = 60) -> tuple[int, float]:
    """`ready()`, then `send()` a signal and wait for `proc`: its status and the seconds from
    the signal to its end. `proc` is killed if it still runs after that (or a failure)."""
    try:
        ready()
        sent = time.monotonic()
        send()
        code = proc.wait(timeout=timeout)
        return code, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def catching(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines()
                 if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def sigterm_at_half_a_second(tmp_path: Path) -> dict:
    run_dir, tmp = tmp_path / "early", tmp_path / "tmp-early"
    proc, log = start(run_dir, tmp, 0)
    def ready() -> None:
        time.sleep(0.5)
        wait_until(lambda: catching(proc.pid, signal.SIGTERM), 30, "a SIGTERM handler", proc,
                   log)

    code, seconds = signal_when(proc, ready, lambda: proc.send_signal(signal.SIGTERM))
    return dict(code=code, seconds=seconds, out=log.read_text(), tmp=tmp)


def sigterm_as_the_ranks_start(tmp_path: Path) -> dict:
    run_dir, tmp = tmp_path / "starting", tmp_path / "tmp-starting"
    proc, log = start(run_dir, tmp, 0)
    def ready() -> None:
        wait_until(lambda: "spmd run: 2 ranks" in log.read_text(), 60, "the ranks' start",
                   proc, log)
        time.sleep(0.3)

    code, _ = signal_when(proc, ready, lambda: proc.send_signal(signal.SIGTERM), timeout=90)
    return dict(code=code, out=log.read_text(), tmp=tmp,
                stopped=[e["event"] for e in events(run_dir)])


def sigusr1_to_one_rank_during_prepare(tmp_path: Path) -> dict:
    run_dir, tmp = tmp_path / "one", tmp_path / "tmp-one"
    proc, log = start(run_dir, tmp, 15)
    code, seconds = signal_when(
        proc, lambda: wait_until(lambda: preparing(run_dir), 120, "rank 0 preparing (2 s in)",
                                 proc, log),
        lambda: os.kill(rank_pids(run_dir)[1], signal.SIGUSR1))
    return dict(code=code, seconds=seconds, out=log.read_text(), tmp=tmp)


def sigterm_during_restore(run_dir: Path, tmp: Path) -> dict:
    """SIGTERM while the run in `run_dir` (which has a checkpoint) is restoring."""
    saved = sorted({e["step"] for e in events(run_dir, "saved")})
    proc, log = start(run_dir, tmp / "restore", 0, "train.steps=6",
                      **fault_env(slow_listing="0:30"))
    def ready() -> None:  # the model is built; rank 0 now lists the persistent tier for 30 s
        wait_until(lambda: log.read_text().count("shardings and jitted steps") >= 1, 120,
                   "the model built", proc, log)
        time.sleep(1)

    code, seconds = signal_when(proc, ready, lambda: proc.send_signal(signal.SIGTERM))
    saved_after = sorted({e["step"] for e in events(run_dir, "saved")})
    return dict(code=code, seconds=seconds, out=log.read_text(), saved=saved,
                saved_after=saved_after, tmp=tmp / "restore")


def test_sigterm_during_prepare_or_at_the_first_moment_exits_75_and_the_rerun_trains(
        tmp_path):
    need_mpiexec()
    during, early, starting, one = side_by_side(
        lambda: sigterm_during_prepare(tmp_path), lambda: sigterm_at_half_a_second(tmp_path),
        lambda: sigterm_as_the_ranks_start(tmp_path),
        lambda: sigusr1_to_one_rank_during_prepare(tmp_path))

    out = during["out"]
    assert during["code"] == ExitCode.PREEMPTED, out[-6000:]
    # at once: not after the 13 s of preparation left, nor after training
    assert during["seconds"] < 10, f"{during['seconds']:.1f} s\n{out[-4000:]}"
    assert "SIGTERM received by rank" in out and "Task.prepare" in out, out[-4000:]
    assert "SIGTERM caught" not in out  # JAX's notifier no longer takes it
    assert "started" in during["stopped"], during["stopped"]
    assert not {"compiled", "finished"} & set(during["stopped"]), during["stopped"]
    assert during["stopped"].count("preempted") == 2, during["stopped"]  # for spmd report
    assert during["committed"] == []
    rerun = during["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-6000:]
    assert {e["step"] for e in events(during["run_dir"], "finished")} == {3}

    assert early["code"] == ExitCode.PREEMPTED, early["out"][-6000:]
    assert early["seconds"] < 20, f"{early['seconds']:.1f} s\n{early['out'][-4000:]}"
    assert "SIGTERM received" in early["out"], early["out"][-4000:]

    assert starting["code"] == ExitCode.PREEMPTED, starting["out"][-6000:]
    assert "finished" not in starting["stopped"], starting["out"][-4000:]
    # a word whichever way: the ranks stopped for it (during bootstrap, or after it, all
    # together), or died of it before their Python could act
    assert ("SIGTERM received" in starting["out"]
            or "ended by SIGTERM while starting" in starting["out"]), starting["out"][-4000:]

    assert one["code"] == ExitCode.PREEMPTED, one["out"][-6000:]
    assert one["seconds"] < 10, f"{one['seconds']:.1f} s\n{one['out'][-4000:]}"
    assert "SIGUSR1 received by rank 1" in one["out"], one["out"][-4000:]
    assert "ending rank 0" in one["out"], one["out"][-4000:]

    restore = during["restore"]
    out = restore["out"]
    assert restore["code"] == ExitCode.PREEMPTED, out[-6000:]
    assert restore["seconds"] < 10, f"{restore['seconds']:.1f} s\n{out[-4000:]}"
    assert "during the restore, before the first training step" in out, out[-4000:]
    assert restore["saved"] and restore["saved_after"] == restore["saved"]  # nothing new

    for tmp in (during["tmp"], early["tmp"], starting["tmp"], one["tmp"], restore["tmp"]):
        assert leftovers(tmp) == [], (tmp, os.listdir(tmp))
