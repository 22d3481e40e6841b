"""The rank shim of `spmd run`: exit statuses instead of deaths by signal, signals passed on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from spmd.launch import rank_shim

SHIM = Path(rank_shim.__file__)


def shim(*code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SHIM), sys.executable, "-c", "\n".join(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_exit_status_of_a_death_by_signal_is_128_plus_the_signal():
    assert rank_shim.exit_status(-9) == 137 and rank_shim.exit_status(3) == 3


def test_a_rank_killed_by_sigkill_makes_the_shim_exit_137_not_die_by_a_signal():
    proc = shim("import os, signal", "os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.wait(timeout=60) == 137  # a status: Hydra's proxy kills no other rank for it


def test_the_rank_exit_code_passes_through():
    assert shim("import sys", "sys.exit(75)").wait(timeout=60) == 75


def test_signals_reach_the_rank_and_a_late_one_is_ignored():
    proc = shim("import signal, sys, time",
                "signal.signal(signal.SIGUSR1, lambda *a: (print('usr1', flush=True), "
                "sys.exit(75)))",
                "print('ready', flush=True)",
                "time.sleep(600)")
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)  # to the shim, as Hydra's proxy sends it
    try:    # a bound against a lost signal (the rank sleeps far longer), generous under load
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert out.strip() == "usr1"


def test_a_signal_sent_just_as_the_shim_starts_to_wait_is_never_lost():
    # the rank is ready before its shim may have reached its wait: a signal sent then once
    # waited unseen in a handler until the rank ended by itself
    for attempt in range(20):
        proc = shim("import signal, sys, time",
                    "signal.signal(signal.SIGUSR2, lambda *a: sys.exit(76))",
                    "print('ready', flush=True)",
                    "time.sleep(60)")
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR2)
        try:
            try:
                status = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                # what a lost signal would look like: both still alive, SIGUSR2 pending or not
                raise AssertionError(f"attempt {attempt}: no exit 20 s after SIGUSR2; "
                                     f"{process_states(proc.pid)}") from None
            assert status == 76, f"attempt {attempt}: {proc.stderr.read()}"
        finally:
            proc.kill()
            proc.communicate()


def process_states(pid: int) -> str:
    """The shim's and its children's state and signal masks, from /proc, for a failure."""
    fields = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt", "voluntary_ctxt_switches")
    lines = []
    children = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        pass
    for one in [str(pid), *children]:
        try:
            status = Path(f"/proc/{one}/status").read_text().splitlines()
            wchan = Path(f"/proc/{one}/wchan").read_text()
        except OSError as e:
            lines.append(f"pid {one}: {e}")
            continue
        kept = [line.replace("\t", " ") for line in status if line.split(":")[0] in fields]
        lines.append(f"pid {one} (wchan {wchan}): " + ", ".join(kept))
    return "; ".join(lines) + f"; load {Path('/proc/loadavg').read_text().strip()}"


def test_a_signal_after_the_rank_ended_leaves_the_exit_status_as_it_was():
    proc = shim("import sys, time", "print('ready', flush=True)", "sys.exit(3)")
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # the rank has ended; the shim may still be on its way out
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)  # as Hydra's proxy sends when PMI sockets close
    assert proc.wait(timeout=60) == 3


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] in ("Z", "X")  # a zombie
    except OSError:
        return True


def test_the_rank_dies_with_its_shim():
    proc = shim("import os, time", "print(os.getpid(), flush=True)", "time.sleep(60)")
    rank = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while not gone(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(rank), f"rank pid {rank} outlived its shim"


def test_without_a_command_it_says_how_to_call_it():
    out = subprocess.run([sys.executable, str(SHIM)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
