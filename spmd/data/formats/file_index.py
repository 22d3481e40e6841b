"""Many files as one dataset: the members of `data.path` and the cached index over them.

`data.path` is one of:
- a store (an HDF5 / NetCDF4 file, a Zarr store, a directory of .npy files): one member;
- a directory holding stores (`*.h5`, `*.hdf5`, `*.nc`, `*.nc4`, `*.zarr`, ...): every such
  entry, in sorted name order (not recursive: use a glob for nested files);
- a glob (`runs/*/fields.h5`, `parts/**/*.zarr`): every match, in sorted path order.

Each member holds the same dataset paths; a dataset is the concatenation of its members
along the first axis, so a file split into parts reads exactly as the file did.

The index (per member: name, format, size, mtime and every dataset's shape and dtype) is
built once, by opening every member for its metadata, and cached beside the data:
`<dir>/.spmd_index.json` for a directory, `<glob's fixed prefix>/.spmd_index-<hash>.json`
for a glob. A later run only stats the members. The index is a cache, never the authority:
one that no longer matches the files (a member changed, disappeared or appeared) is built
again, with a warning naming each change and what it does to a resumed run (the global order
changes with the files; the run's own record, spmd.data.stats.run_inputs, refuses to resume on
changed data unless `data.allow_changed: true`). Nobody deletes an index by hand.

Integrity: a file being written is never indexed (or fingerprinted) half-written, silently.
- An HDF5 / NetCDF4 file whose superblock says a writer has it open (the "open for write"
  consistency flag HDF5 >= 1.10 sets, cleared on close), or that is shorter than the
  end-of-file address its superblock records (truncated, or still being copied), is refused
  by name (`check_complete`), a single store as well as a member.
- Each member's size and mtime are taken before and after it is opened for the index; a
  difference is an error naming the file (it is being written: rerun when it is done).
  A member modified within `FRESH_S` seconds is looked at again after `SETTLE_S` first.
- `content_stamp` compares size and mtime before and after hashing the same way, and the
  statistics (spmd.data.stats.normalization) after reading each file.
A Zarr store being written shows only through its metadata files' size and mtime; a chunk
written after the index shows nowhere: finish writing a store before training on it.

`content_stamp` is the finer fingerprint a run records of each of its inputs, single stores
included (spmd.data.stats.run_inputs): size and mtime, and a hash of the bytes that change when
the data is written again (a file's first and last blocks: the HDF5 / NetCDF header and the
end of its data; a Zarr store's metadata files; each .npy file's header and last block).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmd.atomic_write import write_atomic
from spmd.data.formats.stores import (
    ZARR_METADATA,
    ArrayDataError,
    Store,
    detect_format,
    fingerprint,
    is_member_name,
)

log = logging.getLogger("spmd.data")

INDEX_NAME = ".spmd_index.json"
INDEX_VERSION = 1
STAMP_BLOCK = 64 * 1024     # content_stamp hashes a file's first and last STAMP_BLOCK bytes
FRESH_S = 1.0               # a member modified this recently is looked at twice ...
SETTLE_S = 0.1              # ... this far apart, before it is indexed
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

_MEMO: dict[tuple[str, int], FileIndex] = {}   # validated indexes of this process
_MEMO_LOCK = threading.Lock()


@dataclass(frozen=True)
class Member:
    """One store of a dataset: where it is and, for a multi-file dataset, what it holds."""

    path: Path
    name: str                                     # relative to the index's base directory
    format: str
    datasets: dict[str, tuple[tuple[int, ...], str]] | None = None   # None: single store
    stamp: dict[str, int] | None = None           # size and mtime when indexed


@dataclass(frozen=True)
class FileIndex:
    """The members of a dataset; `cache` is the index file (None for a single store)."""

    pattern: str
    members: tuple[Member, ...]
    cache: Path | None

    @property
    def multi(self) -> bool:
        return self.cache is not None


def has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def data_exists(path: str | Path) -> bool:
    """Whether `data.path` names something on disk (a glob: at least one match)."""
    text = str(path)
    return bool(glob.glob(text, recursive=True)) if has_magic(text) else Path(text).exists()


def _glob_base(pattern: str) -> Path:
    parts = Path(pattern).parts
    fixed = []
    for part in parts:
        if has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def resolve(path: str | Path, where: str) -> tuple[list[Path], Path, Path | None]:
    """(member paths in order, base directory, index file or None for a single store)."""
    text = str(path)
    if has_magic(text):
        base = _glob_base(text)
        digest = hashlib.sha1(text.encode()).hexdigest()[:10]
        matches = [Path(p) for p in sorted(glob.glob(text, recursive=True))   # not the
                   if not Path(p).name.endswith(".json")]      # index or the statistics
        if not matches:
            raise ArrayDataError(f"{where}: the glob matches no file on this host (with "
                                 f"several nodes the files must be on a file system every "
                                 f"rank sees)")
        return matches, base, base / f".spmd_index-{digest}.json"
    p = Path(text)
    if p.is_dir() and detect_format(p) == "npy":
        members = sorted((c for c in p.iterdir() if is_member_name(c)), key=lambda c: c.name)
        if members:
            return members, p, p / INDEX_NAME
    return [p], p.parent, None


def load_index(path: str | Path, where: str) -> FileIndex:
    """The dataset's members; for several, the validated (or newly built) cached index."""
    members, base, cache = resolve(path, where)
    if cache is None:
        check_complete(members[0], where)
        return FileIndex(str(path), (Member(members[0], members[0].name,
                                            detect_format(members[0])),), None)
    try:
        key = (str(cache.resolve()), cache.stat().st_mtime_ns)
    except OSError:
        key = None
    index = None
    if key is not None:
        with _MEMO_LOCK:
            if key in _MEMO and _MEMO[key].pattern == str(path):
                index = _MEMO[key]
    if index is None:
        index = _read_cache(cache, str(path), base, where)
    elif not index_changes(index, members, base):
        return index                          # this process's, and the files still match
    if index is not None:
        changes = index_changes(index, members, base)
        if changes:
            _warn_rebuild(index, changes, where)
            index = None
    if index is None:
        index = build_index(path, members, base, cache, where)
    try:
        key = (str(cache.resolve()), cache.stat().st_mtime_ns)
    except OSError:
        return index
    with _MEMO_LOCK:
        _MEMO[key] = index
    return index


def _read_cache(cache: Path, pattern: str, base: Path, where: str) -> FileIndex | None:
    try:
        doc = json.loads(cache.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s: index %s unreadable (%s): building it again", where, cache, e)
        return None
    if doc.get("version") != INDEX_VERSION or doc.get("pattern") != pattern:
        return None
    try:
        members = tuple(Member(base / m["name"], m["name"], m["format"],
                               {k: (tuple(v[0]), v[1]) for k, v in m["datasets"].items()},
                               dict(m["stamp"]))
                        for m in doc["members"])
    except (KeyError, TypeError, IndexError) as e:
        log.warning("%s: index %s malformed (%s): building it again", where, cache, e)
        return None
    return FileIndex(pattern, members, cache)


def index_changes(index: FileIndex, paths: list[Path], base: Path) -> list[str]:
    """What differs between the cached index and the files now on disk, one phrase per
    member ("file F changed (size a -> b, mtime_ns c -> d)", "file F is gone", "file F is
    new"); empty when the index matches."""
    stamps: dict[str, Any] = {m.name: m.stamp for m in index.members}
    now = {_rel(p, base) for p in paths}
    out = []
    for member in index.members:
        if member.name not in now or not member.path.exists():
            out.append(f"file {member.path} is gone")
            continue
        have, had = fingerprint(member.path), dict(stamps[member.name] or {})
        if have != had:
            diff = ", ".join(f"{k} {had.get(k)} -> {have.get(k)}" for k in sorted(have)
                             if had.get(k) != have.get(k))
            out.append(f"file {member.path} changed ({diff})")
    out += [f"file {base / n} is new" for n in sorted(now - set(stamps))]
    return out


def _warn_rebuild(index: FileIndex, changes: list[str], where: str) -> None:
    what = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5
                                     else "")
    log.warning(
        "%s: the files no longer match their index %s: %s. Indexing them again: the "
        "dataset's records and their global order change with the files, so a run resumed on "
        "them would read other batches from its restored step on (a resumed run stops with an "
        "error naming the file unless data.allow_changed=true; a new run is unaffected)",
        where, index.cache, what)


def _rel(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def build_index(path: str | Path, members: list[Path], base: Path, cache: Path,
                where: str) -> FileIndex:
    """Open every member for its metadata and write the index beside the data (atomic; a
    read-only directory keeps it in memory only)."""
    began = time.perf_counter()
    entries, built = [], []
    stamps = settled_fingerprints(members, where)
    for p in members:
        name = _rel(p, base)
        label = f"{where}: file {p}"
        stamp = stamps[p]
        check_complete(p, label)
        store = Store(p, label)
        try:
            datasets = store.datasets()
        finally:
            store.close()
        check_unchanged(p, stamp, label, "while it was indexed (nothing was indexed)")
        entries.append({"name": name, "format": store.format, "stamp": stamp,
                        "datasets": {k: [list(s), d] for k, (s, d) in datasets.items()}})
        built.append(Member(p, name, store.format, datasets, stamp))
    doc = {"version": INDEX_VERSION, "pattern": str(path), "members": entries,
           "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname()}
    try:
        write_atomic(cache, json.dumps(doc, indent=1), durable=False)
    except OSError as e:
        log.warning("%s: cannot write the index %s (%s): kept in memory only", where, cache, e)
    log.info("%s: indexed %d files in %.1fs (%s)", where, len(members),
             time.perf_counter() - began, cache)
    return FileIndex(str(path), tuple(built), cache)


def check_unchanged(path: Path, before: dict[str, int], where: str, when: str) -> None:
    """`path`'s size and mtime are still `before` (its `fingerprint`), else an ArrayDataError
    saying the file changed `when` (e.g. "while it was indexed"): a program is writing it."""
    try:
        after = fingerprint(path)
    except OSError as e:
        raise ArrayDataError(f"{where}: the file went away {when} ({e.strerror or e}); "
                             f"rerun once it is in place") from None
    if after != before:
        diff = ", ".join(f"{k} {before.get(k)} -> {after.get(k)}" for k in sorted(after)
                         if before.get(k) != after.get(k))
        raise ArrayDataError(f"{where}: the file changed {when} ({diff}): a program is still "
                             f"writing it; rerun once the write has finished")


def settled_fingerprints(paths: list[Path], where: str) -> dict[Path, dict[str, int]]:
    """Each path's `fingerprint`; those modified within FRESH_S seconds are taken again
    SETTLE_S later (one wait for all) and must be equal: a write in progress is an error
    naming the file."""
    stamps = {p: fingerprint(p) for p in paths}
    now = time.time_ns()
    fresh = [p for p, st in stamps.items() if now - st["mtime_ns"] < FRESH_S * 1e9]
    if fresh:
        time.sleep(SETTLE_S)
        for p in fresh:
            check_unchanged(p, stamps[p], f"{where}: file {p}",
                            f"within {SETTLE_S} s of being looked at")
    return stamps


def check_complete(path: Path, where: str) -> None:
    """An HDF5 / NetCDF4 file is complete: its superblock's "open for write" flag is clear
    and the file is as long as the end-of-file address the superblock records. Files of
    other formats, and HDF5 files with a user block, pass unchecked. Raises ArrayDataError
    naming the file."""
    path = Path(path)
    try:
        if path.is_dir():
            return
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return                                   # missing: the caller's error names it
    info = superblock(head)
    if info is None:
        if 0 < len(head) < 48 and HDF5_SIGNATURE.startswith(head[:8]):
            raise ArrayDataError(f"{where}: the file ends inside its HDF5 superblock ({size} "
                                 f"bytes): it is being written or copied; rerun once it is "
                                 f"complete")
        return
    if info["open_for_write"]:
        raise ArrayDataError(
            f"{where}: the file is open for writing by another program (its HDF5 superblock "
            f"says so): wait for the write to finish and rerun; if the writer crashed, "
            f"`h5clear -s {path}` clears the flag (check the data first)")
    if size < info["eof"]:
        raise ArrayDataError(
            f"{where}: the file is shorter ({size} bytes) than its HDF5 superblock says "
            f"({info['eof']} bytes): it is truncated or still being copied; copy it again "
            f"or wait for the copy to finish")


def superblock(head: bytes) -> dict[str, Any] | None:
    """The fields of an HDF5 superblock at offset 0 that tell a complete file (version,
    open_for_write, eof: the end-of-file address), from the file's first 64 bytes; None for
    anything else (another format, a user block, a base address other than 0)."""
    if len(head) < 48 or head[:8] != HDF5_SIGNATURE:
        return None
    version = head[8]
    if version in (0, 1):
        offsets, flags = head[13], int.from_bytes(head[20:24], "little")
        at = 24 + (4 if version == 1 else 0)
    elif version in (2, 3):
        offsets, flags, at = head[9], head[11], 12
    else:
        return None
    if offsets not in (2, 4, 8) or at + 3 * offsets > len(head):
        return None
    base, _, eof = (int.from_bytes(head[at + i * offsets:at + (i + 1) * offsets], "little")
                    for i in range(3))
    if base != 0:
        return None
    return {"version": version, "open_for_write": bool(flags & 0x1), "eof": eof}


def content_stamp(path: Path) -> dict[str, Any]:
    """`fingerprint` (size, mtime) and `sha1`: a hash of a file's first and last STAMP_BLOCK
    bytes (all of a smaller one), of a Zarr store's metadata files or of each .npy file's
    first and last 4 KiB. A few reads per store: cheap for a run's start, yet a file written
    again with other values of the same size shows. A file that changes while it is hashed
    is an ArrayDataError naming it."""
    path = Path(path)
    stamp: dict[str, Any] = dict(fingerprint(path))
    digest = hashlib.sha1()
    if not path.is_dir():
        _hash_ends(digest, path, STAMP_BLOCK)
    else:
        zarr = detect_format(path) == "zarr"
        for root, dirs, names in os.walk(path):
            dirs.sort()
            for name in sorted(names):
                if (name in ZARR_METADATA) if zarr else name.endswith(".npy"):
                    full = Path(root, name)
                    digest.update(str(full.relative_to(path)).encode())
                    if zarr:
                        digest.update(full.read_bytes())
                    else:
                        _hash_ends(digest, full, 4096)
    check_unchanged(path, dict(stamp), f"data.path: file {path}", "while it was fingerprinted")
    stamp["sha1"] = digest.hexdigest()
    return stamp


def _hash_ends(digest: Any, path: Path, block: int) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(block))
        if size > block:
            f.seek(max(block, size - block))
            digest.update(f.read(block))
