"""Files a restore can trust: crc32 checksums, atomic writes (tmp, fsync, rename), JSON manifests.

Every checkpoint file this package writes is either written under a temporary name and renamed
after an fsync, or lives in a directory that is renamed into place after its contents were
fsynced; a reader never sees a half-written file under a final name. Checksums are zlib's
crc32 (about 2 GB/s on one core; hex in manifests) and, for the persistent tier, crc32c
(google-crc32c, which zarr requires: hardware crc32c, about 10 GB/s on one core).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from spmd.atomic_write import fsync_dir as fsync_dir  # re-exported for the tiers
from spmd.atomic_write import write_atomic
from spmd.checkpoint.interface import CheckpointError

READ_CHUNK = 16 << 20
MMAP_MIN = 1 << 20


class ChecksumError(CheckpointError):
    """A file whose bytes do not match its manifest; `path` names it."""

    def __init__(self, path: Path | str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = str(path)


def hex32(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def crc32(buf: Any, value: int = 0) -> int:
    """crc32 of a buffer (bytes, memoryview, contiguous numpy array), continuing from `value`."""
    return zlib.crc32(buf, value)


def crc32c(buf: Any, value: int = 0) -> int:
    """crc32c of any buffer (bytes, bytearray, memoryview, numpy array of any dtype),
    continuing from `value`: the hardware instruction over the bytes in place, no copy (a
    numpy array that is not C-contiguous is copied once, as it must be to be one buffer).

    google-crc32c copies a writable buffer (and refuses a memoryview), so it is handed a
    read-only uint8 view of the same memory.
    """
    if isinstance(buf, bytes):
        return google_crc32c.extend(value, buf)
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    view = arr.reshape(-1).view(np.uint8)
    view.flags.writeable = False
    return google_crc32c.extend(value, view)


def crc32c_file(path: Path, fsync: bool = False) -> tuple[int, int]:
    """(crc32c, bytes read) of the whole file `path`; with `fsync`, also flush it to disk."""
    value, total = 0, 0
    with open(path, "rb") as f:
        while True:
            data = f.read(READ_CHUNK)
            if not data:
                break
            value = google_crc32c.extend(value, data)
            total += len(data)
        if fsync:
            os.fsync(f.fileno())
    return value, total


def crc32_file(path: Path, offset: int = 0, nbytes: int | None = None,
               fsync: bool = False) -> tuple[int, int]:
    """(crc32, bytes read) of `nbytes` bytes of `path` from `offset` (to the end when None).

    With `fsync`, also flushes the file to stable storage (it was just written by someone else).
    Large files are checksummed through mmap (no copy into Python objects).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        end = size if nbytes is None else min(size, offset + nbytes)
        value, total = None, 0
        if end - offset >= MMAP_MIN:
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    view = memoryview(m)
                    try:
                        value, total = zlib.crc32(view[offset:end]), end - offset
                    finally:
                        view.release()
            except (OSError, ValueError):
                value = None  # a file system without mmap: read it
        if value is None:
            value, total = 0, 0
            buf = bytearray(READ_CHUNK)
            chunk = memoryview(buf)
            f.seek(offset)
            while offset + total < end:
                n = f.readinto(chunk[:min(READ_CHUNK, end - offset - total)])
                if not n:
                    break
                value = zlib.crc32(chunk[:n], value)
                total += n
        if fsync:
            os.fsync(f.fileno())
    return value, total


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def write_json_atomic(path: Path, obj: Any, *, fsync: bool = True) -> int:
    """Write `obj` as JSON atomically (spmd.atomic_write; `fsync`: durable, the file before the
    rename and its directory after it); returns the crc32 of the bytes written."""
    data = dumps(obj)
    write_atomic(path, data, durable=fsync)
    return crc32(data)


def read_json(path: Path, expect_crc: str | None = None) -> Any:
    """Parse JSON at `path`; with `expect_crc`, raise ChecksumError when its bytes differ."""
    data = path.read_bytes()
    if expect_crc is not None and hex32(crc32(data)) != expect_crc:
        raise ChecksumError(path, f"checksum {hex32(crc32(data))} != {expect_crc} in the manifest")
    try:
        return json.loads(data)
    except ValueError as e:
        raise ChecksumError(path, f"does not parse as JSON ({e})") from None


def remove_tree(path: Path) -> None:
    """Remove a directory tree (or a file) if it exists; raise if something else is in the way."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def tree_size(path: Path) -> int:
    """Bytes in the regular files under `path`."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def files_under(root: Path) -> Iterable[Path]:
    """Regular files under `root`, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def parallel_map(fn: Any, items: Sequence[Any], threads: int = 8) -> list:
    """fn over items on a few threads (numpy copies, crc32 and file I/O release the GIL)."""
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, items))
