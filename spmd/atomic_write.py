"""One way to replace a file whole: a temporary sibling, then rename(2), durable on request.

Why: a file that another rank, a later job or a person may open at any moment must never be
seen half written, and a kill at any moment must leave the old content or the new one, never
a mix. The temporary file's name matters as much: made of the pid alone, it lets two ranks
on two hosts of one shared file system (every rank keeps a run's normalization) or two
threads of one process write into the same temporary file and rename a mix of both.

What: `write_atomic(path, data, durable=...)` writes `bytes`, or `str` as UTF-8;
`atomic_path(path, durable=...)` yields the temporary path to a writer that needs a path of
its own (h5py, zarr, a directory of .npy files) and renames what it left there into place
when the block ends without an error. `fsync_dir` makes a rename in a directory durable.

Invariants:
- The temporary sibling is `.<name>.tmp-<host>-<pid>-<thread>`: in `path`'s own directory
  (the rename never crosses file systems), hidden (a glob of the data, `*.h5` or
  `status-*`, never meets it), and unique per host, process and thread, so writers of one
  path at the same time each rename a whole file of their own; the last rename wins. A
  leftover of that very name (a killed process whose pid and thread id came back) is
  removed first.
- On any failure before the rename (an exception, KeyboardInterrupt included) the temporary
  file or tree is removed, `path` keeps its old content, and the error is raised: whether it
  is fatal is the caller's business (a best-effort writer catches OSError and warns).
- `durable` is the caller's explicit choice, never a default. True: the temporary file is
  fsynced before the rename and the directory after it, so once the call returns a crash of
  the node leaves the new content (checkpoints, records a later job trusts; a directory
  written through `atomic_path` gets its own entries fsynced, not its files'). False: no
  fsync (the rename is still atomic for every reader; copies, caches, statuses that can be
  written again).
- It imports only the standard library and nothing of spmd, so every layer may import it,
  `spmd.launch` (whose rank shim loads no jax or numpy) and `spmd.sharding` included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "fsync_dir", "temporary_sibling", "write_atomic"]


def temporary_sibling(path: str | os.PathLike[str]) -> Path:
    """The temporary name `path` is written under by this host, process and thread."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
                          f"{threading.get_native_id()}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or new entry in directory `path` durable (a no-op where directories cannot
    be opened or fsynced: the rename is atomic all the same)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(tmp: Path) -> None:
    """Remove what is at `tmp` (a file or a tree), if anything; never raises."""
    with contextlib.suppress(OSError):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def _fsync(tmp: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool) -> Iterator[Path]:
    """Yield the temporary sibling of `path` to write (a file or a directory tree); when the
    block ends without an error, rename it to `path` (fsynced first and the directory after
    when `durable`); on an error, remove it and raise."""
    path = Path(path)
    tmp = temporary_sibling(path)
    _remove(tmp)
    try:
        yield tmp
        if durable:
            _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, durable: bool) -> None:
    """Replace `path` whole with `data` (`str` written as UTF-8) through its temporary sibling;
    `durable`: fsync the file before the rename and its directory after it."""
    with atomic_path(path, durable=durable) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
