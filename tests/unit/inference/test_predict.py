"""`spmd predict`, `spmd export` and `spmd eval --split train` on a tiny MLP trained in this
process (8 CPU devices; the regression task keeps the default `Task.predict`, the model on
its first field; 8 -> 8 channels, so a prediction feeds back for a rollout).

- An output ending in .zarr (or `--format zarr`) is a Zarr v3 store holding, element for
  element, what the HDF5 output holds: same dataset path, shape, dtype, attributes
  (rollout included), example order; written atomically (a failure leaves the previous
  store as it was and no temporary), and a path that is not a Zarr store is refused.
- The default `Task.predict` through `spmd predict` (sharded over the run's 8-device mesh)
  and through `spmd export` (the StableHLO artifact) is the model applied to the input.
- `spmd eval --split train` gives the mean eval loss over the train split's first
  `data.eval_batches` batches, computed here independently, and not the test split's.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import h5py
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.cli.main import main
from spmd.data.sources.synthetic import TeacherRegression
from spmd.errors import ExitCode, SpmdError
from spmd.inference.exporting import export_model
from spmd.inference.outputs import output_format
from spmd.tasks import Task
from tests.helpers.training import mlp_config

EXAMPLES = 19            # batch 8: two full batches and a padded one


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 4-step run (fsdp over 8 devices; the final step in the persistent tier)."""
    run_dir = tmp_path_factory.mktemp("predict") / "run"
    watched = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    saved = {s: signal.getsignal(s) for s in watched}   # as the keep_signal_handlers fixture
    try:
        assert spmd.train(mlp_config(run_dir, steps=4, model={"d_out": 8},
                                     mesh={"strategy": "fsdp"})) == 0
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    return run_dir


@pytest.fixture(scope="module")
def data(run) -> Path:
    """An input file: test/inputs and train/inputs, (EXAMPLES, 8) float32."""
    path = run.parent / "inputs.h5"
    rng = np.random.default_rng(7)
    with h5py.File(path, "w") as f:
        for split in ("test", "train"):
            f[f"{split}/inputs"] = rng.normal(size=(EXAMPLES, 8)).astype(np.float32)
    return path


def spmd_cli(*args: object) -> int:
    return main([str(a) for a in args])


def read_hdf5(path: Path) -> tuple[np.ndarray, dict]:
    with h5py.File(path) as f:
        assert list(f) == ["prediction"]
        return f["prediction"][:], {k: _plain(v) for k, v in f["prediction"].attrs.items()}


def read_zarr(path: Path) -> tuple[np.ndarray, dict]:
    import zarr

    assert json.loads((path / "zarr.json").read_text())["zarr_format"] == 3
    root = zarr.open_group(str(path), mode="r")
    assert [name for name, _ in root.members()] == ["prediction"]
    array = root["prediction"]
    assert array.chunks == (1, *array.shape[1:])        # one example per chunk, as HDF5
    return array[...], dict(array.attrs)


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def no_temporaries(where: Path) -> bool:
    return not [p.name for p in where.iterdir() if p.name.startswith(".")]


def test_a_zarr_output_holds_what_the_hdf5_output_holds(run, data, tmp_path):
    for rollout in (1, 3):
        h5, store, named = (tmp_path / f"r{rollout}.h5", tmp_path / f"r{rollout}.zarr",
                            tmp_path / f"r{rollout}-store")
        common = ("--input", data, "--rollout", rollout)
        assert spmd_cli("predict", run, *common, "--output", h5) == 0
        assert spmd_cli("predict", run, *common, "--output", store) == 0   # by its suffix
        assert spmd_cli("predict", run, *common, "--output", named, "--format", "zarr") == 0
        want, want_attrs = read_hdf5(h5)
        shape = (EXAMPLES, rollout, 8) if rollout > 1 else (EXAMPLES, 8)
        assert want.shape == shape and want_attrs["rollout"] == rollout
        assert want_attrs["dataset"] == "test/inputs" and want_attrs["step"] == 4
        for path in (store, named):
            got, attrs = read_zarr(path)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), path      # element for element, in order
            assert attrs == want_attrs
    plain, _ = read_hdf5(tmp_path / "r1.h5")
    rolled, _ = read_zarr(tmp_path / "r3.zarr")
    np.testing.assert_allclose(rolled[:, 0], plain, rtol=1e-6, atol=1e-6)
    assert np.abs(rolled[:, 1] - rolled[:, 0]).max() > 0
    assert no_temporaries(tmp_path)
    # and the store reads back as data: the input of another prediction
    again = tmp_path / "again.h5"
    assert spmd_cli("predict", run, "--input", tmp_path / "r1.zarr", "--dataset",
                    "prediction", "--output", again) == 0
    np.testing.assert_allclose(read_hdf5(again)[0], rolled[:, 1], rtol=1e-6, atol=1e-6)


def test_a_failed_prediction_leaves_the_previous_store_and_no_temporary(run, data, tmp_path,
                                                                        monkeypatch, capsys):
    from spmd.inference import prediction

    store = tmp_path / "pred.zarr"
    assert spmd_cli("predict", run, "--input", data, "--output", store) == 0
    before, _ = read_zarr(store)
    real = prediction.BatchFeed.global_batch

    def failing(self, source, step):
        if step == 1:
            raise OSError("the file system went away")
        return real(self, source, step)

    monkeypatch.setattr(prediction.BatchFeed, "global_batch", failing)
    with pytest.raises(OSError, match="went away"):
        spmd_cli("predict", run, "--input", data, "--output", store)
    assert read_zarr(store)[0].tobytes() == before.tobytes() and no_temporaries(tmp_path)
    monkeypatch.undo()
    assert spmd_cli("predict", run, "--input", data, "--output", store, "--rollout", 2) == 0
    assert read_zarr(store)[0].shape == (EXAMPLES, 2, 8)   # a store is replaced whole
    assert no_temporaries(tmp_path)

    mine = tmp_path / "mine.zarr"               # not a Zarr store: refused, left as it was
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert spmd_cli("predict", run, "--input", data, "--output", mine) == ExitCode.USER_ERROR
    assert "mine.zarr exists and is not a Zarr store" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert spmd_cli("predict", run, "--input", data, "--output", mine,
                    "--format", "npy") == ExitCode.USER_ERROR
    assert "--format npy: the output formats are hdf5, zarr" in capsys.readouterr().err
    assert no_temporaries(tmp_path)


def test_output_format_follows_the_flag_else_the_name():
    assert output_format(Path("p.zarr")) == "zarr" and output_format(Path("p.ZARR")) == "zarr"
    assert output_format(Path("p.h5")) == "hdf5" and output_format(Path("p")) == "hdf5"
    assert output_format(Path("p.h5"), "zarr") == "zarr"
    assert output_format(Path("p.zarr"), "hdf5") == "hdf5"
    assert output_format(Path("p.nc")) == "netcdf" and output_format(Path("p.nc4")) == "netcdf"
    with pytest.raises(SpmdError, match="--format grib: the output formats are hdf5, zarr, "
                                        "netcdf"):
        output_format(Path("p.grib"), "grib")


def test_the_default_task_predict_through_predict_and_export(run, data, tmp_path):
    trained = spmd.load(run)                              # one device
    assert type(trained.task).predict is Task.predict     # not overridden
    assert trained.task.prediction_input() == "inputs"
    with h5py.File(data) as f:
        x = f["test/inputs"][:]
    expected = np.asarray(trained.model(jnp.asarray(x)))  # the default: the model on x
    assert spmd_cli("predict", run, "--input", data, "--output", tmp_path / "p.h5") == 0
    got, attrs = read_hdf5(tmp_path / "p.h5")             # on the run's 8-device mesh
    assert attrs["batch_size"] == 8
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)

    summary = export_model(trained, tmp_path / "exported")
    assert summary.input_name == "inputs" and summary.input_shape == ("batch", 8)
    exported = jax.export.deserialize((tmp_path / "exported" / "predict.jax").read_bytes())
    for n in (3, EXAMPLES):
        np.testing.assert_allclose(np.asarray(exported.call(x[:n])), expected[:n],
                                   rtol=1e-6, atol=1e-6)
    manifest = json.loads((tmp_path / "exported" / "export.json").read_text())
    assert manifest["input"] == "inputs" and manifest["output_shape"] == ["batch", 8]


def test_eval_of_the_train_split_is_the_train_splits_eval_loss(run, capsys):
    def evaluated(split: str) -> dict:
        assert spmd_cli("eval", run, "--split", split, "--json") == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["split"] == split and report["step"] == 4
        return report["metrics"]

    train, test = evaluated("train"), evaluated("test")
    trained = spmd.load(run)
    cfg = trained.config
    assert cfg.data.eval_batches == 2 and cfg.train.batch_size == 8

    def eval_loss(stream: int) -> float:   # the task's eval_loss, batch by batch, in numpy
        source = TeacherRegression(cfg.train.seed, 8, 8, stream=stream)
        losses = []
        for step in range(cfg.data.eval_batches):
            batch = source.rows(step, 0, cfg.train.batch_size)
            pred = np.asarray(trained.model(jnp.asarray(batch["inputs"])), np.float64)
            losses.append(np.mean((pred - batch["targets"]) ** 2))
        return float(np.mean(losses))

    assert np.isfinite(train["eval_loss"]) and train["eval_loss"] != test["eval_loss"]
    assert train["eval_loss"] == pytest.approx(eval_loss(stream=0), rel=1e-5)
    assert test["eval_loss"] == pytest.approx(eval_loss(stream=1), rel=1e-5)


def test_a_netcdf_forecast_needs_a_gridded_run(tmp_path):
    from spmd.inference.outputs import open_output

    with pytest.raises(SpmdError, match="a NetCDF forecast needs the coordinates of a run "
                                        "that trained on gridded files"):
        open_output(tmp_path / "p.nc", None, (4, 2), np.dtype("float32"), enabled=True)
    assert not list(tmp_path.iterdir())
