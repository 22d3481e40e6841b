"""What a run leaves behind: metrics.jsonl, events.jsonl, per-rank logs, rank-0 progress.

Invariants
- metrics.jsonl holds each step's records once: a run resumed from step S first moves the
  records of steps after S (logged by the incarnation that died, and about to be logged
  again) to the sibling metrics.replayed.jsonl (`drop_records_after`), so nothing is lost
  and a reader sees every step once. Readers still let the last record of a step win.
- metrics.jsonl is only ever appended to, or replaced whole (`os.replace`), never rewritten
  in place: a kill at any moment leaves either the old or the new file.
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

log = logging.getLogger("spmd")


def setup_logging(run_dir: Path, rank: int, debug: bool = False) -> Path:
    """Every rank logs to run_dir/logs/rank<r:05d>.log; rank 0 also to stderr (warnings: all
    ranks)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank{rank:05d}.log"
    fmt = logging.Formatter(
        f"%(asctime)s rank {rank} {socket.gethostname()} %(levelname)s %(name)s: %(message)s"
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        # ours from an earlier call, and the bare stderr handler that a library's import-time
        # logging.basicConfig leaves (orbax's does): either would print every line twice
        if getattr(h, "_spmd", False) or (type(h) is logging.StreamHandler
                                          and h.stream in (sys.stderr, sys.__stderr__)):
            root.removeHandler(h)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(fmt)
    stderr.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for h in (file_handler, stderr):
        h._spmd = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
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

    def emit(self, event: str, **fields: Any) -> None:
        log.info("%s %s", event, " ".join(f"{k}={v}" for k, v in fields.items()))
        self.record(event, **fields)

    def record(self, event: str, **fields: Any) -> None:
        """Write an event without logging it (when the log or the CLI says it already)."""
        self.write({"event": event, "time": time.time(), "rank": self.rank,
                    "host": socket.gethostname(), **fields})


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
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # a file system that cannot fsync directories: the rename is still atomic
    return len(moved)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """A rich progress bar on rank 0 (step, loss, samples/s, ETA); plain lines without a TTY."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled = enabled
        self._bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        console = Console(stderr=True)
        self._plain = not console.is_terminal
        self._total, self._last_print = total, 0.0
        if not self._plain:
            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=console, transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, status="")
            self._bar.start()

    def update(self, step: int, loss: float, samples_per_s: float, eta_s: float | None) -> None:
        if not self.enabled:
            return
        status = f"loss {loss:.4f}  {samples_per_s:,.0f} samples/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
            return
        now = time.time()
        if now - self._last_print >= 2.0 or step == self._total:
            eta = f"  ETA {eta_s:,.0f}s" if eta_s is not None else ""
            print(f"step {step}/{self._total}  {status}{eta}", file=sys.stderr, flush=True)
            self._last_print = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
