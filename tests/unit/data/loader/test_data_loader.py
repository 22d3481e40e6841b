"""The Darcy fields through the generic array source (spmd.data.sources.arrays): the same global
batch for any process count, epoch-wise shuffles, and a resumed loader that continues with
exactly the next batch."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from spmd.config.schema import MeshConfig
from spmd.data.batch import BatchField
from spmd.data.formats.field_files import field_stats, inspect_fields
from spmd.data.sources.arrays import ArraySource
from spmd.engine.mesh import build_mesh
from spmd.sharding import logical_to_spec, rules_for
from tests.helpers.fno import GRID, make_tiny_dataset

BATCH = 8
NUM_TRAIN = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("loader") / "darcy.h5")


FIELDS = {k: BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None))
          for k in ("a", "u")}


def FieldBatches(path, split, count, batch, *, seed, shuffle):  # noqa: N802 (the old name)
    return ArraySource(path, {"a": f"{split}/a", "u": f"{split}/u"}, FIELDS, batch,
                       seed=seed, shuffle=shuffle, count=count)


def source(path, seed=0, shuffle=True):
    return FieldBatches(path, "train", NUM_TRAIN, BATCH, seed=seed, shuffle=shuffle)


def feed_ranges(num_processes: int) -> list[tuple[int, int]]:
    """The rows each of `num_processes` processes would feed under `dp` on 8 devices.

    Same computation as BatchFeed's local_row_range, with the mesh's devices assigned to
    processes in blocks (the process-major order build_mesh uses).
    """
    mesh = build_mesh(MeshConfig(strategy="dp"), jax.devices())
    spec = logical_to_spec(("batch", "x", "y", None), rules_for("dp"), dict(mesh.shape),
                           activation=True)
    index_map = NamedSharding(mesh, spec).devices_indices_map((BATCH, GRID, GRID, 1))
    per_process = len(mesh.devices.flat) // num_processes
    ranges = []
    for p in range(num_processes):
        devices = list(mesh.devices.flat)[p * per_process:(p + 1) * per_process]
        rows = [index_map[d][0] for d in devices]
        ranges.append((min(r.start for r in rows), max(r.stop for r in rows)))
    return ranges


@pytest.mark.parametrize("num_processes", [1, 2, 4, 8])
def test_global_batch_is_the_same_for_any_process_count(data, num_processes):
    reference = source(data)
    ranges = feed_ranges(num_processes)
    assert ranges[0][0] == 0 and ranges[-1][1] == BATCH
    for step in (0, 3, 7):   # 4 steps per epoch: steps 3 and 7 end epochs 0 and 1
        parts = [source(data).rows(step, lo, hi) for lo, hi in ranges]   # one loader each
        whole = reference.rows(step, 0, BATCH)
        for name in ("a", "u"):
            np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), whole[name])
            assert whole[name].shape == (BATCH, GRID, GRID, 1)


def test_each_epoch_is_a_permutation_and_epochs_differ(data):
    src = source(data)
    steps_per_epoch = NUM_TRAIN // BATCH
    epochs = [
        sum((src.record_indices(s, 0, BATCH) for s in range(e * steps_per_epoch,
                                                            (e + 1) * steps_per_epoch)), [])
        for e in range(3)
    ]
    for order in epochs:
        assert sorted(order) == list(range(NUM_TRAIN))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(NUM_TRAIN))
    other_seed = FieldBatches(data, "train", NUM_TRAIN, BATCH, seed=1, shuffle=True)
    assert other_seed.record_indices(0, 0, BATCH) != src.record_indices(0, 0, BATCH)


def test_rows_are_the_records_named_by_the_shuffle(data):
    import h5py

    src = source(data)
    indices = src.record_indices(5, 2, 6)
    rows = src.rows(5, 2, 6)
    with h5py.File(data, "r") as f:
        for i, record in enumerate(indices):
            np.testing.assert_array_equal(rows["a"][i, ..., 0], f["train/a"][record])
            np.testing.assert_array_equal(rows["u"][i, ..., 0], f["train/u"][record])


def test_resumed_loader_continues_with_the_next_batch(data):
    """The loader's position is the step: a new loader at step k reads what an
    uninterrupted one reads at step k (the trainer restores k from the checkpoint)."""
    uninterrupted = source(data)
    seen = [uninterrupted.rows(step, 0, BATCH)["a"] for step in range(10)]

    before_restart = source(data)
    for step in range(6):
        np.testing.assert_array_equal(before_restart.rows(step, 0, BATCH)["a"], seen[step])
    del before_restart                      # "killed" after step 5 was consumed
    resumed = source(data)                  # a fresh process restores step 6
    for step in range(6, 10):
        np.testing.assert_array_equal(resumed.rows(step, 0, BATCH)["a"], seen[step])


def test_eval_source_walks_the_test_split_in_order(data):
    test = FieldBatches(data, "test", 8, 4, seed=0, shuffle=False)
    assert test.record_indices(0, 0, 4) == [0, 1, 2, 3]
    assert test.record_indices(1, 0, 4) == [4, 5, 6, 7]
    assert test.record_indices(2, 0, 4) == [0, 1, 2, 3]   # wraps around


def test_normalization_stats_are_the_train_split_moments(data):
    import h5py

    info = inspect_fields(data)
    stats = field_stats(info, NUM_TRAIN)
    subset = field_stats(info, 16)          # fewer samples than stored: recomputed exactly
    with h5py.File(data, "r") as f:
        for name in ("a", "u"):
            values = f[f"train/{name}"][:].astype(np.float64)
            assert stats[name].mean == pytest.approx(values.mean(), rel=1e-12)
            assert stats[name].std == pytest.approx(values.std(), rel=1e-9)
            assert subset[name].mean == pytest.approx(values[:16].mean(), rel=1e-12)
    assert stats == field_stats(inspect_fields(data), NUM_TRAIN)   # deterministic


def test_data_info_names_the_train_order(data, tmp_path):
    """`spmd data info` (Task.describe_data) says which order data.shuffle_block chose:
    auto gives blocks of 4 MiB of records (2 KiB Darcy pairs here: 2,048 a block), full a
    full shuffle."""
    from spmd.config.load import build_task, load_config
    from tests.helpers.fno import tiny_config

    path = tiny_config(tmp_path, data)
    auto = build_task(load_config(path)).describe_data()
    assert "train 32" in auto and "train order: blocks of 2,048 consecutive records, 16 at " \
        "a time" in auto, auto
    full = build_task(load_config(path, ["data.shuffle_block=full"])).describe_data()
    assert full.endswith("train order: a full shuffle of the 32 records every epoch "
                         "(grain's order)"), full
