"""A persistent step's manifest (`spmd_manifest.json`): what the tier vouches for, and its check.

A step counts as committed only when its manifest exists (spmd.checkpoint.persistent). The
manifest lists every file of the step: a TensorStore data file (`ocdbt.process_<i>/d/`, at
least `SMALL_FILE` bytes) with its size and `"check": "chunks"` (never read back: its
chunks are checked instead), every other file (Orbax's JSON metadata, OCDBT manifests and
b-tree nodes: kilobytes) with the crc32c of its bytes. Formats:

* `spmd-persistent/3` (now): besides, `"chunks"`: {item: {chunk key: crc32c}} of every
  chunk of the uncompressed items, computed from the host arrays while Orbax wrote them
  (spmd.checkpoint.chunk_sums); the chunks themselves carry none. A compressed item's
  chunks carry TensorStore's crc32c codec (as in /2) and are not listed.
* `spmd-persistent/2`: every chunk carries Zarr v3's crc32c codec, computed by TensorStore.
* `spmd-persistent/1`: a zlib crc32 of every file, data files included.

Every format is still read and checked: a data file's chunks against the crc32c they carry,
else against the manifest's (`verify_files`, `deep`).

The persistent commit's agreement carries each rank's `PersistentVote` (its files and chunk
sums) to rank 0, which writes the manifest from them and decides a `PersistentCommit`
(frozen dataclasses: spmd.comm.agreement's `Vote` and `Decision`).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd.checkpoint.chunks import check_data_file, chunk_checked, item_values
from spmd.checkpoint.files import (
    ChecksumError,
    crc32_file,
    crc32c_file,
    files_under,
    fsync_dir,
    hex32,
    parallel_map,
    read_json,
    write_json_atomic,
)
from spmd.comm.agreement import Decision, Vote, failed_votes

MANIFEST = "spmd_manifest.json"
FORMAT = "spmd-persistent/3"
FORMATS = ("spmd-persistent/1", "spmd-persistent/2", FORMAT)
SMALL_FILE = 64 << 10     # data files below this are read back and crc32c'd (b-tree nodes)
_DATA = re.compile(r"(?:^|/)ocdbt\.process_\d+/d/[^/]+$")
_OWNER = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)")


def file_owner(rel: str) -> int:
    """The process that wrote a file of an Orbax step (process-named dirs), else 0."""
    m = _OWNER.search(rel)
    return int(m.group(1)) if m else 0


def is_data_file(rel: str, nbytes: int) -> bool:
    """A TensorStore data file of an Orbax step (its values are Zarr shards of chunks)."""
    return nbytes >= SMALL_FILE and _DATA.search(rel) is not None


def checksum_files(step_dir: Path, rank: int, size: int, fsync: bool = True,
                   chunk_crc: bool = True) -> dict[str, dict]:
    """{relative path: {nbytes, crc32c | check}} of the files of `step_dir` this rank wrote.

    Fsyncs the small ones and the directories (Orbax writes its JSON metadata and renames
    without an fsync), so that the manifest, written afterwards, never vouches for data
    still only in page cache. Data files (`chunk_crc`: each chunk's crc32c is known, carried
    by the chunk or in the manifest's "chunks") are neither read nor fsynced again:
    `"check": "chunks"`; TensorStore wrote them and fsynced
    each before its write completed (its `file_io_sync`, true by default; seen with strace:
    one fsync per data file). The small files are read once for their crc32c.
    """
    mine = []
    for path in files_under(step_dir):
        rel = path.relative_to(step_dir).as_posix()
        if rel == MANIFEST or rel.startswith("."):
            continue
        owner = file_owner(rel)
        if (owner if owner < size else 0) == rank:
            mine.append((rel, path))

    def one(item: tuple[str, Path]) -> dict:
        rel, path = item
        nbytes = path.stat().st_size
        if chunk_crc and is_data_file(rel, nbytes):
            return {"nbytes": nbytes, "check": "chunks"}
        value, n = crc32c_file(path, fsync=fsync)
        return {"nbytes": n, "crc32c": hex32(value)}

    out = dict(zip((rel for rel, _ in mine), parallel_map(one, mine)))
    dirs = {path.parent for _, path in mine}
    if fsync:
        for d in sorted(dirs | {step_dir, step_dir.parent}):
            fsync_dir(d)
    return out


def verify_files(step_dir: Path, manifest: dict, rank: int, size: int,
                 deep: bool = True) -> list[str]:
    """Recheck this rank's share (every size-th file) of a manifest; problems, naming files.

    Small files: their crc32c (crc32 in format /1). Data files (`"check": "chunks"`): their
    size, and with `deep` every chunk's crc32c, read once (spmd.checkpoint.chunks): the one it
    carries, else the manifest's (format /3; rank 0 also finds chunks the manifest lists but
    the item's b-tree lost); without `deep` the chunks are left to the reader, which checks
    each chunk it reads.
    """
    share = [(rel, want) for i, (rel, want) in enumerate(sorted(manifest["files"].items()))
             if i % size == rank]
    sums: dict[str, dict[str, str]] = manifest.get("chunks") or {}
    items: dict[Path, Any] = {}   # item directory -> its values and layouts (or the problem)

    def values_of(item_dir: Path) -> Any:
        if item_dir not in items:
            try:
                items[item_dir] = chunk_checked(item_dir)
            except Exception as e:
                items[item_dir] = (f"{item_dir / 'manifest.ocdbt'}: its OCDBT database "
                                   f"cannot be read ({type(e).__name__}: {str(e)[:300]})")
        return items[item_dir]

    def check(item: tuple[str, dict]) -> str | None:
        rel, want = item
        path = step_dir / rel
        if want.get("check") == "chunks":
            try:
                n = path.stat().st_size
            except OSError as e:
                return f"{path}: cannot be read ({e.strerror or e})"
            if n != want["nbytes"]:
                return f"{path}: {n} bytes, the manifest says {want['nbytes']} bytes"
            if not deep:
                return None
            found = values_of(step_dir / rel.split("/", 1)[0])
            if isinstance(found, str):
                return found
            refs, layouts = found
            item, prefix = rel.split("/", 1) if "/" in rel else ("", rel)
            return check_data_file(path, refs.get(prefix, []), layouts, sums.get(item))
        algo = "crc32c" if "crc32c" in want else "crc32"
        try:
            value, n = (crc32c_file if algo == "crc32c" else crc32_file)(path)
        except OSError as e:
            return f"{path}: cannot be read ({e.strerror or e})"
        if n != want["nbytes"] or hex32(value) != want[algo]:
            return (f"{path}: {algo} {hex32(value)} over {n} bytes, the manifest says "
                    f"{want[algo]} over {want['nbytes']} bytes")
        return None

    if deep:   # one thread reads the b-trees of the items first (not once per file)
        for rel, want in share:
            if want.get("check") == "chunks":
                values_of(step_dir / rel.split("/", 1)[0])
    # without `deep` the share is kilobytes of small files and a stat per data file: threads
    # would cost more to start than they save
    found = parallel_map(check, share) if deep else [check(item) for item in share]
    problems = [p for p in found if p is not None]
    if deep and rank == 0:
        problems += _lost_chunks(step_dir, manifest)
    return problems


def _lost_chunks(step_dir: Path, manifest: dict) -> list[str]:
    """Chunks the manifest lists (format /3) that no item's b-tree holds any longer."""
    out = []
    for item, sums in (manifest.get("chunks") or {}).items():
        if not sums or not any(rel.startswith(f"{item}/") for rel in manifest["files"]):
            continue   # an item this check was not asked about (params_reader: one item)
        try:
            refs, inline = item_values(step_dir / item)
        except Exception as e:
            out.append(f"{step_dir / item / 'manifest.ocdbt'}: its OCDBT database cannot be "
                       f"read ({type(e).__name__}: {str(e)[:300]})")
            continue
        held = set(inline) | {key for values in refs.values() for _, _, key in values}
        lost = sorted(set(sums) - held)
        if lost:
            out.append(f"{step_dir / item / 'manifest.ocdbt'}: {len(lost)} chunk(s) the "
                       f"step's manifest lists are missing from the b-tree ({lost[0]}, ...)")
    return out





def prefetch(step_dir: Path, manifest: dict, rank: int = 0, size: int = 1) -> threading.Thread:
    """Ask the kernel to start reading this rank's share of a step's data files now
    (posix_fadvise WILLNEED, from a background thread), so that the disk reads overlap with
    the restore's planning and Orbax's metadata reads instead of following them."""
    share = [step_dir / rel for i, (rel, want) in enumerate(sorted(manifest["files"].items()))
             if i % size == rank and want.get("check") == "chunks"]

    def ahead() -> None:
        for path in share:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue   # the check that follows names it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):
                pass
            finally:
                os.close(fd)

    worker = threading.Thread(target=ahead, name="spmd-ckpt-prefetch", daemon=True)
    worker.start()
    return worker


def read_manifest(step_dir: Path) -> dict | None:
    try:
        m = read_json(step_dir / MANIFEST)
    except (OSError, ChecksumError):
        return None
    return m if isinstance(m, dict) and m.get("format") in FORMATS else None


@dataclass(frozen=True, kw_only=True)
class PersistentVote(Vote):
    """A rank's share of a persistent step: its files' manifest entries ({path: {"nbytes",
    "crc32c" or "check"}}) and its chunks' crc32c ({item: {chunk key: crc32c}}), or `ok`
    False and why."""

    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    chunks: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PersistentCommit(Decision):
    """Rank 0's commit of a persistent step: the manifest's bytes and file count, and the
    committed steps retention dropped (renamed away by rank 0). `seconds`, `orbax_s` and
    `phases` are this rank's own timings, filled in after the agreement (`finish_save`)."""

    bytes: int = 0
    files: int = 0
    drop: tuple[int, ...] = ()
    seconds: float = 0.0
    orbax_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


def write_manifest(step_dir: Path, step: int, votes: list[PersistentVote], size: int,
                   params_finite: bool | None = None) -> PersistentCommit:
    """Rank 0: the manifest from every rank's vote (its files and chunks), atomically."""
    errors = failed_votes(votes)
    if errors:
        return PersistentCommit(ok=False, errors=errors)
    files: dict[str, dict] = {}
    chunks: dict[str, dict[str, str]] = {}
    for v in votes:
        files.update(v.files)
        for item, sums in v.chunks.items():
            chunks.setdefault(item, {}).update(sums)
    nbytes = sum(f["nbytes"] for f in files.values())
    try:
        write_json_atomic(step_dir / MANIFEST, {
            "format": FORMAT, "step": step, "num_processes": size, "files": files,
            "chunks": chunks, "nbytes": nbytes, "time": time.time(),
            **({} if params_finite is None else {"params_finite": params_finite})})
    except OSError as e:
        return PersistentCommit(ok=False,
                                errors=(f"rank 0: writing {step_dir / MANIFEST} failed: {e}",))
    return PersistentCommit(bytes=nbytes, files=len(files))


