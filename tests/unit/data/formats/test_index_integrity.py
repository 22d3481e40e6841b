"""Integrity of the files spmd indexes (spmd.data.formats.file_index, spmd.data.stats.run_inputs).

- A NetCDF4 / HDF5 file that a writer (another process) still has open, or one cut short
  (a copy in progress), is refused by name, as a single store and as a member; nothing is
  indexed, and once the write is done the next look indexes it.
- A file that changes while it is indexed is an error naming it.
- An index that no longer matches its files is built again with a warning saying what
  changed and what it does to a resumed run; a resumed run still refuses changed data unless
  data.allow_changed is set (spmd.data.stats.run_inputs).

Fixtures are written with xarray, netCDF4 and h5py, not spmd's writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from spmd.data import ArrayDataError
from spmd.data.formats.file_index import (
    check_complete,
    check_unchanged,
    content_stamp,
    load_index,
    superblock,
)
from spmd.data.formats.stores import fingerprint
from spmd.data.stats.run_inputs import check_run_inputs
from tests.helpers.env import clean_env, run_spmd

xr = pytest.importorskip("xarray")

# A writer in another process: it creates the file, writes half of it, syncs, says "ready"
# on stdout and keeps the file open until its stdin closes; then it writes the rest.
WRITER = """
import sys, numpy as np, netCDF4
ds = netCDF4.Dataset(sys.argv[1], "w")
ds.createDimension("time", None)
ds.createDimension("latitude", 4)
ds.createDimension("longitude", 5)
v = ds.createVariable("t2m", "f4", ("time", "latitude", "longitude"))
v[:3] = np.ones((3, 4, 5), "f4")
ds.sync()
print("ready", flush=True)
sys.stdin.read()
v[3:6] = np.ones((3, 4, 5), "f4")
ds.close()
"""


def year(path: Path, start: str, steps: int = 6, seed: int = 0) -> Path:
    """An ERA5-like yearly file (time, latitude, longitude), written by xarray."""
    rng = np.random.default_rng(seed)
    times = np.datetime64(start) + np.arange(steps) * np.timedelta64(6, "h")
    ds = xr.Dataset({"t2m": (("time", "latitude", "longitude"),
                             rng.normal(280, 5, (steps, 4, 5)).astype(np.float32))},
                    coords={"time": times, "latitude": [60.0, 30.0, 0.0, -30.0],
                            "longitude": np.arange(5) * 72.0})
    ds.to_netcdf(path, engine="netcdf4")
    return path


@pytest.fixture
def writer(tmp_path):
    """Start WRITER on a path; returns (start(path) -> process, finish(process))."""
    procs = []

    def start(path: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=clean_env(compile_cache=False))
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    def finish(proc: subprocess.Popen) -> None:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0

    yield start, finish
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_superblock_tells_an_open_file_from_a_closed_one(tmp_path):
    path = tmp_path / "a.h5"
    f = h5py.File(path, "w")
    f["x"] = np.zeros((10, 10))
    f.flush()
    head = path.read_bytes()[:64]
    assert superblock(head)["open_for_write"]
    with pytest.raises(ArrayDataError, match=r"a\.h5.*open for writing by another program"):
        check_complete(path, f"data.path={path}")
    f.close()
    info = superblock(path.read_bytes()[:64])
    assert not info["open_for_write"] and info["eof"] == path.stat().st_size
    check_complete(path, "data.path")
    assert superblock(b"CDF\x01" + bytes(60)) is None          # NetCDF3: not checked


def test_a_netcdf_file_being_written_is_refused_and_indexed_when_done(tmp_path, writer):
    start, finish = writer
    data = tmp_path / "era5"
    data.mkdir()
    year(data / "2000.nc", "2000-01-01")
    proc = start(data / "2001.nc")
    pattern = str(data / "*.nc")
    for path in (pattern, data / "2001.nc"):                   # a glob, and the file alone
        with pytest.raises(ArrayDataError) as e:
            load_index(path, f"data.path={path}")
        assert str(data / "2001.nc") in str(e.value) and "open for writing" in str(e.value)
    assert not list(data.glob(".spmd_index-*.json"))           # nothing was half-indexed
    finish(proc)
    members = load_index(pattern, "data.path").members
    assert [m.datasets["t2m"][0][0] for m in members] == [6, 6]


@pytest.mark.slow
def test_spmd_data_info_on_a_file_being_written_exits_non_zero(tmp_path, writer):
    """The CLI, as a user runs it, on a directory where one file is still being written."""
    start, finish = writer
    parts = tmp_path / "parts"
    parts.mkdir()
    with h5py.File(parts / "part0.h5", "w") as f:
        f["train/f"] = np.zeros((8, 8, 8, 1), np.float32)
    config = tmp_path / "config.yaml"
    config.write_text("task: examples.vit2d.task:ViTTask\n"
                      "model: {grid: 8, patch: 4, embed: 8, heads: 2, mlp: 8, depth: 1}\n"
                      f"data: {{source: hdf5, path: {parts}, num_train: 8, num_test: 8}}\n")
    proc = start(parts / "part1.nc")
    out = run_spmd("data", "info", str(config), timeout=120)
    finish(proc)
    assert out.returncode != 0, out.stdout
    assert str(parts / "part1.nc") in out.stderr and "open for writing" in out.stderr


def test_a_file_cut_short_is_refused(tmp_path):
    whole = year(tmp_path / "whole.nc", "2000-01-01", steps=40)
    cut = tmp_path / "cut.nc"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ArrayDataError, match=r"cut\.nc: the file is shorter .* still being "
                                             r"copied"):
        load_index(cut, f"data.path={cut}")
    assert load_index(whole, "data.path").members[0].path == whole
    cut.write_bytes(whole.read_bytes()[:20])                   # not even a whole superblock
    with pytest.raises(ArrayDataError, match=r"cut\.nc: the file ends inside its HDF5 "
                                             r"superblock \(20 bytes\)"):
        load_index(cut, f"data.path={cut}")


def test_a_file_that_changes_while_it_is_indexed_is_named(tmp_path):
    data = tmp_path / "era5"
    data.mkdir()
    year(data / "2000.nc", "2000-01-01")
    path = year(data / "2001.nc", "2001-01-01")

    def touch():                      # the writer's next write, while the index looks
        time.sleep(0.02)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**6))

    thread = threading.Thread(target=touch)
    thread.start()
    try:
        with pytest.raises(ArrayDataError, match=r"2001\.nc: the file changed within .* "
                                                 r"still writing it"):
            load_index(str(data / "*.nc"), "data.path")
    finally:
        thread.join()
    assert not list(data.glob(".spmd_index-*.json"))


def test_a_change_between_two_looks_is_named(tmp_path):
    """What content_stamp, the index and the statistics check after reading a store: a Zarr
    store (its metadata files) or a file whose size or mtime moved."""
    path = tmp_path / "store.zarr"
    xr.Dataset({"t2m": (("time",), np.arange(4.0))}).to_zarr(path, consolidated=False)
    stamp = content_stamp(path)
    assert stamp["files"] >= 2 and len(stamp["sha1"]) == 40
    before = fingerprint(path)
    check_unchanged(path, before, "data.path", "while it was read")     # unchanged: passes
    xr.Dataset({"t2m": (("time",), np.arange(6.0))}).to_zarr(path, mode="w", consolidated=False)
    with pytest.raises(ArrayDataError, match=r"changed while it was read \(mtime_ns"):
        check_unchanged(path, before, f"data.path: file {path}", "while it was read")


def test_a_stale_index_is_rebuilt_with_a_warning_and_a_resumed_run_is_told(tmp_path, caplog):
    data = tmp_path / "era5"
    data.mkdir()
    year(data / "2000.nc", "2000-01-01")
    year(data / "2001.nc", "2001-01-01")
    pattern = str(data / "*.nc")
    where = f"data.path={pattern}"
    assert len(load_index(pattern, where).members) == 2
    cfg = SimpleNamespace(source="netcdf", path=pattern, allow_changed=False)
    run = tmp_path / "run"
    run.mkdir()
    check_run_inputs(cfg, run, None, True)                      # the run's first job

    year(data / "2001.nc", "2001-01-01", steps=9, seed=1)        # a year rewritten, longer
    year(data / "2002.nc", "2002-01-01")                         # and a new one
    with caplog.at_level("WARNING", logger="spmd.data"):
        index = load_index(pattern, where)
    assert [m.datasets["t2m"][0][0] for m in index.members] == [6, 9, 6]
    text = caplog.text
    assert f"{data / '2001.nc'} changed (mtime_ns" in text and "size" in text
    assert f"{data / '2002.nc'} is new" in text
    assert "a run resumed on them would read other batches" in text
    assert "data.allow_changed=true" in text
    cache = next(data.glob(".spmd_index-*.json"))
    assert len(json.loads(cache.read_text())["members"]) == 3    # the file on disk too
    caplog.clear()
    with caplog.at_level("WARNING", logger="spmd.data"):
        assert len(load_index(pattern, where).members) == 3
    assert "no longer match" not in caplog.text                  # rebuilt once

    with pytest.raises(ArrayDataError, match=r"2001\.nc changed .*data\.allow_changed=true"):
        check_run_inputs(cfg, run, 10, True)                     # a resumed job refuses
    cfg.allow_changed = True
    with caplog.at_level("WARNING", logger="spmd.data"):
        check_run_inputs(cfg, run, 10, True)                     # or trains on, warned
    assert "steps from 10 on train on the new data" in caplog.text
