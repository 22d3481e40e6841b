"""`spmd data stats CONFIG` on a directory of 6 HDF5 parts (examples/vit2d's task, the first
40 of 48 records): one process, and 2 ranks (`spmd run -n 2 --entry "data stats"`,
through mpiexec) that exchange partial statistics.
Both store NumPy's per-channel statistics of the concatenated data beside it, and each of
the 2 ranks opens only the 3 files that hold its 20 records (its log line says which)."""

from __future__ import annotations

import json
import re

import numpy as np

from spmd.data import write_arrays
from tests.helpers.env import clean_env, mpiexec_path, run_spmd

PARTS, PER, ROWS, GRID = 6, 8, 40, 8


def dataset(tmp_path):
    """train/f with a stored channel axis of 1, train/u without one."""
    rng = np.random.default_rng(11)
    data = {"train/f": (3.0 + 2.0 * rng.standard_normal((PARTS * PER, GRID, GRID, 1))
                        ).astype(np.float32),
            "train/u": (-1.0 + 0.5 * rng.standard_normal((PARTS * PER, GRID, GRID))
                        ).astype(np.float32)}
    parts = tmp_path / "parts"
    for i in range(PARTS):
        write_arrays(parts / f"part{i}.h5", {k: v[i * PER:(i + 1) * PER] for k, v in data.items()})
    config = tmp_path / "config.yaml"
    config.write_text(
        "task: examples.vit2d.task:ViTTask\n"
        f"model: {{grid: {GRID}, patch: 4, embed: 8, heads: 2, mlp: 8, depth: 1}}\n"
        f"data: {{source: hdf5, path: {parts}, num_train: {ROWS}, num_test: 8}}\n"
        "train: {batch_size: 8}\n"
        "launch: {init_timeout_s: 60, barrier_timeout_s: 60}\n")
    return data, parts, config


def check_stored(parts, data):
    stored = json.loads((parts / "stats.json").read_text())["datasets"]
    assert sorted(stored) == ["train/f", "train/u"]
    for name, entry in stored.items():
        values = data[name][:ROWS].astype(np.float64).ravel()
        assert entry["split"] == "train" and entry["rows"] == ROWS
        assert entry["count"] == [values.size]
        for key, want in (("mean", values.mean()), ("std", values.std()),
                          ("min", values.min()), ("max", values.max())):
            np.testing.assert_allclose(entry[key], [want], rtol=1e-6, err_msg=f"{name} {key}")
    return stored


def test_data_stats_on_one_and_on_two_ranks(tmp_path):

    data, parts, config = dataset(tmp_path)
    one = run_spmd("data", "stats", str(config), "--json", env=clean_env(), timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    printed = json.loads(one.stdout)
    assert printed["file"] == str(parts / "stats.json")
    first = check_stored(parts, data)
    assert printed["datasets"] == first
    assert "opened 5 file(s)" in one.stderr            # records [0, 40): parts 0 .. 4

    mpiexec_path()
    (parts / "stats.json").unlink()
    two = run_spmd("run", "-n", "2", "--entry", "data stats", str(config), timeout=180,
                   env=clean_env(JAX_NUM_CPU_DEVICES="1"))
    assert two.returncode == 0, two.stdout + two.stderr
    assert "statistics of split train" in two.stdout and "train/f" in two.stdout
    second = check_stored(parts, data)
    for name in first:
        for key in ("mean", "std", "min", "max"):
            np.testing.assert_allclose(second[name][key], first[name][key], rtol=1e-12)
    shares = {}
    for line in two.stderr.splitlines():
        m = re.search(r"rank (\d) of 2: records (\[\d+, \d+\)) .* opened (\d) file\(s\): (.*)",
                      line)
        if m:
            shares[int(m[1])] = (m[2], int(m[3]), [p.rsplit("/", 1)[1] for p in
                                                   m[4].split(", ")])
    assert shares == {0: ("[0, 20)", 3, ["part0.h5", "part1.h5", "part2.h5"]),
                      1: ("[20, 40)", 3, ["part2.h5", "part3.h5", "part4.h5"])}, two.stderr
