"""The generic on-disk array source (spmd.data.sources.arrays): HDF5 and .npy stores, the same
global batch for any process count, the step as the position, slab reads, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from spmd.config.schema import DataConfig
from spmd.data import ArrayDataError, ArraySource, BatchField, write_arrays
from spmd.data.data_config import SourceSections
from tests.helpers.env import REPO, clean_env, mpiexec_path

N, BATCH, GRID = 24, 8, 16
FIELDS = {"u0": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None)),
          "u1": BatchField((GRID, GRID, 2), np.float32, ("batch", "x", "y", "channels"))}


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"train/u0": rng.standard_normal((N, GRID, GRID)).astype(np.float32),  # no channel
            "train/u1": rng.standard_normal((N, GRID, GRID, 2)).astype(np.float32)}


@pytest.fixture(scope="module", params=["hdf5", "npy"])
def store(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("arrays") / ("data.h5" if request.param == "hdf5" else "data")
    write_arrays(path, arrays(), {"what": "test"}, format=request.param)
    return path


def source(path, **kw) -> ArraySource:
    return ArraySource(path, {"u0": "train/u0", "u1": "train/u1"}, FIELDS, BATCH,
                       **{"seed": 7, **kw})


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_rows_assembled_by_any_process_count_are_identical(store, processes):
    """Each "process" has its own source and reads only its rows; the concatenation is the
    one-process batch, for steps inside and across epochs (3 steps per epoch)."""
    whole = source(store)
    per = BATCH // processes
    for step in (0, 2, 3, 7):
        parts = [source(store).rows(step, p * per, (p + 1) * per) for p in range(processes)]
        full = whole.rows(step, 0, BATCH)
        for name in FIELDS:
            np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), full[name])
    assert full["u0"].shape == (BATCH, GRID, GRID, 1) and full["u1"].shape[-1] == 2


def test_rows_are_the_shuffled_records_and_each_epoch_is_a_permutation(store):
    src, data = source(store), arrays()
    epoch = sum((src.record_indices(s, 0, BATCH) for s in range(3)), [])
    assert sorted(epoch) == list(range(N)) and epoch != list(range(N))
    assert sum((src.record_indices(s, 0, BATCH) for s in range(3, 6)), []) != epoch
    rows = src.rows(4, 0, BATCH)
    for i, record in enumerate(src.record_indices(4, 0, BATCH)):
        np.testing.assert_array_equal(rows["u0"][i, ..., 0], data["train/u0"][record])
        np.testing.assert_array_equal(rows["u1"][i], data["train/u1"][record])
    assert source(store, seed=8).record_indices(0, 0, BATCH) != src.record_indices(0, 0, BATCH)
    assert source(store, shuffle=False).record_indices(3, 0, BATCH) == list(range(N))[:BATCH]


def test_a_resumed_source_continues_at_the_step(store):
    uninterrupted = [source(store).rows(s, 0, BATCH)["u1"] for s in range(8)]
    resumed = source(store)             # a fresh process restored step 5 from a checkpoint
    for step in range(5, 8):
        np.testing.assert_array_equal(resumed.rows(step, 0, BATCH)["u1"], uninterrupted[step])


def test_slab_reads_only_the_region(store):
    """region = this process's x/y range: values are the slab of the whole rows, and the
    bytes and indices read are those of the slab."""
    src, whole = source(store), source(store).rows(2, 0, 4)
    region = {"u0": ((8, 16), (0, 8), (0, 1)), "u1": ((8, 16), (0, 8), (0, 2))}
    got = src.rows(2, 0, 4, region=region)
    np.testing.assert_array_equal(got["u0"], whole["u0"][:, 8:16, 0:8])
    np.testing.assert_array_equal(got["u1"], whole["u1"][:, 8:16, 0:8])
    assert src.bytes_read == 4 * 8 * 8 * (1 + 2) * 4           # a quarter of 4 examples
    assert all(idx[:2] == (slice(8, 16), slice(0, 8)) for _, _, idx in src.last_reads)
    assert len(src.last_reads) == 4 * 2                          # one read per record, field


def test_missing_file_names_the_path_and_key(tmp_path):
    with pytest.raises(ArrayDataError, match=r"data.path=.*nowhere.h5: no such file"):
        source(tmp_path / "nowhere.h5").check()


def test_missing_dataset_names_file_dataset_and_key(store):
    src = ArraySource(store, {"u0": "train/u0", "u1": "train/v"}, FIELDS, BATCH)
    with pytest.raises(ArrayDataError) as e:
        src.check()
    assert f"data.path={store}" in str(e.value)
    assert "'train/v'" in str(e.value) and "data.fields.u1" in str(e.value)


def test_shape_mismatch_names_dataset_field_and_key(store):
    fields = {**FIELDS, "u0": BatchField((GRID, 8, 1), np.float32, ("batch", "x", "y", None))}
    src = ArraySource(store, {"u0": "train/u0", "u1": "train/u1"}, fields, BATCH)
    with pytest.raises(ArrayDataError) as e:
        src.rows(0, 0, BATCH)
    msg = str(e.value)
    assert f"data.path={store}" in msg and "'train/u0'" in msg and "data.fields.u0" in msg
    assert "(24, 16, 16)" in msg and "(16, 8, 1)" in msg


def test_config_fields_override_the_task_defaults(store):
    """data.fields.<field> (with {split}) replaces a task's default dataset path."""
    cfg = SourceSections(DataConfig(path=store, fields={"u0": "{split}/u1"}), BATCH)
    fields = {"u0": FIELDS["u1"]}
    src = ArraySource.from_sections(cfg, "train", fields, {"u0": "{split}/u0"}, shuffle=False)
    assert src.datasets == {"u0": "train/u1"}
    np.testing.assert_array_equal(src.rows(0, 0, 2)["u0"], arrays()["train/u1"][:2])
    bad = SourceSections(DataConfig(path=store, fields={"v": "x"}), BATCH)
    with pytest.raises(ArrayDataError, match=r"data.fields names \['v'\]"):
        ArraySource.from_sections(bad, "train", fields, {"u0": "{split}/u0"}, shuffle=False)


def test_feed_reads_only_each_process_slab_under_spatial(tmp_path):
    """2 real processes x 4 CPU devices, `spatial` over x and y: the global batch built from
    slabs equals the file's rows and equals the one built from whole examples (the feed's
    path for sources without slabs), and the two ranks together read one batch's bytes."""
    from spmd.cli.run_cmd import find_mpiexec, flavor_args

    mpiexec_path()
    rng = np.random.default_rng(1)
    data = write_arrays(tmp_path / "f.h5", {"train/f": rng.standard_normal(
        (12, GRID, GRID)).astype(np.float32)})
    mpiexec = find_mpiexec()
    r = subprocess.run([str(mpiexec), "-n", "2", *flavor_args(mpiexec), sys.executable,
                        str(REPO / "tests" / "helpers" / "feed_worker.py"), str(data),
                        str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=clean_env(JAX_NUM_CPU_DEVICES="4", SPMD_PROCESSES_PER_NODE="1",
                                     PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    batch_bytes = 2 * 4 * GRID * GRID * 4                 # 2 steps x 4 rows x 16 x 16 float32
    for rank in ranks:
        assert rank["slab_equal"] == [True, True] and rank["whole_equal"] == [True, True]
        assert rank["rows"] == [0, 4]                       # no data axis: every rank, all rows
        assert rank["whole_bytes"] == batch_bytes
        assert rank["slab_bytes"] == batch_bytes // 2
    assert ranks[0]["region"] != ranks[1]["region"]
    assert sum(r["slab_bytes"] for r in ranks) == batch_bytes   # disjoint slabs
