"""One rank's work before training (making a data set, an index, statistics), and the other
ranks waiting for it with no fixed deadline but their own, while saying what they wait for.

Why: rank 0 may need minutes to prepare the data while the other ranks wait. A wait in a
device collective (`sync_global_devices`) gives up after 30 s on CPU: Gloo's context,
created by the first cross-process collective, reads its peers' keys with a fixed 30 s
deadline ("Gloo context initialization failed: DEADLINE_EXCEEDED ... GetKeyValue() timed
out"), and it says nothing while it waits. So no rank enters a collective before every rank
has finished its part; the waiting is done here, over the jax.distributed key-value store.

How (`prepare_on_rank0(env, prepare, timeout_s)`):
- Rank 0 calls `prepare(True)`. Meanwhile the first and the latest INFO-or-louder line it
  logs from this thread are published (at most every `PUBLISH_EVERY_S`) under
  `spmd/prepare/progress`, so the others can tell what it is doing ("making
  data/darcy_g64.h5 ...", "596/1192 samples"). Then it posts `spmd/prepare/done/0`.
- Every other rank waits for that key, logging every `report_every_s` what it waits for,
  how long so far, the limit (`launch.prepare_timeout_s`) and rank 0's latest line; then it
  calls `prepare(False)` (its own share: validating the file rank 0 made, say) and posts
  `spmd/prepare/done/<rank>`.
- Every rank then waits until all ranks have posted, so the collective that follows starts
  on all ranks together. Each wait is bounded by `timeout_s`; its error names the ranks
  waited for, the host and the config key.
- A rank whose `prepare` raises posts nothing: the trainer announces its failure
  (spmd.comm.job_failure), and every other rank's FailureWatch ends that rank at once. A
  rank that dies unannounced takes the store with it (rank 0) or never posts (the others):
  the waiting ranks say so, or time out naming it.
- One process: `prepare(True)`, nothing else.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from spmd.comm.agreement import ranks_text
from spmd.comm.errors import AgreementError, AgreementTimeout
from spmd.comm.kvstore import kv_client
from spmd.launch.env import LaunchEnv

PREFIX = "spmd/prepare/"
PROGRESS_KEY = PREFIX + "progress"
DONE_PREFIX = PREFIX + "done/"
TIMEOUT_KEY = "launch.prepare_timeout_s"
WHAT = "prepare the data (Task.prepare)"
FIRST_REPORT_S = 5.0      # a wait shorter than this is not worth a line
REPORT_EVERY_S = 30.0
PUBLISH_EVERY_S = 0.5
POLL_S = 0.25
STORE_GONE_GRACE_S = 5.0  # for the FailureWatch of a rank whose store went with rank 0
LINE_CHARS = 300

log = logging.getLogger("spmd.comm.prepare_wait")


class PrepareTimeout(AgreementTimeout):
    """A rank waited longer than launch.prepare_timeout_s for the others' preparation."""


def prepare_on_rank0(env: LaunchEnv, prepare: Callable[[bool], None], timeout_s: float, *,
                     report_every_s: float = REPORT_EVERY_S, client: Any = None) -> None:
    """`prepare(True)` on rank 0, then `prepare(False)` on every other rank; returns on every
    rank once all have finished (see the module docstring). Before any collective."""
    if env.size == 1:
        prepare(True)
        return
    client = client if client is not None else kv_client()
    if client is None:
        raise AgreementError(f"{env.size} ranks wait for rank 0 to {WHAT} over "
                             "jax.distributed, which is not initialized; call bootstrap() first")
    began = time.monotonic()
    if env.rank == 0:
        with _Publisher(client):
            prepare(True)
        _post(client, env, began)
    else:
        _Wait(client, env, timeout_s, report_every_s).until_rank0()
        prepare(False)
        _post(client, env, began)
    _Wait(client, env, timeout_s, report_every_s).until_all()


def _post(client: Any, env: LaunchEnv, began: float) -> None:
    value = json.dumps({"seconds": round(time.monotonic() - began, 3), "host": env.hostname})
    try:
        client.key_value_set(f"{DONE_PREFIX}{env.rank}", value, allow_overwrite=True)
    except Exception as e:  # the coordination service is gone (rank 0 died?)
        raise AgreementError(f"cannot tell the other ranks that it has finished "
                             f"its Task.prepare (jax.distributed key-value store: "
                             f"{_first_line(e)}); rank 0 may have died - see its log") from None


class _Wait:
    """One rank's bounded, talkative waits on the store."""

    def __init__(self, client: Any, env: LaunchEnv, timeout_s: float, report_every_s: float):
        self.client, self.env, self.timeout_s = client, env, timeout_s
        self.report_every_s = report_every_s
        self.began = time.monotonic()
        self._next_report = FIRST_REPORT_S

    def until_rank0(self) -> None:
        """Until rank 0 has posted that its preparation is done."""
        while not self._read(lambda: self.client.key_value_try_get(f"{DONE_PREFIX}0"), "rank 0"):
            self._tick([0], rank0=True)
        self._finished("rank 0 finished preparing the data")

    def until_all(self) -> None:
        """Until every rank has posted (rank 0 waiting for the others' `prepare(False)`)."""
        while True:
            posted = self._read(lambda: self.client.key_value_dir_get(DONE_PREFIX), "the ranks")
            done = {int(key.rsplit("/", 1)[-1]) for key, _ in posted or []}
            missing = [r for r in range(self.env.size) if r not in done]
            if not missing:
                break
            self._tick(missing, rank0=False)
        self._finished("every rank finished its Task.prepare")

    def _read(self, fn: Callable[[], Any], whom: str) -> Any:
        """The store's answer, or None when the key is not there yet."""
        try:
            return fn()
        except Exception as e:  # NOT_FOUND: not posted yet; anything else: the store is gone
            text = str(e)
            if "NOT_FOUND" in text or "not found" in text.lower():
                return None
            # rank 0 may have announced a failure and ended once this rank acknowledged it:
            # this rank's FailureWatch then names it and ends this rank with its status;
            # give it that moment before saying anything less precise
            time.sleep(STORE_GONE_GRACE_S)
            raise AgreementError(
                f"lost the jax.distributed key-value store (served by rank 0's "
                f"process) after {self.elapsed():.0f} s while waiting for {whom} to {WHAT}: "
                f"{_first_line(e)}; rank 0 may have died - see its log") from None

    def _tick(self, missing: list[int], rank0: bool) -> None:
        """Time out, or report, then sleep a little."""
        waited = self.elapsed()
        whom = "rank 0" if rank0 else f"rank(s) {ranks_text(missing)}"
        if waited > self.timeout_s:
            said = self._progress() if rank0 else ""
            work = "preparing the data (Task.prepare)" if rank0 else "its Task.prepare"
            raise PrepareTimeout(
                f"{whom} did not finish {work} within {TIMEOUT_KEY}={self.timeout_s:g} s"
                f"{said}. Raise {TIMEOUT_KEY}, or make the data before the job (`spmd data "
                f"make CONFIG`), or look at {whom}'s log for what it is doing")
        if waited >= self._next_report:
            self._next_report = waited + self.report_every_s
            log.info("waiting for %s to %s: %.0f s so far, limit %s=%g%s", whom, WHAT,
                     waited, TIMEOUT_KEY, self.timeout_s, self._progress() if rank0 else "")
        time.sleep(POLL_S)

    def _progress(self) -> str:
        """"; rank 0 last said (3 s ago): 596/1192 samples (it began: making data/...)" from
        the published lines, or ""."""
        try:
            record = json.loads(self.client.key_value_try_get(PROGRESS_KEY))
        except Exception:  # nothing published yet, or unreadable: say nothing
            return ""
        ago = max(0.0, time.time() - float(record.get("time", time.time())))
        line, first = record.get("line", ""), record.get("first", "")
        began = f" (it began: {first})" if first and first != line else ""
        return f"; rank 0 last said ({ago:.0f} s ago): {line}{began}"

    def _finished(self, what: str) -> None:
        if self.elapsed() >= FIRST_REPORT_S:
            log.info("%s; waited %.1f s", what, self.elapsed())

    def elapsed(self) -> float:
        return time.monotonic() - self.began


class _Publisher(logging.Handler):
    """While rank 0 prepares: its first and latest INFO lines (this thread's) under
    PROGRESS_KEY: what it is making, and how far it is. Logging only keeps the line; a
    daemon thread posts it when it changed, every PUBLISH_EVERY_S, so a task that logs a
    line per file is not slowed by the store."""

    def __init__(self, client: Any):
        super().__init__(logging.INFO)
        self.client = client
        self._thread = threading.get_ident()
        self._first, self._line, self._posted = "", "", ""
        self._time = 0.0
        self._stop = threading.Event()
        self._poster = threading.Thread(target=self._post_changes, daemon=True,
                                        name="spmd-prepare-progress")

    def __enter__(self) -> _Publisher:
        logging.getLogger().addHandler(self)
        self._poster.start()
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)
        self._stop.set()
        self._poster.join(2.0)

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self._thread:
            return
        try:
            line = " ".join(record.getMessage().split())[:LINE_CHARS]
        except Exception:  # a record whose arguments do not format: not worth a word
            return
        self._first = self._first or line
        self._line, self._time = line, time.time()

    def _post_changes(self) -> None:
        while not self._stop.wait(PUBLISH_EVERY_S):
            line = self._line
            if line == self._posted:
                continue
            try:
                self.client.key_value_set(PROGRESS_KEY, json.dumps(
                    {"line": line, "first": self._first, "time": self._time}),
                    allow_overwrite=True)
                self._posted = line
            except Exception:  # progress is a courtesy: never fail the preparation over it
                pass


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
