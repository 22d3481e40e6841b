"""ArraySource and WindowSource (stored arrays, spmd.data.sources.arrays /
spmd.data.sources.windows) decode
CF-coded NetCDF4 / Zarr variables as xarray does (issue 35): int16 packing (scale_factor,
add_offset), and _FillValue / missing_value as NaN, per member file; the values equal
`xarray.open_dataset(...).load()` element for element, and so do `spmd data stats`'
statistics of them. Files are written by xarray (tests/helpers/era5_files.py)."""

from __future__ import annotations

import numpy as np
import pytest

from spmd.data.batch import BatchField
from spmd.data.formats.stores import ArrayDataError
from spmd.data.sources.arrays import ArraySource
from spmd.data.stats.normalization import merge_statistics, partial_statistics
from tests.helpers.era5_files import PACKED, write_era5_years

xr = pytest.importorskip("xarray")

AXES = ("batch", "x", "y", "channels")


@pytest.fixture(scope="module")
def era5(tmp_path_factory):
    """Two ERA5-like years (u10 int16-packed with a _FillValue; 2001 zlib-compressed)."""
    return write_era5_years(tmp_path_factory.mktemp("era5"), (2000, 2001), zlib_year=2001)


def source(path, dataset, dtype, shuffle=False, **kw):
    fields = {"u": BatchField((6, 12), dtype, AXES[:3])}
    return ArraySource(path, {"u": dataset}, fields, 8, shuffle=shuffle, **kw)


def test_packed_era5_variable_equals_xarray_element_for_element(era5):
    root = era5[0].parent
    want = np.concatenate([xr.open_dataset(p).load()["u10"].values for p in era5])
    assert want.dtype == np.float64 and np.abs(want).max() > 1    # decoded, not counts
    for dtype in (np.float64, np.float32):        # float32: xarray's float64, cast
        src = source(root, "u10", dtype)
        assert src.count == len(want) == 731
        for step in (0, 45, 90):                  # the first file, across both, the second
            np.testing.assert_array_equal(src.rows(step, 0, 8)["u"],
                                          want[step * 8:step * 8 + 8].astype(dtype))
    # in a shuffled order, the same
    shuffled = source(root, "u10", np.float32, shuffle=True, seed=3)
    records = shuffled.record_indices(45, 0, 8)
    np.testing.assert_array_equal(shuffled.rows(45, 0, 8)["u"],
                                  want[records].astype(np.float32))


@pytest.mark.parametrize("fmt,name", [("netcdf", "f.nc"), ("zarr", "f.zarr")])
def test_fill_values_become_nan_and_per_file_packing(tmp_path, fmt, name):
    """int16 packing with a _FillValue (a NaN written), a float variable with a -999
    missing_value; two files packed with different scale factors and offsets."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (scale, offset) in enumerate([(0.01, 5.0), (0.5, -100.0)]):
        ds = xr.Dataset({n: (("sample", "x", "y"), (offset + 30 * rng.normal(size=(5, 6, 12)))
                             .astype(np.float32)) for n in ("p", "m")})
        ds["p"][0, 0, 0] = np.nan
        ds["m"][1, 2, 3] = np.nan
        enc = {"p": {**PACKED, "scale_factor": scale, "add_offset": offset},
               "m": {"_FillValue": -999.0}}
        path = tmp_path / "d" / name.replace("f.", f"f{i}.")
        path.parent.mkdir(exist_ok=True)
        if fmt == "netcdf":
            ds.to_netcdf(path, group="train", encoding=enc, engine="netcdf4")
        else:
            ds.to_zarr(path, group="train", encoding=enc, zarr_format=3, consolidated=False)
        paths.append(path)
    kw = {"engine": "netcdf4"} if fmt == "netcdf" else {"engine": "zarr", "consolidated": False}
    want = {n: np.concatenate([xr.open_dataset(p, group="train", **kw).load()[n].values
                               for p in paths]) for n in ("p", "m")}
    fields = {n: BatchField((6, 12), np.float64, AXES[:3]) for n in ("p", "m")}
    src = ArraySource(tmp_path / "d", {"p": "train/p", "m": "train/m"}, fields, 10,
                      shuffle=False)
    got = src.rows(0, 0, 10)
    for n in ("p", "m"):
        np.testing.assert_array_equal(got[n], want[n])
    assert np.isnan(got["p"][0, 0, 0]) and np.isnan(got["m"][1, 2, 3])
    assert np.isnan(got["p"]).sum() == np.isnan(got["m"]).sum() == 2   # both files' NaN

    # spmd data stats: of the decoded values, NaN left out
    stats = merge_statistics([partial_statistics(tmp_path / "d", {"train/p": (False, 10)},
                                                 rank=r, size=2) for r in (0, 1)])
    e = stats["datasets"]["train/p"]
    valid = want["p"][np.isfinite(want["p"])]
    assert e["count"] == [valid.size] and e["missing"] == [2]
    assert e["mean"][0] == pytest.approx(valid.mean(), rel=1e-12)
    assert e["min"][0] == valid.min() and e["max"][0] == valid.max()


def test_int32_packing_in_a_float32_field_refused(tmp_path):
    ds = xr.Dataset({"u": (("sample", "x", "y"), np.ones((4, 6, 12), np.float32))})
    path = tmp_path / "f.nc"
    ds.to_netcdf(path, group="train", engine="netcdf4",
                 encoding={"u": {"dtype": "int32", "scale_factor": 1e-6,
                                 "_FillValue": -2**31}})
    with pytest.raises(ArrayDataError) as e:
        source(path, "train/u", np.float32).check()
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "variable 'train/u'" in msg
    assert "int32" in msg and "float32" in msg
    assert source(path, "train/u", np.float64).rows(0, 0, 4)["u"].max() == pytest.approx(1)


def test_trajectory_windows_of_a_packed_variable_decode(era5):
    """WindowSource ([time, *frame] per file): windows of u10 as xarray decodes it."""
    from spmd.data.sources.windows import WindowSource

    fields = {n: BatchField((6, 12, 1), np.float32, AXES) for n in "uv"}
    src = WindowSource(era5[0].parent, "u10", fields, 4, input_name="u", target_name="v",
                       shuffle=False)
    want = xr.open_dataset(era5[0]).load()["u10"].values.astype(np.float32)
    got = src.rows(0, 0, 4)
    np.testing.assert_array_equal(got["u"][..., 0], want[:4])
    np.testing.assert_array_equal(got["v"][..., 0], want[1:5])
