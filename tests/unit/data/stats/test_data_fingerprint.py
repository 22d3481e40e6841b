"""Every data input is fingerprinted per run (issue 38, item 3): a single `data.path` file, a
Zarr store or a glob's files replaced between two jobs of a run is an error naming the file,
`data.path` and `data.allow_changed`; with `data.allow_changed: true` a warning, and the run
trains on (spmd.data.stats.run_inputs)."""

from __future__ import annotations

import logging
import os
import shutil

import h5py
import numpy as np
import pytest
import yaml

import spmd
from spmd.config.load import with_overrides
from spmd.data.data_config import DataConfig
from spmd.data.formats.stores import ArrayDataError
from spmd.data.stats.run_inputs import RECORD_NAME, check_run_inputs
from tests.helpers.fno import make_tiny_dataset, tiny_config
from tests.helpers.records import read_jsonl


def _h5(path, seed: int) -> None:
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(seed).normal(size=(16, 4)).astype(np.float32)


def _data(path, **kw) -> DataConfig:
    return DataConfig(**{"source": "hdf5", "path": path, **kw})


def test_a_single_file_swapped_between_jobs_is_an_error_naming_it(tmp_path, caplog):
    data, run_dir = tmp_path / "fields.h5", tmp_path / "run"
    run_dir.mkdir()
    _h5(data, 0)
    check_run_inputs(_data(data), run_dir, None, True)          # job 1: a fresh start
    assert (run_dir / RECORD_NAME).is_file()
    check_run_inputs(_data(data), run_dir, 4, True)             # job 2: the same data
    size = data.stat().st_size
    _h5(data, 1)                                                # same shape, other values
    assert data.stat().st_size == size
    with pytest.raises(ArrayDataError) as e:
        check_run_inputs(_data(data), run_dir, 4, True)
    line = str(e.value)
    assert "\n" not in line and f"data.path={data}" in line and f"file {data} changed" in line
    assert "sha1" in line and "data.allow_changed=true" in line and "step 4" in line
    # the same bytes and mtime again (a copy kept with cp -p) is the same data
    _h5(data, 0)
    os.utime(data, ns=(0, 0))
    record = yaml.safe_load((run_dir / RECORD_NAME).read_text())
    stamp = record["members"]["fields.h5"]
    os.utime(data, ns=(stamp["mtime_ns"], stamp["mtime_ns"]))
    check_run_inputs(_data(data), run_dir, 4, True)
    # allowed: a warning naming the file, and the new data's fingerprint is recorded
    _h5(data, 2)
    with caplog.at_level(logging.WARNING, logger="spmd.data"):
        check_run_inputs(_data(data, allow_changed=True), run_dir, 6, True)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("data changed" in w and str(data) in w for w in warned), warned
    check_run_inputs(_data(data), run_dir, 8, True)             # the next job: no change
    # a fresh start (nothing restored) compares nothing; other ranks do nothing
    _h5(data, 3)
    check_run_inputs(_data(data), run_dir, 2, False)
    check_run_inputs(_data(data), run_dir, None, True)


def test_a_zarr_store_and_a_glob_are_fingerprinted_too(tmp_path):
    zarr = pytest.importorskip("zarr")
    store, run_dir = tmp_path / "fields.zarr", tmp_path / "run"
    run_dir.mkdir()
    zarr.save_array(str(store), np.zeros((8, 4), np.float32))
    check_run_inputs(_data(store, source="zarr"), run_dir, None, True)
    shutil.rmtree(store)                                        # written again
    zarr.save_array(str(store), np.zeros((9, 4), np.float32))
    with pytest.raises(ArrayDataError, match="zarr.*changed"):
        check_run_inputs(_data(store, source="zarr"), run_dir, 3, True)

    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(2):
        _h5(parts / f"p{i}.h5", i)
    pattern = str(parts / "*.h5")
    check_run_inputs(_data(pattern), run_dir, None, True)
    _h5(parts / "p2.h5", 2)
    with pytest.raises(ArrayDataError, match=f"file {parts / 'p2.h5'} is new"):
        check_run_inputs(_data(pattern), run_dir, 3, True)
    (parts / "p2.h5").unlink()
    (parts / "p0.h5").unlink()
    with pytest.raises(ArrayDataError, match=f"file {parts / 'p0.h5'} is gone"):
        check_run_inputs(_data(pattern), run_dir, 3, True)


@pytest.mark.slow
@pytest.mark.usefixtures("keep_signal_handlers")
def test_training_on_a_replaced_file_fails_and_allow_changed_trains_on(tmp_path):
    data = make_tiny_dataset(tmp_path / "darcy.h5", seed=0)
    cfg = yaml.safe_load(tiny_config(tmp_path, data).read_text())
    cfg = with_overrides(cfg, ["train.steps=2", "checkpoint.every=1", "run.plots=false",
                               "train.eval_every=0"])
    run_dir = tmp_path / "run"
    assert spmd.train(cfg) == 0
    config_before = (run_dir / "config.yaml").read_bytes()
    make_tiny_dataset(data, seed=1)                             # swapped between the jobs
    resumed = with_overrides(cfg, ["train.steps=4"])
    with pytest.raises(ArrayDataError) as e:
        spmd.train(resumed)
    line = str(e.value)
    assert "\n" not in line and f"data.path={data}" in line and f"file {data} changed" in line
    assert "data.allow_changed=true" in line
    assert (run_dir / "config.yaml").read_bytes() == config_before   # rejected: unchanged
    assert spmd.train(with_overrides(resumed, ["data.allow_changed=true"])) == 0
    restored = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored"]
    assert restored[-1]["step"] == 2
    log = "".join(p.read_text() for p in run_dir.rglob("*.log"))
    assert "data changed since the run's previous job" in log and str(data) in log
