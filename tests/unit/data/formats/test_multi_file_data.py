"""Many files as one dataset (spmd.data.formats.file_index): a file split into parts reads exactly
as
the file did, the index is cached beside the data, a process opens only the files that hold
its rows, and a changed, missing or new file is named."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from spmd.config.schema import DataConfig, MeshConfig
from spmd.data import ArrayDataError, ArraySource, BatchField, write_arrays
from spmd.data.data_config import SourceSections
from spmd.data.formats import file_index, stores
from spmd.data.formats.file_index import INDEX_NAME, data_exists
from spmd.data.loader.feed import BatchFeed
from spmd.data.order import auto_block
from spmd.engine.mesh import build_mesh
from spmd.sharding import rules_for

N, BATCH, GRID = 24, 8, 8
PARTS = (5, 7, 12)                       # rows per file: the file boundaries cut batches
FIELDS = {"u0": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None)),
          "u1": BatchField((GRID, GRID, 2), np.float32, ("batch", "x", "y", "channels"))}
SUFFIX = {"hdf5": ".h5", "zarr": ".zarr", "netcdf": ".nc", "npy": ""}


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"train/u0": rng.standard_normal((N, GRID, GRID)).astype(np.float32),
            "train/u1": rng.standard_normal((N, GRID, GRID, 2)).astype(np.float32),
            "test/u0": rng.standard_normal((6, GRID, GRID)).astype(np.float32)}


def write_parts(directory, fmt, parts=PARTS, name="part"):
    """The arrays split along the first axis into files part0, part1, ... (train only
    splits by `parts`; test goes whole into the first file and empty into the others)."""
    data, lo = arrays(), 0
    for i, n in enumerate(parts):
        piece = {k: v[lo:lo + n] for k, v in data.items() if k.startswith("train")}
        piece["test/u0"] = data["test/u0"] if i == 0 else data["test/u0"][:0]
        write_arrays(directory / f"{name}{i}{SUFFIX[fmt]}", piece, format=fmt)
        lo += n
    return directory


@pytest.fixture(autouse=True)
def new_process():
    """Each test (and each `source(...)` after a change) starts like a new process: the
    validated indexes this process keeps are forgotten."""
    file_index._MEMO.clear()


def source(path, **kw) -> ArraySource:
    file_index._MEMO.clear()
    return ArraySource(path, {"u0": "train/u0", "u1": "train/u1"}, FIELDS, BATCH,
                       **{"seed": 7, **kw})


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return write_arrays(tmp_path_factory.mktemp("single") / "all.h5", arrays())


@pytest.fixture(scope="module", params=["hdf5", "zarr", "netcdf"])
def parts(request, tmp_path_factory):
    return write_parts(tmp_path_factory.mktemp(f"parts-{request.param}"), request.param)


@pytest.mark.parametrize("shuffle", [True, False])
def test_parts_read_exactly_as_the_single_file(parts, single, shuffle):
    whole, split = source(single, shuffle=shuffle), source(parts, shuffle=shuffle)
    assert split.count == whole.count == N
    for step in (0, 1, 2, 3, 5):                 # 3 steps per epoch: across epochs too
        assert split.record_indices(step, 0, BATCH) == whole.record_indices(step, 0, BATCH)
        for lo, hi in ((0, BATCH), (0, 3), (3, 8)):
            got, want = split.rows(step, lo, hi), whole.rows(step, lo, hi)
            for name in FIELDS:
                np.testing.assert_array_equal(got[name], want[name])
    region = {"u0": ((2, 6), (0, 4), (0, 1)), "u1": ((2, 6), (0, 4), (0, 2))}
    got, want = split.rows(4, 0, BATCH, region), whole.rows(4, 0, BATCH, region)
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], want[name])
    assert split.bytes_read  # counted per process


def test_the_index_is_cached_beside_the_data_and_members_open_lazily(tmp_path):
    write_parts(tmp_path, "hdf5")
    first = source(tmp_path, shuffle=False)
    assert first.count == N
    doc = json.loads((tmp_path / INDEX_NAME).read_text())
    assert [m["name"] for m in doc["members"]] == ["part0.h5", "part1.h5", "part2.h5"]
    assert doc["members"][1]["datasets"]["train/u1"][0] == [7, GRID, GRID, 2]

    stores.OPENED.clear()
    src = source(tmp_path, shuffle=False)                  # a new process: index from cache
    assert src.count == N and not stores.OPENED            # nothing opened to validate
    got = src.rows(0, 0, 4)                                # records 0..3: all in part0
    assert src.opened_files == [str(tmp_path / "part0.h5")]
    assert dict(stores.OPENED) == {str(tmp_path / "part0.h5"): 1}
    np.testing.assert_array_equal(got["u1"], arrays()["train/u1"][:4])
    src.rows(0, 4, 8)                                      # records 4..7: part0 and part1
    assert src.opened_files == [str(tmp_path / f"part{i}.h5") for i in (0, 1)]
    assert src.reads_by_file == {str(tmp_path / "part0.h5"): 2 * 5,
                                 str(tmp_path / "part1.h5"): 2 * 3}
    assert src.files_for(2, 0, BATCH) == [str(tmp_path / "part2.h5")]   # records 16..23


def test_shuffled_rows_open_only_the_files_that_hold_them(tmp_path):
    write_parts(tmp_path, "zarr", parts=(4,) * 6)
    source(tmp_path).check()                               # the index, built once
    for lo, hi in ((0, 2), (2, 4), (4, 8)):                 # "processes" with their rows
        src = source(tmp_path)
        for step in (0, 1):
            src.rows(step, lo, hi)
        want = sorted({f for step in (0, 1) for f in src.files_for(step, lo, hi)})
        assert sorted(src.opened_files) == want and len(want) <= 2 * (hi - lo)
        assert sum(src.reads_by_file.values()) == 2 * (hi - lo) * len(FIELDS)


def test_few_open_files_at_once(tmp_path):
    write_parts(tmp_path, "hdf5", parts=(3,) * 8)
    src = source(tmp_path, max_open=2, shuffle=False)
    for step in range(3):
        src.rows(step, 0, BATCH)
    assert len(src._stores) <= 2 and len(set(src.opened_files)) == 8


@pytest.mark.parametrize("change", ["changed", "missing", "new"])
def test_a_changed_missing_or_new_file_is_named_and_indexed_again(tmp_path, change, caplog):
    write_parts(tmp_path, "hdf5")
    source(tmp_path).check()
    part1 = tmp_path / "part1.h5"
    if change == "changed":
        write_arrays(part1, {k: v[:7] + 1 for k, v in arrays().items()})
        os.utime(part1, ns=(1, 1))
    elif change == "missing":
        part1.unlink()
    else:
        shutil.copy(part1, tmp_path / "part3.h5")
    with caplog.at_level("WARNING", logger="spmd.data"):
        count = source(tmp_path).count                     # indexed again, with a warning
    msg = caplog.text
    assert f"data.path={tmp_path}" in msg and INDEX_NAME in msg
    assert str(tmp_path / ("part3.h5" if change == "new" else "part1.h5")) in msg
    assert {"changed": "changed (", "missing": "is gone", "new": "is new"}[change] in msg
    assert "data.allow_changed" in msg
    assert count == N + (7 if change == "new" else 0) - (7 if change == "missing" else 0)


def test_a_glob_of_files_in_several_directories(tmp_path, single):
    for i in range(len(PARTS)):                             # run0/out.h5, run1/out.h5, ...
        data = {k: v[sum(PARTS[:i]):sum(PARTS[:i + 1])] for k, v in arrays().items()
                if k.startswith("train")}
        write_arrays(tmp_path / f"run{i}" / "out.h5", data)
    pattern = tmp_path / "run*" / "out.h5"
    assert data_exists(pattern) and not data_exists(tmp_path / "nope*" / "out.h5")
    src = source(pattern)
    np.testing.assert_array_equal(src.rows(3, 0, BATCH)["u1"],
                                  source(single).rows(3, 0, BATCH)["u1"])
    assert len(list(tmp_path.glob(".spmd_index-*.json"))) == 1
    with pytest.raises(ArrayDataError, match="matches no file"):
        source(tmp_path / "nope*.h5").check()


def test_a_glob_of_npy_directories(tmp_path, single):
    write_parts(tmp_path, "npy", name="p")
    src = source(tmp_path / "p*")
    assert src.files.multi and src.files.members[0].format == "npy"
    np.testing.assert_array_equal(src.rows(1, 0, BATCH)["u0"],
                                  source(single).rows(1, 0, BATCH)["u0"])


def test_errors_name_the_file_the_dataset_and_the_key(tmp_path):
    write_parts(tmp_path, "hdf5")
    src = ArraySource(tmp_path, {"u0": "train/u0", "u1": "train/v"}, FIELDS, BATCH)
    with pytest.raises(ArrayDataError) as e:
        src.check()
    msg = str(e.value)
    assert f"file {tmp_path / 'part0.h5'}" in msg and "'train/v'" in msg
    assert "data.fields.u1" in msg and f"data.path={tmp_path}" in msg
    write_arrays(tmp_path / "part1.h5", {"train/u0": np.zeros((7, GRID, 4), np.float32),
                                         "train/u1": arrays()["train/u1"][:7]})
    (tmp_path / INDEX_NAME).unlink()
    with pytest.raises(ArrayDataError) as e:
        source(tmp_path).check()
    assert f"file {tmp_path / 'part1.h5'}" in str(e.value) and "(7, 8, 4)" in str(e.value)


def test_config_path_may_be_a_directory_or_a_glob(tmp_path):
    write_parts(tmp_path, "hdf5")
    for path in (tmp_path, tmp_path / "part*.h5"):
        cfg = SourceSections(DataConfig(path=path, prefetch=3, read_threads=2,
                                        shuffle_block=4, shuffle_mix=3),
                             batch_size=BATCH, steps=5)
        src = ArraySource.from_sections(cfg, "train", FIELDS, {"u0": "{split}/u0",
                                                             "u1": "{split}/u1"}, shuffle=True)
        assert src.count == N and (src.prefetch, src.read_threads) == (3, 2)
        assert src.prefetch_until == 5 and src.shuffle_block == 4
        assert type(src.index).__name__ == "BlockOrder"
        assert (src.index.block, src.index.mix) == (4, 3)
    for block, kind in (("full", "EpochOrder"), (None, "EpochOrder"), ("auto", "BlockOrder")):
        cfg = SourceSections(DataConfig(path=tmp_path, shuffle_block=block), BATCH)
        src = ArraySource.from_sections(cfg, "train", FIELDS, {"u0": "{split}/u0",
                                                             "u1": "{split}/u1"}, shuffle=True)
        assert type(src.index).__name__ == kind, block
    assert src.index.block == auto_block(src.record_bytes) and src.index.mix == 16
    with pytest.raises(ArrayDataError, match="a glob names many files"):
        write_arrays(tmp_path / "x*.h5", arrays())


def test_feed_batches_from_parts_equal_those_of_the_single_file(tmp_path, single):
    """8 CPU devices, `spatial` (slabs) and `dp`: the global batches are the same."""
    write_parts(tmp_path, "zarr")
    for strategy, axes in (("dp", {}), ("spatial", {"context": 4, "tensor": 2})):
        mesh = build_mesh(MeshConfig(strategy=strategy, axes=axes), jax.devices())
        feed = BatchFeed(FIELDS, BATCH, mesh, rules_for(strategy))
        for step in (0, 4):
            a = feed.global_batch(source(tmp_path), step)
            b = feed.global_batch(source(single), step)
            for name in FIELDS:
                np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
