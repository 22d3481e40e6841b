"""What a run leaves behind: metrics.jsonl, events.jsonl, per-rank logs (the console: console.py).

Invariants
- metrics.jsonl holds each step's records once: a run resumed from step S first moves the
  records of steps after S (logged by the incarnation that died, and about to be logged
  again) to the sibling metrics.replayed.jsonl (`drop_records_after`), so nothing is lost
  and a reader sees every step once. Readers still let the last record of a step win.
- metrics.jsonl is only ever appended to, or replaced whole (`os.replace` of a fsynced
  temporary sibling, spmd.atomic_write), never rewritten in place: a kill at any moment
  leaves either the old or the new file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from spmd.atomic_write import write_atomic
from spmd.launch.liveness import attempt_from_env
from spmd.rundir.console import (
    ConsoleFilter,
    ConsoleFormatter,
    ConsoleHandler,
    Narrator,
    NotConsoleOnly,
    internal,
)

log = logging.getLogger("spmd")


def setup_logging(run_dir: Path, rank: int, debug: bool = False,
                  log_level: str = "info") -> Path:
    """Every rank logs everything to run_dir/logs/rank<r:05d>.log; the console (stderr) gets
    the lines for people of rank 0 and the warnings and errors of every rank
    (spmd.rundir.console). `log_level` (run.log_level) "debug": spmd's DEBUG records too,
    and rank 0's console shows every record (the internal `key=value` ones as well); `debug`
    (--debug): every library's DEBUG records in the rank log."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank{rank:05d}.log"
    fmt = logging.Formatter(
        f"%(asctime)s rank {rank} {socket.gethostname()} %(levelname)s %(name)s: %(message)s"
    )
    verbose = log_level == "debug"
    root = logging.getLogger()
    for h in list(root.handlers):
        # ours from an earlier call, and the bare stderr handler that a library's import-time
        # logging.basicConfig leaves (orbax's does): either would print every line twice
        if getattr(h, "_spmd", False) or (type(h) is logging.StreamHandler
                                          and h.stream in (sys.stderr, sys.__stderr__)):
            root.removeHandler(h)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    file_handler.addFilter(NotConsoleOnly())
    stderr = ConsoleHandler()
    stderr.setFormatter(ConsoleFormatter(fmt))
    stderr.addFilter(ConsoleFilter(rank, verbose))
    for h in (file_handler, stderr):
        h._spmd = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    # run.log_level=debug: spmd's own DEBUG records (not every library's, as --debug)
    logging.getLogger("spmd").setLevel(logging.DEBUG if verbose else logging.NOTSET)
    for noisy in ("absl", "jax._src", "orbax", "etils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlWriter:
    """Append-only JSON lines, flushed per record (a killed run keeps what it logged)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled
        self._file = open(path, "a") if enabled else None  # noqa: SIM115

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class EventLog(JsonlWriter):
    """events.jsonl: saves, restores, signals, evaluation; each with time, rank and host."""

    def __init__(self, path: Path, rank: int, enabled: bool = True):
        super().__init__(path, enabled)
        self.rank = rank
        self.narrate = Narrator() if rank == 0 else None
        # under the recovery supervisor: the try this rank belongs to, in every record, so
        # that a late record of an ended try is not read as the next try's (launch.recovery)
        try:
            attempt = attempt_from_env()
        except ValueError:
            attempt = None
        self.attempt = {} if attempt is None else {"attempt": attempt}

    def emit(self, event: str, **fields: Any) -> None:
        """Write an event, log its `key=value` line (the rank log; the console only with
        run.log_level=debug) and, on rank 0, say it in words when it ends a phase."""
        log.info("%s %s", event, " ".join(f"{k}={v}" for k, v in fields.items()),
                 extra=internal())
        self.record(event, **fields)
        if self.narrate is not None:
            self.narrate(event, fields)

    def record(self, event: str, **fields: Any) -> None:
        """Write an event without logging it (when the log or the CLI says it already)."""
        self.write({"event": event, "time": time.time(), "rank": self.rank,
                    "host": socket.gethostname(), **self.attempt, **fields})


def replayed_path(path: Path) -> Path:
    """Where `drop_records_after` moves the records of `path` it drops: metrics.jsonl ->
    metrics.replayed.jsonl."""
    return path.with_name(f"{path.stem}.replayed{path.suffix}")


def drop_records_after(path: Path, step: int) -> int:
    """Move the records of `path` with a `step` greater than `step` to `replayed_path(path)`.

    Called by rank 0 when a run resumes from `step`, before it writes new records: the steps
    after it are trained (and logged) again. A line cut short by a kill is moved too (the next
    record would otherwise be glued onto it). The dropped lines are appended to the replayed
    file (fsynced) before `path` is replaced atomically by what remains, so a kill in between
    at worst leaves them in both. Records without a step (or not JSON objects) stay. Returns
    how many lines were moved; 0 (and `path` untouched) when none were or it does not exist.
    Call it before a `JsonlWriter` opens `path`: a writer opened earlier would keep appending
    to the replaced file.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    keep, moved = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            moved.append(line)
            continue
        later = (isinstance(record, dict) and isinstance(record.get("step"), int | float)
                 and record["step"] > step)
        (moved if later else keep).append(line)
    if not moved:
        return 0
    replayed = replayed_path(path)
    with open(replayed, "a") as f:
        f.write("".join(line + "\n" for line in moved))
        f.flush()
        os.fsync(f.fileno())
    write_atomic(path, "".join(line + "\n" for line in keep), durable=True)
    return len(moved)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
