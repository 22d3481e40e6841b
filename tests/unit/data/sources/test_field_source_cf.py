"""The field-task source (spmd.data.sources.arrays.ArraySource) on files written by xarray (issue
35):
a plain variable reads as xarray reads it (CF-packed ones and fill values are decoded:
tests/unit/data/cf/test_arrays_cf.py), and a dataset path without {split} never makes the test
split the train split."""

from __future__ import annotations

import numpy as np
import pytest

from spmd.data.batch import BatchField
from spmd.data.formats.stores import ArrayDataError
from spmd.data.sources.arrays import ArraySource

xr = pytest.importorskip("xarray")

PACKED = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 5.0, "_FillValue": -32767}
FIELDS = {n: BatchField((4, 3), np.float32, ("batch", "x", "channels")) for n in ("a", "u")}


def write(path, fmt: str, packed: bool):
    """Group `train` with variables a, u (sample, x, y) as xarray writes them."""
    rng = np.random.default_rng(0)
    ds = xr.Dataset({n: (("sample", "x", "y"), rng.normal(size=(6, 4, 3)).astype(np.float32))
                     for n in ("a", "u")})
    enc = {"u": dict(PACKED)} if packed else {}
    if fmt == "netcdf":
        ds.to_netcdf(path, group="train", encoding=enc, engine="netcdf4", format="NETCDF4")
    else:
        ds.to_zarr(path, group="train", encoding=enc, zarr_format=3, consolidated=False)
    return path


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("fmt,name", [("netcdf", "f.nc"), ("zarr", "f.zarr")])
def test_plain_variable_reads_as_xarray(tmp_path, fmt, name):
    plain = write(tmp_path / f"plain_{name}", fmt, packed=False)
    src = ArraySource(plain, {"a": "train/a", "u": "train/u"}, FIELDS, 2, shuffle=False)
    kw = {"engine": "netcdf4"} if fmt == "netcdf" else {"engine": "zarr", "consolidated": False}
    want = xr.open_dataset(plain, group="train", **kw)
    got = src.rows(0, 0, 2)
    np.testing.assert_array_equal(got["u"], want["u"].values[:2])
    assert src.opened_files == [str(plain)]       # the check opened nothing it counts


def test_dataset_path_without_split_refused_for_the_test_split(tmp_path):
    from spmd.data.data_config import DataConfig, SourceSections

    path = write(tmp_path / "f.nc", "netcdf", packed=False)
    cfg = SourceSections(DataConfig(path=path, fields={"u": "train/u"}), batch_size=2)
    defaults = {"a": "{split}/a", "u": "{split}/u"}
    train = ArraySource.from_sections(cfg, "train", FIELDS, defaults, shuffle=False)
    assert train.count == 6                                  # train reads train/u as asked
    with pytest.raises(ArrayDataError) as e:
        ArraySource.from_sections(cfg, "test", FIELDS, defaults, shuffle=False)
    msg = one_line(e)
    assert "data.fields.u=train/u has no {split}" in msg and "test split" in msg
