"""Bad datasets stop `spmd train` with one message naming the file and the keys to fix,
a non-zero exit, no traceback, and the file untouched."""

from __future__ import annotations

import pytest

from tests.helpers.env import run_spmd
from tests.helpers.fno import make_tiny_dataset, sha256, tiny_config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("bad_input") / "darcy16.h5")


def train_fails(tmp_path, data_path, *overrides, launcher=("train",)):
    config = tiny_config(tmp_path, data_path)
    before = sha256(data_path)
    result = run_spmd(*launcher, str(config), *overrides, timeout=120)
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert str(data_path) in result.stderr
    assert sha256(data_path) == before
    return result.stderr


def test_grid_mismatch(tmp_path, dataset):
    err = train_fails(tmp_path, dataset, "model.grid=32")
    assert "HDF5 attribute 'grid'=16" in err and "model.grid=32" in err
    assert "data.path" in err


def test_channel_mismatch(tmp_path, dataset):
    err = train_fails(tmp_path, dataset, "model.in_channels=2")
    assert "'in_channels'=1" in err and "model.in_channels=2" in err


def test_too_few_samples(tmp_path, dataset):
    err = train_fails(tmp_path, dataset, "data.num_train=100")
    assert "data.num_train=100" in err and "'num_train'" in err


def test_not_an_hdf5_file(tmp_path):
    bogus = tmp_path / "notes.h5"
    bogus.write_text("these are not the fields you are looking for\n" * 100)
    err = train_fails(tmp_path, bogus)
    assert "not an HDF5 file" in err and "data.path" in err


def test_truncated_hdf5_file(tmp_path, dataset):
    cut = tmp_path / "cut.h5"
    cut.write_bytes(dataset.read_bytes()[:20_000])
    err = train_fails(tmp_path, cut)
    assert "data.path" in err


def test_mismatch_under_two_ranks_exits_without_hanging(tmp_path, dataset):
    err = train_fails(tmp_path, dataset, "model.grid=32", launcher=("run", "-n", "2"))
    assert "model.grid=32" in err


@pytest.mark.parametrize("kind", ["directory", "glob"])
def test_a_directory_or_glob_of_files_is_refused_with_what_to_use(tmp_path, dataset, kind):
    """The built-in FNO reads one fields file; many files are a FieldTask's (docs/data.md)."""
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "darcy16.h5").write_bytes(dataset.read_bytes())
    data_path = parts if kind == "directory" else parts / "*.h5"
    result = run_spmd("train", str(tiny_config(tmp_path, data_path)), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"data.path={data_path} is a {kind}" in result.stderr
    assert "spmd.FieldTask" in result.stderr
    assert sorted(p.name for p in parts.iterdir()) == ["darcy16.h5"]
