"""Rank 0's data preparation never races a timeout (issue 34): under `spmd run -n 2`, the
other rank waits for it over the key-value store, with no deadline but
launch.prepare_timeout_s, and says what it waits for; past that bound the job fails at once,
naming the key.

The task (tests/helpers/slow_prepare_task.py) sleeps in rank 0's `prepare` for
SPMD_TEST_PREPARE_S seconds, logging progress lines as a data generator would. The two jobs
mostly sleep, so they run side by side.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.checkpoint_worker import events, train
from tests.helpers.env import side_by_side
from tests.helpers.slow_prepare_task import ENV

pytestmark = pytest.mark.slow

TASK = "task=tests.helpers.slow_prepare_task:SlowPrepareTask"


@dataclass(frozen=True)
class Job:
    run_dir: Path
    proc: subprocess.CompletedProcess
    seconds: float


def _job(run_dir: Path, *overrides: str, timeout: float, prepare_s: str) -> Job:
    began = time.monotonic()
    proc = train(2, run_dir, TASK, "train.steps=3", *overrides, devices=1, timeout=timeout,
                 **{ENV: prepare_s})
    return Job(run_dir, proc, time.monotonic() - began)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Job]:
    """40 s of preparation (past the 30 s that used to end the job, and past the second
    progress report at 35 s), and one past launch.prepare_timeout_s=4, side by side."""
    base = tmp_path_factory.mktemp("prepare")
    long, past = side_by_side(
        lambda: _job(base / "long", timeout=400, prepare_s="40"),
        lambda: _job(base / "past", "launch.prepare_timeout_s=4", timeout=120,
                     prepare_s="100"))
    return {"long": long, "past": past}


def test_long_preparation_on_rank_0_waits_and_trains(jobs):
    run_dir, proc = jobs["long"].run_dir, jobs["long"].proc
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "DEADLINE_EXCEEDED" not in out and "Gloo context initialization failed" not in out
    assert {e["step"] for e in events(run_dir, "finished")} == {3}
    waiting = (run_dir / "logs" / "rank00001.log").read_text()
    # what it waited for, how long, the bound, and rank 0's own latest progress line
    lines = re.findall(r"waiting for rank 0 to prepare the data \(Task\.prepare\): (\d+) s so "
                       r"far, limit launch\.prepare_timeout_s=7200; rank 0 last said \(\d+ s "
                       r"ago\): making the slow data: (\d+)/40", waiting)
    assert len(lines) >= 2, waiting[-3000:]
    assert int(lines[-1][0]) >= 30 and int(lines[-1][1]) > int(lines[0][1]), lines
    assert "(it began: making the slow data: 0/40)" in waiting  # what rank 0 is making
    waited = re.search(r"rank 0 finished preparing the data; waited ([\d.]+) s", waiting)
    assert waited is not None and float(waited.group(1)) >= 35, waiting[-3000:]
    # its own share of Task.prepare ran after rank 0's
    assert waiting.index("this rank's share runs after rank 0's") > waited.start()


def test_preparation_past_launch_prepare_timeout_s_fails_at_once_naming_it(jobs):
    proc, seconds = jobs["past"].proc, jobs["past"].seconds
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert seconds < 60, f"{seconds:.0f} s: the sleeping rank 0 was not ended with the job"
    message = (f"rank 1 on {socket.gethostname()}: rank 0 did not finish preparing the data "
               "(Task.prepare) within launch.prepare_timeout_s=4 s; rank 0 last said")
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Raise launch.prepare_timeout_s" in proc.stderr
