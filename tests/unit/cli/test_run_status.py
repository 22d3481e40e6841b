"""`spmd run`'s status from the ranks' own statuses, and a signal caught before the run's own
handlers exist (issue 38). Fast: no ranks, no JAX; real signals to this process where a
handler is involved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.cli import early_signal
from spmd.cli.job_status import job_status, rank_statuses
from spmd.errors import ExitCode
from spmd.launch import rank_shim
from spmd.launch.preemption import PreemptionWatcher


@pytest.mark.parametrize("statuses, signalled, expected", [
    ([0, 0], None, ExitCode.OK),
    ([137, 69], None, ExitCode.ORPHANED),          # Hydra says 205
    ([69, 69], None, ExitCode.ORPHANED),
    ([137, 137], None, ExitCode.ORPHANED),          # both lost
    ([75, 75], signal.SIGTERM, ExitCode.PREEMPTED),
    ([75, 143], signal.SIGTERM, ExitCode.PREEMPTED),  # one died of it while starting
    ([143, 143], signal.SIGTERM, ExitCode.PREEMPTED),
    ([75, 0], signal.SIGTERM, ExitCode.PREEMPTED),
    ([130, 130], signal.SIGINT, ExitCode.INTERRUPTED),  # Ctrl-C stays Ctrl-C
    ([2, 69], None, ExitCode.USER_ERROR),            # the cause, not its consequence
    ([76, 69], None, ExitCode.HUNG),
    ([143, 143], None, ExitCode.ORPHANED),           # a signal spmd run did not forward
    ([75], None, None),                              # a rank left no status: undecided
])
def test_job_status_is_the_tables(statuses, signalled, expected):
    assert job_status(statuses, 2, signalled) == expected


def test_the_shim_leaves_the_ranks_status_where_spmd_run_reads_it(tmp_path):
    env = {**os.environ, rank_shim.RUN_TMPDIR_VAR: str(tmp_path)}
    for code in (0, 69):
        proc = subprocess.run([sys.executable, rank_shim.__file__, sys.executable, "-c",
                               f"import sys; sys.exit({code})"], env=env, timeout=60)
        assert proc.returncode == code
    proc = subprocess.run([sys.executable, rank_shim.__file__, sys.executable, "-c",
                           "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                          env=env, timeout=60)
    assert proc.returncode == 137
    assert sorted(rank_statuses(tmp_path)) == [0, 69, 137]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("argv, caught", [
    (["-m", "run", "-n", "2", "c.yaml"], True),
    (["/venv/bin/spmd", "train", "c.yaml"], True),
    (["/venv/bin/spmd", "--debug", "train", "c.yaml"], True),
    (["/venv/bin/spmd", "report", "runs/x"], False),
    (["/venv/bin/pytest", "tests/unit"], False),
])
def test_early_signal_is_caught_only_by_run_and_train(argv, caught):
    before = {s: signal.getsignal(s) for s in early_signal.SIGNALS}
    try:
        assert early_signal.catch(argv) is caught
        assert (signal.getsignal(signal.SIGTERM) is early_signal.HANDLER) is caught
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_the_watcher_takes_over_a_signal_caught_before_it(tmp_path: Path):
    """SIGTERM caught by the CLI's early handler is the watcher's once it is installed."""
    before = {s: signal.getsignal(s) for s in early_signal.SIGNALS}
    handler = early_signal.EarlyHandler()
    watcher = None
    try:
        signal.signal(signal.SIGTERM, handler)
        os.kill(os.getpid(), signal.SIGTERM)   # recorded, not fatal
        assert handler.received == signal.SIGTERM
        watcher = PreemptionWatcher.install()
        assert watcher.signum == signal.SIGTERM and watcher.event.is_set()
        assert PreemptionWatcher.install() is watcher  # one per process, with what it saw
        watcher.reset()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.signum == signal.SIGUSR1
    finally:
        if watcher is not None:
            watcher.uninstall()
        for s, h in before.items():
            signal.signal(s, h)
    assert PreemptionWatcher.current() is None
