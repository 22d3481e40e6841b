"""Normalization statistics (spmd.data.stats.normalization) and FieldTask's data.normalize: per
channel count, mean, std, min and max of HDF5 and Zarr data, one file or parts, equal NumPy's
on the concatenated data for any rank count; the file beside the data; stale and missing
statistics named; a FieldTask that trains on normalized fields and predicts physical ones."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from spmd.config.schema import Config, DataConfig, RunConfig, TrainConfig
from spmd.data import ArrayDataError, ArraySource, BatchField, write_arrays
from spmd.data.formats import file_index
from spmd.data.stats.normalization import (
    compute_statistics,
    load_statistics,
    merge_statistics,
    partial_statistics,
    statistics_file,
    write_statistics,
)
from spmd.tasks.field_task import FieldTask

N, PARTS = 30, (10, 7, 13)
SUFFIX = {"hdf5": ".h5", "zarr": ".zarr"}
PLAN = {"train/a": (True, N), "train/b": (False, N)}


def arrays() -> dict[str, np.ndarray]:
    """`train/a`: 3 channels of different scales; `train/b`: no channel axis (float64)."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((N, 6, 5, 3)) * [1.0, 10.0, 0.01] + [0.5, -20.0, 3.0]
    return {"train/a": a.astype(np.float32),
            "train/b": 4.0 + 2.0 * rng.standard_normal((N, 6, 5))}


def write_parts(directory, fmt, parts=PARTS):
    data, lo = arrays(), 0
    for i, n in enumerate(parts):
        write_arrays(directory / f"part{i}{SUFFIX[fmt]}",
                     {k: v[lo:lo + n] for k, v in data.items()}, format=fmt)
        lo += n
    return directory


def expected(rows: int = N) -> dict[str, dict[str, np.ndarray]]:
    """NumPy's statistics (float64) of the first `rows` records, per channel."""
    data = arrays()
    a = data["train/a"][:rows].astype(np.float64).reshape(-1, 3)
    b = data["train/b"][:rows].reshape(-1, 1)
    return {name: {"count": np.full(v.shape[1], v.shape[0]), "mean": v.mean(0), "std": v.std(0),
                   "min": v.min(0), "max": v.max(0)} for name, v in (("train/a", a),
                                                                      ("train/b", b))}


def assert_matches(got, want, rtol=1e-9):
    for dataset, w in want.items():
        for key, value in w.items():
            np.testing.assert_allclose(getattr(got[dataset], key), value, rtol=rtol,
                                       err_msg=f"{dataset} {key}")


@pytest.fixture(autouse=True)
def new_process():
    file_index._MEMO.clear()


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_one_file_and_its_parts_give_numpys_statistics(tmp_path, fmt):
    single = write_arrays(tmp_path / f"single{SUFFIX[fmt]}", arrays(), format=fmt)
    parts = write_parts(tmp_path / "parts", fmt)
    for path, stored in ((single, tmp_path / f"single{SUFFIX[fmt]}.stats.json"),
                         (parts, parts / "stats.json")):
        merged = merge_statistics([partial_statistics(path, PLAN)])
        assert write_statistics(path, merged, split="train") == stored == statistics_file(path)
        got = load_statistics(path)
        assert_matches(got, expected())
        assert got["train/a"].channels == 3 and got["train/b"].channels == 1
        doc = json.loads(stored.read_text())              # human-readable, with its provenance
        assert doc["datasets"]["train/a"]["split"] == "train"
        assert doc["datasets"]["train/b"]["rows"] == N
        assert doc["datasets"]["train/b"]["per_channel"] is False
        assert len(doc["fingerprint"]) == (1 if path == single else len(PARTS))


def test_a_globs_statistics_sit_beside_its_index(tmp_path):
    write_parts(tmp_path / "run", "hdf5")
    glob = tmp_path / "run" / "part*.h5"
    ArraySource(glob, {"a": "train/a"}, {"a": BatchField((6, 5, 3), np.float32,
                                                         ("batch", "x", "y", "channels"))},
                4).check()                                  # builds the index
    index = next((tmp_path / "run").glob(".spmd_index-*.json"))
    path = write_statistics(glob, merge_statistics([partial_statistics(glob, PLAN)]),
                            split="train")
    assert path == tmp_path / "run" / index.name.replace(".spmd_index-", "stats-")
    assert_matches(load_statistics(glob), expected())
    everything = tmp_path / "run" / "*"                  # matches the .json files too
    source = ArraySource(everything, {"a": "train/a"}, {"a": BatchField(
        (6, 5, 3), np.float32, ("batch", "x", "y", "channels"))}, 4)
    assert source.count == N
    assert not any(str(m.path).endswith(".json") for m in source.files.members)


def test_rows_limit_the_records(tmp_path):
    parts = write_parts(tmp_path, "hdf5")
    part = partial_statistics(parts, {"train/a": (True, 17), "train/b": (False, 17)})
    assert part["opened"] == [str(tmp_path / "part0.h5"), str(tmp_path / "part1.h5")]
    write_statistics(parts, merge_statistics([part]), split="train")
    assert_matches(load_statistics(parts, ["train/a", "train/b"],
                                   rows={"train/a": 17}), expected(17))
    with pytest.raises(ArrayDataError, match="holds 30 records but statistics of 31"):
        partial_statistics(parts, {"train/a": (True, 31)})


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_uneven_partials_of_any_rank_count_merge_to_the_one_rank_result(tmp_path, fmt):
    """Ranks simulated by rank/size, small blocks (2 records): each rank opens only the
    files holding its records; the JSON partials merge, in any order, to one rank's result."""
    parts = write_parts(tmp_path, fmt)
    one = merge_statistics([partial_statistics(parts, PLAN)])
    block = 2 * 6 * 5 * 3 * 8
    names = [str(tmp_path / f"part{i}{SUFFIX[fmt]}") for i in range(3)]
    for size, opened in ((2, [names[:2], names[1:]]),
                         (3, [names[:1], names[1:], names[2:]]),
                         (4, [names[:1], names[:2], names[1:], names[2:]])):
        partials = [partial_statistics(parts, PLAN, rank=r, size=size, block_bytes=block)
                    for r in range(size)]
        assert [p["opened"] for p in partials] == opened
        sent = [json.loads(json.dumps(p)) for p in reversed(partials)]   # over the wire
        assert sent == partials[::-1]
        merged = merge_statistics(sent)
        for dataset, want in one["datasets"].items():
            got = merged["datasets"][dataset]
            assert got["count"] == want["count"] and got["range"] == [0, N]
            for key in ("mean", "m2", "min", "max"):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-12)
    with pytest.raises(ValueError, match="not one contiguous range"):
        merge_statistics([partial_statistics(parts, PLAN, rank=r, size=3) for r in (0, 2)])
    write_statistics(parts, merged, split="train")
    assert_matches(load_statistics(parts), expected())


def test_missing_and_stale_statistics_are_named(tmp_path):
    parts = write_parts(tmp_path / "parts", "hdf5")
    with pytest.raises(ArrayDataError) as e:
        load_statistics(parts)
    assert str(parts / "stats.json") in str(e.value) and "spmd data stats CONFIG" in str(e.value)
    write_statistics(parts, merge_statistics([partial_statistics(parts, PLAN)]), split="train")
    with pytest.raises(ArrayDataError, match="no dataset 'train/c'"):
        load_statistics(parts, ["train/c"])
    with pytest.raises(ArrayDataError, match="cover 30 records but 20 are used now"):
        load_statistics(parts, ["train/a"], rows={"train/a": 20})
    changed = parts / "part1.h5"
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ArrayDataError) as e:
        load_statistics(parts)
    assert f"data file {changed} changed" in str(e.value)
    assert "rerun `spmd data stats CONFIG`" in str(e.value)
    single = write_arrays(tmp_path / "one.h5", arrays())
    write_statistics(single, merge_statistics([partial_statistics(single, PLAN)]), split="train")
    write_arrays(tmp_path / "one.h5", {k: v[:-1] for k, v in arrays().items()})   # rewritten
    with pytest.raises(ArrayDataError, match=f"data file {single} changed"):
        load_statistics(single)


def test_the_plan_knows_which_fields_have_a_stored_channel_axis(tmp_path):
    rng = np.random.default_rng(0)
    path = write_arrays(tmp_path / "d.h5", {"x": rng.standard_normal((9, 4, 4)),
                                            "y": rng.standard_normal((9, 4, 4, 2)),
                                            "z": rng.standard_normal((9, 4, 4, 2))})
    fields = {"x": BatchField((4, 4, 1), np.float32, ("batch", "x", "y", "channels")),
              "y": BatchField((4, 4, 2), np.float32, ("batch", "x", "y", "channels")),
              "z": BatchField((4, 4, 2), np.float32, ("batch", "x", "y", None))}
    src = ArraySource(path, {"x": "x", "y": "y", "z": "z"}, fields, 3, count=7)
    assert src.statistics_plan() == {"x": (False, 7), "y": (True, 7), "z": (False, 7)}
    stats = merge_statistics([partial_statistics(path, src.statistics_plan())])["datasets"]
    assert stats["x"]["channels"] == stats["z"]["channels"] == 1
    assert stats["y"]["channels"] == 2 and stats["y"]["count"] == [7 * 16] * 2


# ---------------------------------------------------------------- FieldTask


class PairTask(FieldTask):
    """Two-channel fields; the target is an affine map of the input, far from unit scale."""

    def build_model(self, rngs):
        raise NotImplementedError   # the tests pass their own model

    def field_shape(self):
        return (4, 4, 2)

    def make_pairs(self, count, seed):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((count, 4, 4, 2)) * [3.0, 0.1] + [10.0, -1.0]
        return x.astype(np.float32), (50.0 * x + 7.0).astype(np.float32)


class Recorder:
    """A per-channel affine model that keeps the inputs it is called with."""

    def __init__(self):
        self.seen = []
        self.w, self.b = jnp.array([0.5, 2.0]), jnp.array([0.1, -0.3])

    def __call__(self, x):
        self.seen.append(np.asarray(x))
        return x * self.w + self.b


def pair_task(tmp_path, normalize: bool) -> PairTask:
    data = DataConfig(source="hdf5", path=tmp_path / "pairs.h5", num_train=16, num_test=8,
                      normalize=normalize)
    return PairTask(Config(data=data, train=TrainConfig(batch_size=16, eval_every=1),
                           run=RunConfig(dir=tmp_path / "run")))


def test_a_field_task_trains_on_normalized_fields_and_predicts_physical_ones(tmp_path):
    task = pair_task(tmp_path, normalize=True)
    task.prepare(True)                      # makes the data, and the statistics (normalize)
    assert (tmp_path / "pairs.h5.stats.json").is_file()
    batch = {k: jnp.asarray(v) for k, v in task.train_source().rows(0, 0, 16).items()}
    x, y = (np.asarray(batch[k], np.float64) for k in ("input", "target"))
    mx, sx = x.mean((0, 1, 2)), x.std((0, 1, 2))       # the whole train split: 16 records
    my, sy = y.mean((0, 1, 2)), y.std((0, 1, 2))
    model = Recorder()
    loss, _ = task.loss(model, batch)
    seen = model.seen[-1]
    np.testing.assert_allclose(seen.mean((0, 1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(seen.std((0, 1, 2)), 1.0, rtol=1e-5)
    out = ((x - mx) / sx) * np.asarray(model.w) + np.asarray(model.b)
    np.testing.assert_allclose(float(loss), np.mean((out - (y - my) / sy) ** 2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(task.predict(model, batch)), out * sy + my,
                               rtol=1e-5, atol=1e-4)
    metrics = task.eval_metrics(model, batch)
    np.testing.assert_allclose(float(metrics["eval_loss"]), float(loss), rtol=1e-6)
    rel = np.sqrt(((out * sy + my - y) ** 2).sum((1, 2, 3)) / (y**2).sum((1, 2, 3))).mean()
    np.testing.assert_allclose(float(metrics["test_rel_l2"]), rel, rtol=1e-5)
    sample = task.sample_outputs(model, batch)
    np.testing.assert_allclose(sample["prediction"], (out * sy + my)[..., 0], rtol=1e-5,
                               atol=1e-4)


def test_without_normalize_the_fields_are_used_as_stored(tmp_path):
    task = pair_task(tmp_path, normalize=False)
    task.prepare(True)
    assert not (tmp_path / "pairs.h5.stats.json").exists()
    batch = {k: jnp.asarray(v) for k, v in task.train_source().rows(0, 0, 16).items()}
    model = Recorder()
    loss, _ = task.loss(model, batch)
    np.testing.assert_array_equal(model.seen[-1], np.asarray(batch["input"]))
    pred = np.asarray(model(batch["input"]))
    assert float(loss) == pytest.approx(np.mean((pred - np.asarray(batch["target"])) ** 2),
                                        rel=1e-6)
    np.testing.assert_array_equal(np.asarray(task.predict(model, batch)), pred)


def test_normalize_without_statistics_names_the_command(tmp_path):
    pair_task(tmp_path, normalize=False).prepare(True)      # data, but no statistics
    task = pair_task(tmp_path, normalize=True)
    batch = {k: jnp.asarray(v) for k, v in task.train_source().rows(0, 0, 16).items()}
    with pytest.raises(ArrayDataError) as e:
        task.loss(Recorder(), batch)
    assert "pairs.h5.stats.json" in str(e.value) and "spmd data stats CONFIG" in str(e.value)


def test_the_run_keeps_its_normalization_and_loads_without_the_data(tmp_path):
    task = pair_task(tmp_path, normalize=True)
    task.prepare(True)
    used = task.normalization()
    copy = tmp_path / "run" / "normalization.json"
    assert copy.is_file()
    (tmp_path / "pairs.h5").unlink()               # the run moved to a machine without data
    again = pair_task(tmp_path, normalize=True).normalization()
    for field, (mean, std) in used.items():
        np.testing.assert_array_equal(again[field][0], mean)
        np.testing.assert_array_equal(again[field][1], std)
    copy.write_text("{")                           # a damaged copy is named, not guessed
    with pytest.raises(ArrayDataError, match="normalization.json"):
        pair_task(tmp_path, normalize=True).normalization()


def test_the_runs_normalization_is_read_only_whatever_data_path_says(tmp_path, caplog):
    """Eval or predict on other data (other values, with their own statistics) uses the
    statistics the run trained with, warns that the data's differ, and never rewrites the
    run's normalization.json (issue 49: a trained model's input statistics are part of it)."""
    import logging

    import h5py

    task = pair_task(tmp_path, normalize=True)
    task.prepare(True)
    used = task.normalization()
    copy = tmp_path / "run" / "normalization.json"
    before, stamp = copy.read_bytes(), copy.stat().st_mtime_ns
    x, y = PairTask.make_pairs(None, 16, seed=9)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:                 # written by h5py, not by spmd
        f["train/input"], f["train/target"] = x * 2 + 1, y * 2
        f["test/input"], f["test/target"] = x[:8], y[:8]
    cfg = task.cfg.model_copy(update={"data": task.cfg.data.model_copy(update={"path": other})})
    compute_statistics(PairTask(cfg).train_source(), "train")   # the other data's own
    with caplog.at_level(logging.WARNING, logger="spmd.tasks.field_task"):
        got = PairTask(cfg).normalization()
    for field, (mean, std) in used.items():
        np.testing.assert_array_equal(got[field][0], mean)
        np.testing.assert_array_equal(got[field][1], std)
    assert copy.read_bytes() == before and copy.stat().st_mtime_ns == stamp
    assert any("differ from the ones the run trained with" in r.getMessage()
               and "input" in r.getMessage() for r in caplog.records), caplog.text
    os.remove(f"{other}.stats.json")                # other data without statistics: quietly
    assert PairTask(cfg).normalization()["input"][0].tolist() == used["input"][0].tolist()
    assert copy.read_bytes() == before
