"""spmd.atomic_write: a file is replaced whole or not at all, by any number of writers at once,
with no temporary file left behind, and fsynced exactly when the caller asks."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading

import pytest

from spmd.atomic_write import atomic_path, temporary_sibling, write_atomic
from spmd.checkpoint.files import write_json_atomic
from tests.helpers.env import clean_env


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_writes_text_as_utf8_and_bytes_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "doc.json"
    write_atomic(path, "{\"µ\": 1}\n", durable=False)
    assert path.read_bytes() == "{\"µ\": 1}\n".encode()
    write_atomic(str(path), b"\x00\xff", durable=True)       # a str path too
    assert path.read_bytes() == b"\x00\xff"
    assert names(tmp_path) == ["doc.json"]


def test_the_temporary_is_a_hidden_sibling_unique_per_host_process_and_thread(tmp_path):
    path = tmp_path / "status-12"
    mine = temporary_sibling(path)
    assert mine.parent == tmp_path and mine.name.startswith(".status-12.tmp-")
    assert f"-{socket.gethostname()}-{os.getpid()}-" in mine.name
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(temporary_sibling(path)))
    thread.start()
    thread.join()
    assert theirs[0] != mine
    assert not list(tmp_path.glob("status-*"))  # what `spmd run` globs never meets it


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "stats.json"
    write_atomic(path, "old\n", durable=False)
    with pytest.raises(UnicodeEncodeError):        # the payload fails to encode, in the write
        write_atomic(path, "new \udc80", durable=True)
    assert path.read_text() == "old\n" and names(tmp_path) == ["stats.json"]
    seen = []
    with pytest.raises(RuntimeError, match="midway"), atomic_path(path, durable=True) as tmp:
        tmp.write_text("half of the new")
        seen.append(tmp.exists())
        raise RuntimeError("midway")
    assert seen == [True]
    assert path.read_text() == "old\n" and names(tmp_path) == ["stats.json"]


@pytest.mark.parametrize("fails", ["replace", "fsync"])
def test_a_failed_fsync_or_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch,
                                                                       fails):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fails, broken)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new\n", durable=True)
    monkeypatch.undo()
    assert path.read_text() == "old\n" and names(tmp_path) == ["metrics.jsonl"]


def test_a_leftover_temporary_of_the_same_name_is_replaced(tmp_path):
    """A killed writer whose host, pid and thread id came back left its temporary: a file or
    a directory (a Zarr or .npy store)."""
    path = tmp_path / "data.zarr"
    temporary_sibling(path).mkdir()
    (temporary_sibling(path) / "stale").write_text("x")
    write_atomic(path, "whole", durable=False)
    assert path.read_text() == "whole" and names(tmp_path) == ["data.zarr"]


def test_a_directory_is_written_whole_through_atomic_path_and_removed_on_failure(tmp_path):
    path = tmp_path / "arrays.npy"
    with atomic_path(path, durable=True) as tmp:
        (tmp / "group").mkdir(parents=True)
        (tmp / "group" / "x.npy").write_bytes(b"x")
    assert (path / "group" / "x.npy").read_bytes() == b"x"
    other = tmp_path / "other.npy"
    with pytest.raises(KeyboardInterrupt), atomic_path(other, durable=False) as tmp:
        (tmp / "group").mkdir(parents=True)
        (tmp / "group" / "x.npy").write_bytes(b"x")
        raise KeyboardInterrupt
    assert names(tmp_path) == ["arrays.npy"]


def test_concurrent_writers_of_one_path_each_leave_a_whole_file(tmp_path):
    """Threads writing one path at once (ranks on one node writing a run's normalization):
    a reader only ever sees one writer's whole payload, and the last rename wins whole."""
    path = tmp_path / "normalization.json"
    payloads = [bytes([65 + i]) * (150_000 + 1_000 * i) for i in range(6)]
    whole = set(payloads)
    path.write_bytes(payloads[0])
    start, done, torn, failed = threading.Barrier(len(payloads)), threading.Event(), [], []

    def writer(payload: bytes) -> None:
        start.wait()
        try:
            for _ in range(25):
                write_atomic(path, payload, durable=False)
        except Exception as e:      # one temporary name for all: another writer renamed it
            failed.append(e)

    def reader() -> None:
        while not done.is_set():
            data = path.read_bytes()
            if data not in whole:
                torn.append(len(data))

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert not failed, failed[:3]
    assert not torn, f"a reader saw a mix or a partial file: sizes {torn[:5]}"
    assert path.read_bytes() in whole
    assert names(tmp_path) == ["normalization.json"]


def fsync_recorder(monkeypatch, path):
    """Record each os.fsync as (a directory?, what `path` held at that moment)."""
    calls, real = [], os.fsync

    def fsync(fd: int) -> None:
        calls.append((stat.S_ISDIR(os.fstat(fd).st_mode),
                      path.read_bytes() if path.exists() else None))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_durable_fsyncs_the_file_before_and_the_directory_after_the_rename(tmp_path,
                                                                         monkeypatch):
    path = tmp_path / "manifest.json"
    path.write_bytes(b"old")
    calls = fsync_recorder(monkeypatch, path)
    write_atomic(path, b"new", durable=True)
    assert calls == [(False, b"old"), (True, b"new")]
    calls.clear()
    write_atomic(path, b"newer", durable=False)
    assert calls == [] and path.read_bytes() == b"newer"


def test_the_checkpoint_json_write_keeps_its_fsync_switch(tmp_path, monkeypatch):
    path = tmp_path / "index.json"
    calls = fsync_recorder(monkeypatch, path)
    write_json_atomic(path, {"step": 1})
    assert [is_dir for is_dir, _ in calls] == [False, True]
    calls.clear()
    write_json_atomic(path, {"step": 2}, fsync=False)
    assert calls == []
    assert names(tmp_path) == ["index.json"]


def test_it_imports_nothing_but_the_standard_library():
    """Every layer imports it, the rank shim (run by its file path, no jax or numpy) too."""
    code = ("import sys, spmd.atomic_write\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('spmd', 'numpy', 'jax', 'pydantic', 'yaml')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=clean_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['spmd',", "'spmd.atomic_write']"]
