"""The data a run trains on, fingerprinted per run: a resumed job reads the data its run began
with, or says which file changed.

The batch of step s is a pure function of the seed, s and the data (spmd.data.order), so a
job
that resumes a run on other data trains from the restored step on as the run never did, with
no error. Each job therefore fingerprints every file of `data.path` (one store, a directory
of stores, a glob, a Zarr store alike: `file_index.content_stamp` of each member) and records
it in the run directory, `RUN_DIR/data_fingerprint.json`; a job that restores a checkpoint
compares first. A file that changed, disappeared or appeared is a one-line error naming it,
`data.path` and the remedies; with `data.allow_changed: true` it is a warning (a change of
data), and the new fingerprint is recorded.

Rank 0 alone reads and writes the record (the files are on a file system every rank sees);
its error ends the other ranks as every rank-0 error does. Members are compared by their path
relative to the data's base directory, so data staged to another directory with its files'
mtimes kept (`cp -p`, `rsync -t`) is the same data.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from spmd.atomic_write import write_atomic
from spmd.data.formats.file_index import _rel, content_stamp, data_exists, resolve
from spmd.data.formats.stores import ArrayDataError

log = logging.getLogger("spmd.data")

RECORD_NAME = "data_fingerprint.json"
RECORD_VERSION = 1

__all__ = ["RECORD_NAME", "check_run_inputs", "input_fingerprint"]


def input_fingerprint(path: str | Path, where: str = "data.path") -> dict[str, dict[str, Any]]:
    """{member name relative to the base directory: content stamp} for every file of `path`."""
    members, base, _ = resolve(path, where)
    return {_rel(p, base): content_stamp(p) for p in members}


def check_run_inputs(data: Any, run_dir: Path, restored_step: int | None,
                     is_main: bool) -> None:
    """Rank 0 (`is_main`): compare `data.path`'s files with the run's record when this job
    resumed at `restored_step` (None: a fresh start, nothing to compare), raise an
    ArrayDataError naming the first changed file (`data.allow_changed`: warn instead), and
    record this job's fingerprint. Nothing for synthetic data or no `data.path`."""
    if not is_main or getattr(data, "source", "synthetic") == "synthetic" or data.path is None:
        return
    path, where = str(data.path), f"data.path={data.path}"
    if not data_exists(path):   # a task that reads other files than data.path names
        log.debug("%s: nothing there to fingerprint", where)
        return
    began = time.perf_counter()
    try:
        now = input_fingerprint(path, where)
    except OSError as e:
        raise ArrayDataError(f"{where}: cannot read {e.filename or path} to fingerprint the "
                             f"run's data ({e.strerror or e})") from None
    record = Path(run_dir) / RECORD_NAME
    previous = _read(record) if restored_step is not None else None
    if previous is not None:
        changes = _changes(previous.get("members") or {}, now, path)
        if changes:
            what = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more"
                                             if len(changes) > 3 else "")
            if not data.allow_changed:
                raise ArrayDataError(
                    f"{where}: {what}, since the run's previous job (its fingerprint: "
                    f"{record}); from the restored step {restored_step} on the run would "
                    f"train on other data than it began with: put the original data back, "
                    f"train in another run.dir, or set data.allow_changed=true to train on "
                    f"with the new data")
            log.warning("data changed since the run's previous job (data.allow_changed=true): "
                        "%s: %s; steps from %d on train on the new data", where, what,
                        restored_step)
    _write(record, {"version": RECORD_VERSION, "data.path": path, "members": now,
                    "step": restored_step or 0, "written": time.strftime("%Y-%m-%dT%H:%M:%S")})
    log.debug("%s: fingerprinted %d file(s) in %.2fs (%s)", where, len(now),
              time.perf_counter() - began, record)


def _changes(old: dict[str, Any], new: dict[str, Any], path: str) -> list[str]:
    base = resolve_base(path)
    out = []
    for name, stamp in old.items():
        if name not in new:
            out.append(f"file {base / name} is gone")
        elif new[name] != stamp:
            diff = ", ".join(f"{k} {_short(stamp.get(k))} -> {_short(new[name].get(k))}"
                             for k in ("size", "mtime_ns", "files", "sha1")
                             if stamp.get(k) != new[name].get(k))
            out.append(f"file {base / name} changed ({diff})")
    out += [f"file {base / name} is new" for name in sorted(set(new) - set(old))]
    return out


def _short(value: Any) -> Any:
    return value[:12] if isinstance(value, str) else value


def resolve_base(path: str) -> Path:
    """The directory member names are relative to (resolve's base)."""
    return resolve(path, f"data.path={path}")[1]


def _read(record: Path) -> dict | None:
    try:
        doc = json.loads(record.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s does not read (%s): the data's fingerprint is recorded afresh", record, e)
        return None
    return doc if isinstance(doc, dict) and doc.get("version") == RECORD_VERSION else None


def _write(record: Path, doc: dict) -> None:
    try:
        write_atomic(record, json.dumps(doc, indent=1), durable=False)
    except OSError as e:
        log.warning("cannot record the data's fingerprint in %s (%s): a later job cannot "
                    "tell whether the data changed", record, e)
