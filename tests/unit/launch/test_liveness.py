"""Liveness beats (spmd.launch.liveness): real rank processes beat over UDP to a listener,
say bye when they end on their own, and fall silent, beat child and all, when killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from spmd.launch import liveness

RANK = """
import os, sys, time
from spmd.launch import liveness
liveness.start_from_env()
if os.fork() == 0:          # a worker forked from the rank ends, atexit handlers and all
    sys.exit(0)
os.wait()
print("up", flush=True)
time.sleep(float(sys.argv[1]))
"""


def start_rank(listener: liveness.Listener, rank: int, seconds: float,
               attempt: int = 0) -> subprocess.Popen:
    env = {**os.environ, liveness.ADDR_VAR: f"127.0.0.1:{listener.port}",
           liveness.ATTEMPT_VAR: str(attempt), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4"}
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(seconds)], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    return proc


def drain_for(listener: liveness.Listener, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        listener.drain()
        time.sleep(0.05)


def test_a_rank_beats_with_its_rank_host_and_pid_until_it_says_bye():
    listener = liveness.Listener()
    listener.new_try(1)
    try:
        stale = start_rank(listener, 2, 5.0, attempt=0)   # a rank of the try before
        proc = start_rank(listener, 3, 1.5, attempt=1)
        drain_for(listener, 1.0)
        beat = listener.beats[(socket.gethostname(), proc.pid)]
        # still beating, though a process forked from it ran the bye at its exit
        assert (beat.rank, beat.host, beat.bye) == (3, socket.gethostname(), False)
        assert time.monotonic() - beat.at < 0.6
        assert (socket.gethostname(), stale.pid) not in listener.beats  # other try: dropped
        assert proc.wait(10) == 0
        drain_for(listener, 0.3)
        assert listener.beats[(socket.gethostname(), proc.pid)].bye
        assert listener.silent_hosts(0.0) == {}   # ended on its own: never silent
    finally:
        stale.kill()
        stale.wait()
        listener.close()


def test_a_killed_rank_falls_silent_and_its_host_is_named_while_another_host_beats():
    listener = liveness.Listener()
    listener.new_try(0)
    other = liveness.Beacon(("127.0.0.1", listener.port), 1, 0, beat_s=0.2)
    other.message["host"] = "n2"            # a rank on another node, beating on
    other.start()
    try:
        proc = start_rank(listener, 0, 60.0)
        drain_for(listener, 0.8)
        here = socket.gethostname()
        assert set(listener.silent_hosts(2.0)) == set()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.monotonic()
        drain_for(listener, 2.5)
        # its beat child died with it: no beat came after the kill (a beat in flight aside)
        assert listener.beats[(here, proc.pid)].at < killed_at + 0.2
        silent = listener.silent_hosts(2.0)
        assert set(silent) == {here} and silent[here] >= 2.0, silent
        assert listener.ranks_on(silent) == [0]
        # a rank the launcher reported ended is not due; with no host left beating, no
        # host is named (the supervisor may be the one that stalled)
        assert listener.silent_hosts(2.0, ended_ranks=[0]) == {}
        other.bye()
        drain_for(listener, 0.3)
        assert listener.silent_hosts(2.0) == {}
        # unless the launcher saw every other rank end and waits only for this host
        assert set(listener.silent_hosts(2.0, left=[here])) == {here}
        assert listener.silent_hosts(2.0, left=["n2"]) == {}
    finally:
        other.bye()
        listener.close()


def test_no_address_no_beacon_and_a_bad_address_is_ignored():
    assert liveness.start_from_env({}) is None
    assert liveness.start_from_env({liveness.ADDR_VAR: "no-such-host.invalid:x"}) is None
    assert liveness.launcher_rank({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}) == (5, 8)
    assert liveness.launcher_rank({}) is None
    # a large job beats less often: the supervisor takes at most MAX_RATE datagrams a second
    assert liveness.beat_interval(8) == liveness.BEAT_S
    assert liveness.beat_interval(40_000) * liveness.MAX_RATE == 40_000
    assert liveness.timeout_for(2.0, 8) == 2.0 and liveness.timeout_for(2.0, 40_000) == 16.0
