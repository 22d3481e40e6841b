"""Liveness beats from the ranks to the job script's recovery supervisor: a lost node is seen
in about two seconds, not when srun or the scheduler gives up on it.

The supervisor (spmd.launch.supervisor) listens on a UDP port of its own host (`Listener`)
and gives each try that address in SPMD_BEAT_ADDR (`host:port`), with the try's number in
SPMD_RECOVERY_ATTEMPT. A rank process started with it (`start_from_env`, first thing in
`spmd.cli`) sends one datagram every BEAT_S from a small child process (`Beacon`): its rank
as the launcher numbers it, its host, its pid and the try. A rank that ends on its own says
so (`say_bye`: at exit, and before each deliberate os._exit), so a finished rank is never
taken for a lost one.

`Listener.silent_hosts` names the hosts that beat in this try and from none of whose
unfinished ranks a beat came for `timeout_s`, while another host's ranks still beat (the
supervisor itself is not the one that stalled). A slow rank still beats (its beats come from
another process): a straggler is named by the ranks' own checks, never removed here.

Why UDP datagrams: nothing to connect or reconnect, and a beat costs nothing measurable; the
ranks' records in events.jsonl come at steps and saves, seconds apart, through a shared file
system. A lost datagram is one beat of four in a timeout of 2 s. Invariants: a beacon never
raises into the rank (every send is best effort), and the rank never waits for it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ADDR_VAR = "SPMD_BEAT_ADDR"          # host:port of the supervisor's listener, per try
ATTEMPT_VAR = "SPMD_RECOVERY_ATTEMPT"  # the try the rank belongs to (set by the supervisor)
BEAT_S = 0.5                          # between two beats of a rank (a small job)
TIMEOUT_S = 2.0                       # launch.node_timeout_s's default
MAX_RATE = 10_000                     # datagrams a second the supervisor takes at most


def beat_interval(ranks: int) -> float:
    """Seconds between two beats of a rank in a job of `ranks`: BEAT_S, longer past
    MAX_RATE / 2 ranks, so that the supervisor never takes more than MAX_RATE datagrams a
    second (10,000: about a tenth of a core in Python)."""
    return max(BEAT_S, ranks / MAX_RATE)


def timeout_for(node_timeout_s: float, ranks: int) -> float:
    """The silence after which a host is lost: launch.node_timeout_s, and never less than
    four beats."""
    return max(node_timeout_s, 4 * beat_interval(ranks))


def launcher_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, ranks) of this process as its launcher numbers them (srun's task id, PMI's
    rank...), or None outside a launcher or where its variables are malformed (the rank's
    own start-up names them)."""
    # imported here: run by its path (the beat child), this file loads the standard library
    from spmd.launch import schedulers
    from spmd.launch.errors import LaunchError

    try:
        found = schedulers.find(schedulers.Vars(environ))
    except LaunchError:
        return None
    return None if found is None else (found.rank, found.size)


class Beacon:
    """The rank side: a small child process that sends this rank's beat to `addr` every
    `beat_s` for as long as the rank lives, and the rank's last word.

    A process, not a thread of the rank: a rank that holds the GIL for seconds (a library
    call that does not release it, an HDF5 read on a slow file system) is slow, not lost,
    and must not fall silent. The child is this file run by its path (the standard library
    only: no JAX, no numpy), dies with the rank (PR_SET_PDEATHSIG, and it looks for its
    parent before each beat), and holds none of the rank's files (Hydra's and Slurm's PMI
    sockets among them: their lifetime must be the rank's)."""

    def __init__(self, addr: tuple[str, int], rank: int | None, attempt: int,
                 beat_s: float = BEAT_S):
        self.addr, self.beat_s = addr, beat_s
        self.message = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                        "attempt": attempt}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.child: subprocess.Popen | None = None
        self.ended = False

    def _send(self, **extra: object) -> None:
        try:
            self.sock.sendto(json.dumps({**self.message, **extra}).encode(), self.addr)
        except OSError:
            pass   # best effort: a missed beat is one of several in a timeout

    def start(self) -> Beacon:
        self._send()   # the first beat at once, before the child is up
        self.child = subprocess.Popen(
            [sys.executable, "-I", "-S", __file__, self.addr[0], str(self.addr[1]),
             json.dumps(self.message), str(self.beat_s), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True)
        return self

    def bye(self) -> None:
        """This rank ends on its own: stop beating and say so (twice: UDP may drop one).
        Nothing in a process forked from the rank (a data worker ending with atexit
        handlers): the rank itself still runs."""
        if self.ended or os.getpid() != self.message["pid"]:
            return
        self.ended = True
        if self.child is not None:
            try:
                self.child.kill()
                self.child.wait(1.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for _ in range(2):
            self._send(bye=True)


def _die_with_parent() -> None:
    """In the beat child: SIGKILL it when the rank dies (Linux prctl; set by the child
    itself, not in a pre-exec hook, which a rank with threads must not run)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _beat_forever(host: str, port: int, message: str, beat_s: float, parent: int) -> None:
    """The beat child's loop: one datagram every `beat_s` while its parent (the rank) lives;
    none once it is gone, even when it died before the child could ask to die with it."""
    if sys.platform == "linux":
        _die_with_parent()
    data = message.encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while os.getppid() == parent:
            try:
                sock.sendto(data, (host, port))
            except OSError:
                pass
            time.sleep(beat_s)


_beacon: list[Beacon] = []


def attempt_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The try this rank belongs to (SPMD_RECOVERY_ATTEMPT, set by the supervisor); None
    outside the supervisor. ValueError: the variable is not a whole number."""
    text = (os.environ if environ is None else environ).get(ATTEMPT_VAR, "")
    return int(text) if text else None


def start_from_env(environ: Mapping[str, str] | None = None) -> Beacon | None:
    """Start this rank's beacon when the supervisor asked for beats (SPMD_BEAT_ADDR); once
    per process. A malformed address is ignored: the supervisor then sees the try as before,
    through the launcher and the scheduler."""
    environ = os.environ if environ is None else environ
    text = environ.get(ADDR_VAR, "")
    if _beacon or not text:
        return _beacon[0] if _beacon else None
    host, _, port = text.rpartition(":")
    try:
        addr = (socket.gethostbyname(host), int(port))
        attempt = attempt_from_env(environ) or 0
        rank, ranks = launcher_rank(environ) or (None, 1)
        beacon = Beacon(addr, rank, attempt, beat_interval(ranks)).start()
    except (OSError, ValueError):
        return None
    _beacon.append(beacon)
    atexit.register(say_bye)
    return beacon


def say_bye() -> None:
    """This rank ends on its own (at exit, or just before a deliberate os._exit)."""
    for beacon in _beacon:
        beacon.bye()


@dataclass
class Beat:
    """The last beat of one rank process."""

    host: str
    rank: int | None
    at: float            # time.monotonic() of the supervisor when it came
    bye: bool = False


class Listener:
    """The supervisor side: the beats of the current try, by rank process."""

    def __init__(self, bind_host: str = "0.0.0.0"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((bind_host, 0))
        self.sock.setblocking(False)
        self.port = int(self.sock.getsockname()[1])
        self.attempt = 0
        self.beats: dict[tuple[str, int], Beat] = {}

    def new_try(self, attempt: int) -> None:
        """Forget the beats of the try before (its late datagrams are dropped by number)."""
        self.drain()
        self.attempt, self.beats = attempt, {}

    def drain(self, now: float | None = None) -> None:
        """Take every datagram that has come."""
        now = time.monotonic() if now is None else now
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:   # nothing more has come (BlockingIOError), or the socket closed
                return
            try:
                m = json.loads(data)
                if int(m.get("attempt", -1)) != self.attempt:
                    continue
                key = (str(m["host"]), int(m["pid"]))
                rank = None if m.get("rank") is None else int(m["rank"])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            bye = bool(m.get("bye")) or (key in self.beats and self.beats[key].bye)
            self.beats[key] = Beat(key[0], rank, now, bye)

    def silent_hosts(self, timeout_s: float, ended_ranks: Iterable[int] = (),
                     now: float | None = None,
                     left: Iterable[str] | None = None) -> dict[str, float]:
        """{host: seconds since its last beat} for each host of this try none of whose ranks
        that are still due (no bye, not in `ended_ranks`: ranks the launcher or the ranks'
        records report ended) beat within `timeout_s`, while a rank of another host did; or,
        given `left` (the hosts the launcher still waits for when it has seen every other
        rank end: `recovery.only_silent_hosts_left`), those of them that stopped beating.
        Call `drain` first: a beat is timed when it is taken, so a supervisor that stalled
        sees every host fresh, never every host silent."""
        now = time.monotonic() if now is None else now
        ended = set(ended_ranks)
        due: dict[str, list[Beat]] = {}
        for b in self.beats.values():
            if not b.bye and (b.rank is None or b.rank not in ended):
                due.setdefault(b.host, []).append(b)
        ages = {h: now - max(b.at for b in beats) for h, beats in due.items()}
        stale = {h: age for h, age in ages.items() if age >= timeout_s}
        if left is not None:
            wanted = set(left)
            return {h: age for h, age in stale.items() if h in wanted}
        fresh = [h for h, age in ages.items() if age < timeout_s]
        return stale if fresh else {}

    def ranks_on(self, hosts: Iterable[str]) -> list[int]:
        wanted = set(hosts)
        return sorted({b.rank for b in self.beats.values()
                       if b.host in wanted and b.rank is not None})

    def close(self) -> None:
        self.sock.close()


if __name__ == "__main__":   # the beat child: HOST PORT MESSAGE BEAT_S PARENT_PID
    _beat_forever(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]),
                  int(sys.argv[5]))
