"""An error on one rank ends every rank of the job at once, and says which rank and why.

Why: a rank that raises while the others wait (in a device collective, an agreement,
Orbax's barrier) leaves them waiting until some timeout, after which JAX's C++ aborts them
with messages that do not name the cause; and jax.distributed.shutdown, which JAX also runs
at interpreter exit, waits for every rank in a barrier, so the failed rank itself hangs.

- `announce(env, error, status)`: the failed rank writes one key, `spmd/job/failed`, with
  its rank, host, error line and exit status (the first failure wins: the key is never
  overwritten), then waits at most `ACK_WAIT_S` until every other rank has acknowledged it,
  so that rank 0, which serves the coordination service, is not gone while they read.
- `FailureWatch`: a daemon thread on every rank that blocks on that key
  (`blocking_key_value_get` releases the GIL; renewed every `POLL_S`). When it appears with
  another rank's failure, the thread acknowledges, logs one ERROR line naming the failed rank,
  its host and the error's type (the error itself is in that rank's log), and ends this rank
  with os._exit(the failed rank's status): Hydra ORs the ranks' statuses, so every rank
  exits with the same one. No atexit handler, no shutdown barrier runs; a save in flight
  stays uncommitted (commits are atomic renames).
- `end_process(status)`: the failed rank ends the same way once its own output is written
  (not sys.exit: JAX's atexit handler would wait in the shutdown barrier). Rank 0, whose
  process serves the key-value store, ends last.
- One process, or no jax.distributed: nothing is announced or watched.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmd.comm.kvstore import bounded, kv_client
from spmd.launch import watchdog
from spmd.launch.env import LaunchEnv

FAILED_KEY = "spmd/job/failed"
ACK_PREFIX = "spmd/job/failed-ack/"
EXIT_PREFIX = "spmd/job/exiting/"
ACK_WAIT_S = 5.0
LAST_WAIT_S = 5.0
STOP_WAIT_S = 5.0
POLL_S = 10.0

log = logging.getLogger("spmd.comm.job_failure")
_announced: list[int] = []  # the exit status this rank announced, once
_job: list[LaunchEnv] = []   # the job this rank watches (FailureWatch.start)


@dataclass(frozen=True)
class Failure:
    """The first rank's failure, as every rank reads it."""

    rank: int
    host: str
    error: str
    status: int
    kind: str = "error"   # the exception's type

    def line(self) -> str:
        return f"rank {self.rank} on {self.host} failed: {self.error}"


def announce(env: LaunchEnv, error: str, status: int, kind: str = "error") -> bool:
    """Tell every rank that this one failed with `error` (an exception of type `kind`); True
    when this rank's failure is the job's (it was first). Waits at most ACK_WAIT_S for the
    others to read it."""
    client = kv_client() if env.size > 1 else None
    if client is None:  # one process: nobody to tell, and the usual exit path is safe
        return True
    if not _announced:
        _announced.append(int(status) or 1)
    text = json.dumps({"rank": env.rank, "host": env.hostname, "error": error[:2000],
                       "status": int(status) or 1, "kind": kind})
    try:
        client.key_value_set(FAILED_KEY, text)  # raises when another rank was first
    except Exception:
        return False
    deadline = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < deadline:
        try:
            if len(client.key_value_dir_get(ACK_PREFIX)) >= env.size - 1:
                break
        except Exception:
            break
        time.sleep(0.05)
    return True


def announced() -> int | None:
    """The exit status this rank announced a failure with, or None."""
    return _announced[0] if _announced else None


def end_process(status: int, env: LaunchEnv | None = None) -> None:
    """Flush what was written and end now: no atexit handler, no shutdown barrier.

    With `env` (or the job this rank watches), rank 0 ends last: the key-value store lives in
    its process, and a rank that loses it while still running is aborted by JAX's C++ (which
    would print a fatal error in place of ours). The others post `spmd/job/exiting/<rank>`
    first; rank 0 waits at most `LAST_WAIT_S` for those posts and for its local peers to be
    gone.
    """
    # this rank ends on purpose, with the job's status: a peer that ends first must not make
    # the lost-rank watchdog end it with another status (ORPHANED) and a misleading line
    watchdog.disarm_peers()
    env = env if env is not None else (_job[0] if _job else None)
    if env is not None and env.size > 1 and (client := kv_client()) is not None:
        if env.rank != 0:
            bounded(lambda: client.key_value_set(f"{EXIT_PREFIX}{env.rank}", "1"), 2.0)
        else:
            _wait_for_the_others(client, env)
    watchdog.leave_exit_mark()  # ended on its own: its peers must not report it killed
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(status))


def _wait_for_the_others(client: Any, env: LaunchEnv) -> None:
    deadline = time.monotonic() + LAST_WAIT_S
    while time.monotonic() < deadline:
        posted = bounded(lambda: client.key_value_dir_get(EXIT_PREFIX), 1.0)
        if not posted.ok or len(posted.value) >= env.size - 1:
            break
        time.sleep(0.05)
    peers = watchdog.local_peers()
    while time.monotonic() < deadline and any(watchdog.process_alive(pid, start)
                                              for pid, start in peers.values()):
        time.sleep(0.02)
    if len(peers) < env.size - 1:   # ranks on other hosts: a moment to be gone
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


class FailureWatch:
    """Ends this rank as soon as another rank announces a failure (see the module doc)."""

    def __init__(self, env: LaunchEnv, on_failure: Callable[[Failure], None] | None = None):
        self.env, self.on_failure = env, on_failure
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> FailureWatch:
        _job[:] = [self.env]
        if self.env.size > 1 and kv_client() is not None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="spmd-failure-watch")
            self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """No more watching: called after jax.distributed.shutdown, which a failed rank
        never reaches, so that a failure still ends this rank during it (the shutdown cancels
        the pending read once every rank is there). `wait`: join the thread (a rank that ends
        with os._exit need not)."""
        self._stopped.set()
        if wait and self._thread is not None:
            # the read that jax.distributed.shutdown cancelled returns at once; a thread still
            # inside the client's C++ when Python finalizes would abort the process
            self._thread.join(STOP_WAIT_S)

    def _run(self) -> None:
        client = kv_client()
        while not self._stopped.is_set():
            try:
                text = client.blocking_key_value_get(FAILED_KEY, int(POLL_S * 1000))
            except Exception as e:  # a timeout: read again; anything else: the service is gone
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                return
            if self._stopped.is_set():
                return
            failure = Failure(**json.loads(text))
            if failure.rank == self.env.rank:
                return
            self._end(client, failure)

    def _end(self, client: object, failure: Failure) -> None:
        try:
            client.key_value_set(f"{ACK_PREFIX}{self.env.rank}", "1")  # type: ignore[attr-defined]
        except Exception:
            pass
        if failure.kind == "Preempted":  # a stop before training (spmd.loop.early_stop)
            log.warning("rank %d on %s stopped the job for preemption; ending %s with status "
                        "%d", failure.rank, failure.host, self.env.who, failure.status)
        else:  # the error itself is in the failed rank's log and output: named, not repeated
            log.error("rank %d on %s failed (%s); ending %s with its status %d (the error is "
                      "in rank %d's log and output)", failure.rank, failure.host, failure.kind,
                      self.env.who, failure.status, failure.rank)
        if self.on_failure is not None:
            try:
                self.on_failure(failure)
            except Exception:
                pass
        end_process(failure.status, self.env)
