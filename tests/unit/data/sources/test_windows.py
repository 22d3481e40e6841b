"""Trajectory windows (spmd.data.sources.windows): the windows equal a NumPy reference built by
hand,
never cross a trajectory boundary, read the same from one file or parts, in an order that
depends only on (seed, step), bit-identical through the feed with and without prefetch; a
slab read reads only the slab; errors name the key to change."""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
import zarr

from spmd.config.schema import DataConfig, MeshConfig, WindowConfig
from spmd.data import ArrayDataError, BatchField, write_arrays
from spmd.data.data_config import SourceSections
from spmd.data.formats import file_index, stores
from spmd.data.loader.feed import BatchFeed
from spmd.data.sources.windows import WindowSource
from spmd.engine.mesh import build_mesh
from spmd.sharding import rules_for

X, Y, C, BATCH = 8, 8, 2, 8
IN, OUT, STRIDE = 2, 3, 2
SPAN = IN + OUT
SUFFIX = {"hdf5": ".h5", "zarr": ".zarr", "netcdf": ".nc"}


def fields(layout: str, c: int = C, target_steps: int = OUT) -> dict[str, BatchField]:
    if layout == "channels":
        return {"u": BatchField((X, Y, IN * c), np.float32, ("batch", "x", "y", "channels")),
                "v": BatchField((X, Y, target_steps * c), np.float32,
                                ("batch", "x", "y", "channels"))}
    return {"u": BatchField((IN, X, Y, c), np.float32, ("batch", None, "x", "y", "channels")),
            "v": BatchField((target_steps, X, Y, c), np.float32,
                            ("batch", None, "x", "y", "channels"))}


def trajectory(traj: int, steps: int) -> np.ndarray:
    """Frames whose values name them: traj * 1000 + t * 10 + c, plus x / 8 + y / 64 (exact
    in float32), so every pixel of a window tells its trajectory, time step and place."""
    t, x, y, c = np.meshgrid(np.arange(steps), np.arange(X), np.arange(Y), np.arange(C),
                             indexing="ij")
    return (traj * 1000 + t * 10 + c + x / 8 + y / 64).astype(np.float32)


def decode(frame: np.ndarray) -> tuple[int, int]:
    """(trajectory, time step) of a frame (its pixel (0, 0), channel 0)."""
    value = int(frame[0, 0, 0])
    return value // 1000, (value % 1000) // 10


@pytest.fixture(autouse=True)
def new_process():
    file_index._MEMO.clear()


def traj_file(path, fmt: str, n: int, steps: int, first: int = 0, **kw):
    """One store holding trajectories first .. first+n-1 as [trajectory, time, X, Y, C]."""
    data = np.stack([trajectory(first + i, steps) for i in range(n)])
    return write_arrays(path, {"train/w": data}, format=fmt, **kw)


def per_file_dir(directory, fmt: str, lengths) -> list[np.ndarray]:
    """One trajectory [time, X, Y, C] per file, of the given lengths."""
    trajs = [trajectory(i, steps) for i, steps in enumerate(lengths)]
    for i, data in enumerate(trajs):
        write_arrays(directory / f"run{i:02d}{SUFFIX[fmt]}", {"train/w": data}, format=fmt)
    return trajs


def source(path, layout="channels", **kw) -> WindowSource:
    file_index._MEMO.clear()
    opts = {"input_name": "u", "target_name": "v", "input_steps": IN, "target_steps": OUT,
            "stride": STRIDE, "layout": layout, "seed": 7, **kw}
    return WindowSource(path, "train/w", fields(layout, target_steps=opts["target_steps"]),
                        BATCH, **opts)


def reference(trajs, layout: str) -> list[dict[str, np.ndarray]]:
    """Every window by hand: per trajectory, t0 = 0, STRIDE, ... while t0 + SPAN <= T."""
    out = []
    for data in trajs:
        for t0 in range(0, len(data) - SPAN + 1, STRIDE):
            inputs = [data[t] for t in range(t0, t0 + IN)]
            targets = [data[t] for t in range(t0 + IN, t0 + SPAN)]
            join = (lambda fs: np.concatenate(fs, axis=-1)) if layout == "channels" else np.stack
            out.append({"u": join(inputs), "v": join(targets)})
    return out


def all_windows(src: WindowSource) -> list[dict[str, np.ndarray]]:
    """Windows 0 .. count-1 in record order (shuffle=False: step s holds s*B .. s*B+B-1)."""
    got = []
    for step in range(-(-src.count // BATCH)):
        rows = src.rows(step, 0, BATCH)
        got += [{k: v[i] for k, v in rows.items()} for i in range(BATCH)]
    return got[:src.count]


@pytest.mark.parametrize("layout", ["channels", "time"])
@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_windows_of_trajectory_files_equal_the_reference(tmp_path, layout, fmt):
    path = traj_file(tmp_path / f"t{SUFFIX[fmt]}", fmt, 3, 11)       # 4 windows each
    src = source(path, layout, shuffle=False)
    want = reference([trajectory(i, 11) for i in range(3)], layout)
    assert src.count == len(want) == 12
    assert [src.window_of(r) for r in (0, 3, 4, 11)] == [
        (str(path), 0, 0), (str(path), 0, 6), (str(path), 1, 0), (str(path), 2, 6)]
    for got, ref in zip(all_windows(src), want):
        for name in ("u", "v"):
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(got[name], ref[name])
    assert src.records_read == 2 * BATCH and src.reads_by_file[str(path)] == 2 * BATCH
    assert src.last_reads[0][2][0] == slice(0, SPAN)     # window of record 8: t0 = 0


@pytest.mark.parametrize(("layout", "fmt"), [("channels", "hdf5"), ("time", "hdf5"),
                                             ("channels", "zarr"), ("time", "zarr"),
                                             ("channels", "netcdf")])
def test_one_trajectory_per_file_of_different_lengths(tmp_path, layout, fmt):
    lengths = (7, 4, 10, 5, 9)          # 2, 0 (too short), 3, 1, 3 windows
    trajs = per_file_dir(tmp_path, fmt, lengths)
    src = source(tmp_path, layout, shuffle=False)
    want = reference(trajs, layout)
    assert src.count == len(want) == 9
    assert src.window_of(2) == (str(tmp_path / f"run02{SUFFIX[fmt]}"), -1, 0)
    assert src.window_of(8) == (str(tmp_path / f"run04{SUFFIX[fmt]}"), -1, 4)
    for got, ref in zip(all_windows(src), want):
        for name in ("u", "v"):
            np.testing.assert_array_equal(got[name], ref[name])
    assert str(tmp_path / f"run01{SUFFIX[fmt]}") not in src.opened_files
    assert src.statistics_plan() == {"train/w": (True, sum(lengths))}


def test_no_window_crosses_a_trajectory_boundary(tmp_path):
    """Every window of an epoch (shuffled): its SPAN frames are consecutive steps of one
    trajectory, starting on the stride, and every window comes exactly once."""
    traj_file(tmp_path / "a.h5", "hdf5", 2, 9, first=0)       # 3 windows each
    traj_file(tmp_path / "b.h5", "hdf5", 3, 6, first=2)       # 1 window each
    src = source(tmp_path, "time")
    assert src.count == 9
    seen = []
    for step in range(-(-src.count // BATCH)):
        rows = src.rows(step, 0, BATCH)
        for i in range(BATCH):
            frames = np.concatenate([rows["u"][i], rows["v"][i]])
            ids = [decode(f) for f in frames]
            traj, t0 = ids[0]
            assert ids == [(traj, t0 + k) for k in range(SPAN)]
            assert t0 % STRIDE == 0
            seen.append((traj, t0))
    expected = {(j, t) for j in (0, 1) for t in (0, 2, 4)} | {(j, 0) for j in (2, 3, 4)}
    assert set(seen[:src.count]) == expected and len(set(seen[:src.count])) == 9


def test_parts_give_the_same_windows_as_one_file(tmp_path):
    whole = traj_file(tmp_path / "whole.zarr", "zarr", 6, 9)
    parts = tmp_path / "parts"
    for name, (lo, n) in {"p0.h5": (0, 2), "p1.h5": (2, 1), "p2.h5": (3, 3)}.items():
        traj_file(parts / name, "hdf5", n, 9, first=lo)
    a, b = source(whole), source(parts)
    assert a.count == b.count == 18
    for step in (0, 1, 2, 5):                  # across epochs too
        assert a.record_indices(step, 0, BATCH) == b.record_indices(step, 0, BATCH)
        ra, rb = a.rows(step, 0, BATCH), b.rows(step, 0, BATCH)
        for name in ("u", "v"):
            np.testing.assert_array_equal(ra[name], rb[name])
    assert [b.window_of(r) for r in (5, 6, 17)] == [
        (str(parts / "p0.h5"), 1, 4), (str(parts / "p1.h5"), 0, 0), (str(parts / "p2.h5"), 2, 4)]


def test_order_depends_only_on_seed_and_step(tmp_path):
    path = traj_file(tmp_path / "t.h5", "hdf5", 4, 9)
    one, two = source(path), source(path)
    whole = one.rows(3, 0, 8)
    halves = [two.rows(3, 0, 4), two.rows(3, 4, 8)]
    for name in ("u", "v"):
        np.testing.assert_array_equal(whole[name], np.concatenate([h[name] for h in halves]))
    assert source(path, seed=8).record_indices(3, 0, 8) != one.record_indices(3, 0, 8)
    assert sorted(one.record_indices(0, 0, 8) + one.record_indices(1, 0, 4)) == list(range(12))
    limited = source(path, count=5)
    assert limited.count == 5 and max(limited.record_indices(0, 0, 8)) < 5


def test_threads_and_pickling_read_the_same_windows(tmp_path):
    path = traj_file(tmp_path / "t.h5", "hdf5", 4, 9)
    src = source(path)
    want = [src.rows(s, 0, BATCH) for s in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda s: src.rows(s, 0, BATCH), range(4)))
    copy = pickle.loads(pickle.dumps(src))
    for s in range(4):
        for name in ("u", "v"):
            np.testing.assert_array_equal(got[s][name], want[s][name])
            np.testing.assert_array_equal(copy.rows(s, 0, BATCH)[name], want[s][name])
    assert src.records_read == 8 * BATCH


@pytest.mark.parametrize("layout", ["channels", "time"])
@pytest.mark.parametrize(("strategy", "axes"), [("dp", {}),
                                                ("spatial", {"context": 4, "tensor": 2})])
def test_feed_prefetch_on_and_off_give_identical_batches(tmp_path, layout, strategy, axes):
    """8 CPU devices under `dp` and `spatial`: the same global batches with prefetch on and
    off (3 read threads), equal to the windows read directly. (One process holds every
    device, so its region is the whole frame; slabs: test_zarr_slab_read_reads_only_the_slab.)"""
    traj_file(tmp_path / "a.zarr", "zarr", 3, 9, chunks={"train/w": (1, 1, 4, 4, C)})
    traj_file(tmp_path / "b.zarr", "zarr", 2, 7, first=3, chunks={"train/w": (1, 1, 4, 4, C)})
    flds = fields(layout)
    mesh = build_mesh(MeshConfig(strategy=strategy, axes=axes), jax.devices())
    plain = BatchFeed(flds, BATCH, mesh, rules_for(strategy), prefetch=0)
    ahead = BatchFeed(flds, BATCH, mesh, rules_for(strategy), prefetch=2, read_threads=3)
    src_plain, src_ahead = source(tmp_path, layout), source(tmp_path, layout)
    try:
        for step in range(3):
            a = plain.global_batch(src_plain, step)
            b = ahead.global_batch(src_ahead, step)
            whole = src_plain.rows(step, 0, BATCH)
            for name in flds:
                np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
                np.testing.assert_array_equal(np.asarray(a[name]), whole[name])
    finally:
        ahead.close()


class CountingStore(zarr.storage.LocalStore):
    """A local Zarr store that records the chunk keys read."""

    keys: list[str] = []

    async def get(self, key, prototype, byte_range=None):
        if "/c/" in key:
            CountingStore.keys.append(key)
        return await super().get(key, prototype, byte_range)


def test_zarr_slab_read_reads_only_the_slab(tmp_path, monkeypatch):
    """x 4:8, y 0:4 of chunks (1, 1, 4, 4, C): per window SPAN chunks of that slab only,
    one read, values the slab of the whole window."""
    path = traj_file(tmp_path / "t.zarr", "zarr", 3, 9, chunks={"train/w": (1, 1, 4, 4, C)})
    monkeypatch.setattr(stores, "open_zarr", lambda p, where: zarr.open_group(
        CountingStore(str(p), read_only=True), mode="r"))
    src, whole = source(path, "channels"), source(path, "channels")
    region = {"u": ((4, 8), (0, 4), (0, IN * C)), "v": ((4, 8), (0, 4), (0, OUT * C))}
    CountingStore.keys = []
    got = src.rows(2, 0, BATCH, region)
    assert got["u"].shape == (BATCH, 4, 4, IN * C) and got["v"].shape == (BATCH, 4, 4, OUT * C)
    assert src.bytes_read == BATCH * SPAN * 4 * 4 * C * 4 and src.records_read == BATCH
    want = set()
    for r in src.record_indices(2, 0, BATCH):
        _, row, t0 = src.window_of(r)
        want |= {f"train/w/c/{row}/{t}/1/0/0" for t in range(t0, t0 + SPAN)}
    assert set(CountingStore.keys) == want
    full = whole.rows(2, 0, BATCH)
    for name in ("u", "v"):
        np.testing.assert_array_equal(got[name], full[name][:, 4:8, 0:4])
    part = src.rows(2, 0, BATCH, {"u": ((0, 8), (0, 8), (C, 2 * C)),   # 2nd input frame
                                  "v": ((0, 8), (2, 6), (0, OUT * C))})
    np.testing.assert_array_equal(part["u"], full["u"][..., C:])
    np.testing.assert_array_equal(part["v"], full["v"][:, :, 2:6])


def test_frames_without_a_channel_axis_of_one(tmp_path):
    data = np.stack([trajectory(i, 8)[..., 0] for i in range(2)])      # [traj, time, X, Y]
    path = write_arrays(tmp_path / "s.h5", {"train/w": data})
    flds = fields("time", c=1)
    src = WindowSource(path, "train/w", flds, BATCH, input_name="u", target_name="v",
                       input_steps=IN, target_steps=OUT, stride=STRIDE, layout="time",
                       shuffle=False)
    got = src.rows(0, 0, 4)
    assert src.count == 4 and got["u"].shape == (4, IN, X, Y, 1)
    np.testing.assert_array_equal(got["v"][3, ..., 0], data[1, 2 + IN:2 + SPAN])
    assert src.statistics_plan() == {"train/w": (False, 2)}


def test_wrong_frames_short_trajectories_and_counts_are_named(tmp_path):
    path = traj_file(tmp_path / "t.h5", "hdf5", 2, 6)
    with pytest.raises(ArrayDataError) as e:        # frames (X, Y, 3) wanted, (X, Y, 2) stored
        WindowSource(path, "train/w", fields("channels", c=3), BATCH, input_name="u",
                     target_name="v", input_steps=IN, target_steps=OUT).check()
    msg = str(e.value)
    assert all(s in msg for s in ("data.window.input_steps", "data.fields.u", "'train/w'",
                                  "(2, 6, 8, 8, 2)", "(8, 8, 3)", str(path)))
    with pytest.raises(ArrayDataError, match=r"data\.window\.input_steps=3 its last axis"):
        WindowSource(path, "train/w", fields("channels"), BATCH, input_name="u",
                     target_name="v", input_steps=3, target_steps=OUT)
    with pytest.raises(ArrayDataError) as e:        # a window of 2 + 5 steps, trajectories of 6
        source(path, target_steps=5).check()
    assert "data.window.input_steps" in str(e.value) and "data.window.target_steps" in \
        str(e.value) and "longest has 6 steps" in str(e.value)
    with pytest.raises(ArrayDataError, match="3 windows wanted"):
        source(path, count=3).check()               # 2 windows (t0 = 0 of each trajectory)
    empty = write_arrays(tmp_path / "e.h5", {"train/w": np.zeros((0, 9, X, Y, C), np.float32)})
    with pytest.raises(ArrayDataError, match="0 windows"):
        source(empty).check()


def test_a_damaged_chunk_names_file_dataset_and_window(tmp_path):
    path = traj_file(tmp_path / "t.zarr", "zarr", 2, 9, chunks={"train/w": (1, 1, X, Y, C)})
    (path / "train/w/c/1/4/0/0/0").write_bytes(b"not a chunk")   # trajectory 1, step 4
    src = source(path, shuffle=False)
    src.rows(0, 0, 3)                                   # trajectory 0 reads fine
    with pytest.raises(ArrayDataError) as e:
        src.rows(0, 3, 4)                               # window 3: trajectory 1, t0 = 0
    msg = str(e.value)
    assert all(s in msg for s in (str(path), "'train/w'", "window 3", "trajectory 1",
                                  "time steps 0..4", "left unchanged"))
    assert (path / "train/w/c/1/4/0/0/0").read_bytes() == b"not a chunk"


def test_from_sections(tmp_path):
    traj_file(tmp_path / "d" / "a.h5", "hdf5", 2, 12)

    def config(**data) -> SourceSections:
        window = WindowConfig(input_steps=IN, target_steps=OUT, stride=STRIDE)
        return SourceSections(DataConfig(**{"path": tmp_path / "d", "prefetch": 3,
                                            "read_threads": 2, "window": window, **data}),
                              batch_size=BATCH, steps=5, seed=4)

    kw = {"input_name": "u", "target_name": "v", "layout": "time", "shuffle": True}
    src = WindowSource.from_sections(config(), "train", fields("time"), "{split}/w", **kw)
    assert (src.dataset, src.count, src.prefetch, src.prefetch_until) == ("train/w", 8, 3, 5)
    long = WindowSource.from_sections(config(), "train", fields("time", target_steps=6),
                                    "{split}/w", target_steps=6, **kw)
    assert long.span == 8 and long.count == 6 and long.rows(0, 0, 2)["v"].shape[1] == 6
    blocks = WindowSource.from_sections(config(shuffle_block=3), "train", fields("time"),
                                      "{split}/w", **kw)       # windows shuffled in blocks
    order = [r for step in range(4) for r in blocks.record_indices(step, 0, BATCH)][:8]
    assert sorted(order) == list(range(8)) and blocks.index.block == 3
    with pytest.raises(ArrayDataError, match=r"'train/other' \(data\.fields\.u\)"):
        WindowSource.from_sections(config(fields={"u": "{split}/other"}), "train",
                                 fields("time"), "{split}/w", **kw).check()
    with pytest.raises(ArrayDataError, match=r"data\.fields\.v=.*set data\.fields\.u only"):
        WindowSource.from_sections(config(fields={"v": "{split}/other"}), "train",
                                 fields("time"), "{split}/w", **kw)
    with pytest.raises(ArrayDataError, match=r"data\.window is not set.*data\.window\."
                                             r"input_steps"):
        WindowSource.from_sections(config(window=None), "train", fields("time"), "{split}/w",
                                 **kw)
