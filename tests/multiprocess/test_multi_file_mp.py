"""Multi-file datasets under 2 real processes x 4 CPU devices: the global batches equal those
of the same data as one file (HDF5 and Zarr parts, `dp` and `spatial`), and each process
opens only the files that hold its rows and reads only its rows (or slabs)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from spmd.data import ArraySource, BatchField, write_arrays
from tests.helpers.env import REPO, clean_env, mpiexec_path

N, BATCH, GRID, PART = 48, 8, 16, 4


def test_multi_file_feed_under_two_processes(tmp_path):
    from spmd.cli.run_cmd import find_mpiexec, flavor_args

    mpiexec_path()
    rng = np.random.default_rng(1)
    data = rng.standard_normal((N, GRID, GRID)).astype(np.float32)
    single = write_arrays(tmp_path / "single.h5", {"train/f": data})
    dirs = {}
    for fmt, suffix in (("hdf5", ".h5"), ("zarr", ".zarr")):
        dirs[fmt] = tmp_path / fmt
        for i in range(N // PART):
            write_arrays(dirs[fmt] / f"part{i:02d}{suffix}",
                         {"train/f": data[i * PART:(i + 1) * PART]}, format=fmt,
                         chunks={"train/f": (1, 8, 8)})
        fields = {"f": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None))}
        ArraySource(dirs[fmt], {"f": "train/f"}, fields, BATCH).check()   # the index, once
    mpiexec = find_mpiexec()
    r = subprocess.run([str(mpiexec), "-n", "2", *flavor_args(mpiexec), sys.executable,
                        str(REPO / "tests" / "helpers" / "multi_file_worker.py"), str(single),
                        str(dirs["hdf5"]), str(dirs["zarr"]), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=clean_env(JAX_NUM_CPU_DEVICES="4", SPMD_PROCESSES_PER_NODE="1",
                                     PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    steps, example = 3, GRID * GRID * 4
    for fmt in ("hdf5", "zarr"):
        dp = [rank[f"dp/{fmt}"] for rank in ranks]
        assert [d["rows"] for d in dp] == [[0, 4], [4, 8]]
        for d in dp + [rank[f"spatial/{fmt}"] for rank in ranks]:
            assert d["equal"] == [True] * steps
            assert d["opened"] == d["needed"] == d["all_opened"]   # no other file opened
        for d in dp:                                       # only its rows, whole examples
            assert d["records"] == steps * 4 and d["bytes"] == steps * 4 * example
            assert len(d["opened"]) < N // PART
        for rank in ranks:                                 # every row, half of each example
            s = rank[f"spatial/{fmt}"]
            assert s["rows"] == [0, BATCH] and s["bytes"] == steps * BATCH * example // 2
        assert set(dp[0]["opened"]) != set(dp[1]["opened"])
