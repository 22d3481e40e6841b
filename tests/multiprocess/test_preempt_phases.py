"""SIGTERM during a checkpoint save, during the compilation of a resumed job, and after the
last step (issue 38), on real processes: `spmd run -n 2` of the tiny MLP, three jobs of one
run in turn, against an uninterrupted run side by side.

1. A save in flight (SPMD_CKPT_TEST_STALL holds every rank's local-tier save of step 10):
   the signal waits for it, the ranks agree on the next step, save it and exit 75.
2. The resumed job, signalled while it compiles (no compilation cache, so that it takes
   seconds): 75 at once, nothing saved or dropped (its state is committed already).
3. The next resume trains to the end; SIGTERM while the last step's save is in flight: the
   run has finished, status 0 (docs/run_health.md), and its last step is bit for bit the
   uninterrupted run's: the stops at a save and in a resumed start-up change nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from spmd.errors import ExitCode
from tests.helpers.checkpoint_worker import (
    REPO,
    _env,
    committed_by_all,
    events,
    step_blobs,
    train,
    train_cmd,
)
from tests.helpers.env import clean_env, side_by_side
from tests.helpers.fault_injection import fault_env
from tests.multiprocess.test_launch_run import need_mpiexec
from tests.multiprocess.test_preempt_anytime import leftovers, signal_when, wait_until

pytestmark = pytest.mark.slow

END = 30
RUN = (f"train.steps={END}", "checkpoint.every=10", "run.log_every=10", "checkpoint.keep=3")
STALL_S = 4


def start(run_dir: Path, tmp: Path, name: str, env: dict[str, str]
          ) -> tuple[subprocess.Popen, Path]:
    """`spmd run -n 2` in the background; its output in a file, its temporaries in `tmp`."""
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / f"{name}.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(train_cmd(2, run_dir, *RUN), stdout=out,
                                stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                env={**env, "TMPDIR": str(tmp / name)})
    (tmp / name).mkdir(exist_ok=True)
    return proc, log


def saving(run_dir: Path, step: int) -> bool:
    """Whether every rank's local-tier save of `step` is in flight (held by the stall)."""
    return all((run_dir / "local" / str(step) / f"rank{r:05d}.tmp").is_dir() for r in (0, 1))


def signalled_at_a_save(run_dir: Path, tmp: Path, name: str, step: int) -> dict:
    proc, log = start(run_dir, tmp, name, _env(1, **fault_env(stall=f"{step}:{STALL_S}")))
    code, seconds = signal_when(
        proc, lambda: wait_until(lambda: saving(run_dir, step), 180,
                                 f"the save of step {step} in flight", proc, log),
        lambda: proc.send_signal(signal.SIGTERM), timeout=120)
    return dict(code=code, seconds=seconds, out=log.read_text())


def signalled_while_compiling(run_dir: Path, tmp: Path, restored: int) -> dict:
    saved = sorted({e["step"] for e in events(run_dir, "saved")})
    env = clean_env(compile_cache=False, JAX_NUM_CPU_DEVICES="1", SPMD_PROCESSES_PER_NODE="1")
    proc, log = start(run_dir, tmp, "compile", env)
    code, seconds = signal_when(   # the restore's line: the compilation follows at once
        proc, lambda: wait_until(lambda: f"restore step {restored}" in log.read_text(), 180,
                                 "the restore", proc, log),
        lambda: proc.send_signal(signal.SIGTERM))
    return dict(code=code, seconds=seconds, out=log.read_text(), saved=saved,
                saved_after=sorted({e["step"] for e in events(run_dir, "saved")}))


def three_jobs(run_dir: Path, tmp: Path) -> dict:
    at_save = signalled_at_a_save(run_dir, tmp, "save", 10)
    stops = [e["step"] for e in events(run_dir, "preempted")]
    out = dict(at_save=at_save, stops=stops)
    if at_save["code"] == ExitCode.PREEMPTED and len(set(stops)) == 1:
        out["compiling"] = signalled_while_compiling(run_dir, tmp, stops[0])
        out["last"] = signalled_at_a_save(run_dir, tmp, "last", END)
    return out


def test_sigterm_at_a_save_while_compiling_and_after_the_last_step(tmp_path):
    need_mpiexec()
    run_dir, reference, tmp = tmp_path / "run", tmp_path / "reference", tmp_path / "tmp"
    jobs, uninterrupted = side_by_side(lambda: three_jobs(run_dir, tmp),
                                       lambda: train(2, reference, *RUN, devices=1))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]

    at_save = jobs["at_save"]
    assert at_save["code"] == ExitCode.PREEMPTED, at_save["out"][-6000:]
    # the stall's rest, one step and its save: not checkpoint.timeout_s (600 s)
    assert at_save["seconds"] < STALL_S + 30, f"{at_save['seconds']:.0f} s"
    assert len(jobs["stops"]) == 2 and len(set(jobs["stops"])) == 1, jobs["stops"]
    stop = jobs["stops"][0]
    assert stop > 10 and committed_by_all(run_dir, 10) and committed_by_all(run_dir, stop)

    compiling = jobs["compiling"]
    out = compiling["out"]
    assert compiling["code"] == ExitCode.PREEMPTED, out[-6000:]
    assert compiling["seconds"] < 15, f"{compiling['seconds']:.1f} s\n{out[-4000:]}"
    assert "during the compilation, before the first training step" in out, out[-4000:]
    assert compiling["saved_after"] == compiling["saved"]   # nothing new to save

    last = jobs["last"]
    assert last["code"] == ExitCode.OK, last["out"][-6000:]
    assert [e["step"] for e in events(run_dir, "restored")] == [stop] * 4  # jobs 2 and 3
    assert {e["step"] for e in events(run_dir, "finished")} == {END}
    assert step_blobs(run_dir, END) and step_blobs(run_dir, END) == step_blobs(reference, END)
    for name in ("save", "compile", "last"):
        assert leftovers(tmp / name) == [], (name, os.listdir(tmp / name))
