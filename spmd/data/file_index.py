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
for a glob. A later run only stats the members: a member that changed, disappeared or
appeared is an error naming the file and `data.path` (the global order, and so a resumed
run's batches, would change); delete the index to accept the new files.

`content_stamp` is the finer fingerprint a run records of each of its inputs, single stores
included (spmd.data.run_inputs): size and mtime, and a hash of the bytes that change when
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

from spmd.data.stores import (
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
        return FileIndex(str(path), (Member(members[0], members[0].name,
                                            detect_format(members[0])),), None)
    try:
        key = (str(cache.resolve()), cache.stat().st_mtime_ns)
    except OSError:
        key = None
    if key is not None:
        with _MEMO_LOCK:
            if key in _MEMO and _MEMO[key].pattern == str(path):
                return _MEMO[key]
    index = _read_cache(cache, str(path), base, where)
    if index is not None:
        _validate(index, members, base, where)
    else:
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


def _validate(index: FileIndex, paths: list[Path], base: Path, where: str) -> None:
    """Every indexed member is there, unchanged, and no other member appeared."""
    stamps: dict[str, Any] = {m.name: m.stamp for m in index.members}
    remedy = (f"the dataset's global order (and a resumed run's batches) would change; if "
              f"the change is intended delete {index.cache} to index the files again")
    now = {_rel(p, base) for p in paths}
    for member in index.members:
        if member.name not in now or not member.path.exists():
            raise ArrayDataError(f"{where}: file {member.path} is in the index {index.cache} "
                                 f"but missing on this host; {remedy}")
        have = fingerprint(member.path)
        if have != stamps[member.name]:
            raise ArrayDataError(
                f"{where}: file {member.path} changed since it was indexed (size, mtime "
                f"{stamps[member.name]} -> {have}); {remedy}")
    new = sorted(now - set(stamps))
    if new:
        raise ArrayDataError(f"{where}: file(s) {[str(base / n) for n in new]} are not in the "
                             f"index {index.cache}; {remedy}")


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
    for p in members:
        name = _rel(p, base)
        stamp = fingerprint(p)
        store = Store(p, f"{where}: file {p}")
        try:
            datasets = store.datasets()
        finally:
            store.close()
        entries.append({"name": name, "format": store.format, "stamp": stamp,
                        "datasets": {k: [list(s), d] for k, (s, d) in datasets.items()}})
        built.append(Member(p, name, store.format, datasets, stamp))
    doc = {"version": INDEX_VERSION, "pattern": str(path), "members": entries,
           "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname()}
    tmp = cache.with_name(f"{cache.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, cache)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("%s: cannot write the index %s (%s): kept in memory only", where, cache, e)
    log.info("%s: indexed %d files in %.1fs (%s)", where, len(members),
             time.perf_counter() - began, cache)
    return FileIndex(str(path), tuple(built), cache)


def content_stamp(path: Path) -> dict[str, Any]:
    """`fingerprint` (size, mtime) and `sha1`: a hash of a file's first and last STAMP_BLOCK
    bytes (all of a smaller one), of a Zarr store's metadata files or of each .npy file's
    first and last 4 KiB. A few reads per store: cheap for a run's start, yet a file written
    again with other values of the same size shows."""
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
    stamp["sha1"] = digest.hexdigest()
    return stamp


def _hash_ends(digest: Any, path: Path, block: int) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(block))
        if size > block:
            f.seek(max(block, size - block))
            digest.update(f.read(block))
