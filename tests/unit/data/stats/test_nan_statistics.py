"""NaN-aware statistics (spmd.data.stats.normalization): NaN values are left out per channel with
a valid count, on any rank count; an all-NaN channel is an error naming it; the statistics
file never holds NaN, and an older file (one count, or a NaN written before) reads or is
refused by name.

Fixtures are written with h5py / xarray (netCDF4), not spmd's writer.
"""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from spmd.data import ArrayDataError
from spmd.data.stats.normalization import (
    load_statistics,
    merge_statistics,
    partial_statistics,
    statistics_file,
    write_statistics,
)

ROWS = 12


def sst_and_wind(seed: int = 0) -> np.ndarray:
    """(time, lat, lon, 2): channel 0 a sea-surface temperature with NaN over land, channel
    1 a wind with a few missing values."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 6, 8, 2)) * [2.0, 5.0] + [290.0, 1.0]
    land = np.zeros((6, 8), bool)
    land[2:4, 1:5] = True
    x[:, land, 0] = np.nan
    x[3, 0, 0, 1] = np.nan
    x[7, 5, 7, 1] = np.nan
    return x


def write_h5(path, values, name="train/f"):
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=values)
    return path


def numpy_stats(values):
    flat = values.reshape(-1, values.shape[-1])
    return {"count": (~np.isnan(flat)).sum(0), "mean": np.nanmean(flat, 0),
            "std": np.nanstd(flat, 0), "min": np.nanmin(flat, 0), "max": np.nanmax(flat, 0)}


def stored(path):
    plan = {"train/f": (True, ROWS)}
    merged = merge_statistics([partial_statistics(path, plan)])
    write_statistics(path, merged, split="train")
    return merged


def test_nan_values_are_left_out_per_channel_with_a_valid_count(tmp_path):
    values = sst_and_wind()
    path = write_h5(tmp_path / "sst.h5", values)
    stored(path)
    got = load_statistics(path)["train/f"]
    want = numpy_stats(values)
    np.testing.assert_array_equal(got.count, want["count"])
    assert got.count[0] == ROWS * (48 - 8) and got.count[1] == ROWS * 48 - 2
    for key in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(getattr(got, key), want[key], rtol=1e-12)
    doc = json.loads(statistics_file(path).read_text())
    assert doc["datasets"]["train/f"]["missing"] == [ROWS * 8, 2]
    text = statistics_file(path).read_text()
    assert "NaN" not in text and "Infinity" not in text


@pytest.mark.parametrize("size", [2, 3, 5])
def test_ranks_with_and_without_missing_values_merge_to_numpys(tmp_path, size):
    """Rank shares where a channel is all NaN in one share merge exactly."""
    values = sst_and_wind(1)
    values[:6, :, :, 0] = np.nan                 # rank 0 sees no valid sst at all
    path = write_h5(tmp_path / "d.h5", values)
    plan = {"train/f": (True, ROWS)}
    parts = [json.loads(json.dumps(partial_statistics(path, plan, rank=r, size=size,
                                                      block_bytes=6 * 8 * 2 * 8)))
             for r in range(size)]
    assert parts[0]["datasets"]["train/f"]["count"][0] == 0
    assert parts[0]["datasets"]["train/f"]["min"][0] is None     # JSON has no inf
    merged = merge_statistics(parts[::-1])["datasets"]["train/f"]
    want = numpy_stats(values)
    assert merged["count"] == want["count"].tolist()
    np.testing.assert_allclose(merged["mean"], want["mean"], rtol=1e-12)
    np.testing.assert_allclose(np.sqrt(np.asarray(merged["m2"]) / merged["count"]), want["std"],
                               rtol=1e-10)
    np.testing.assert_allclose(merged["min"], want["min"])
    np.testing.assert_allclose(merged["max"], want["max"])


def test_a_channel_that_is_all_nan_is_an_error_naming_it(tmp_path):
    values = sst_and_wind()
    values[..., 1] = np.nan
    path = write_h5(tmp_path / "d.h5", values)
    merged = merge_statistics([partial_statistics(path, {"train/f": (True, ROWS)})])
    with pytest.raises(ArrayDataError, match=r"dataset 'train/f' channel 1: no valid value"):
        write_statistics(path, merged, split="train")
    with pytest.raises(ArrayDataError, match=r"channel 1 \('u10'\): no valid value"):
        write_statistics(path, merged, split="train", channel_names={"train/f": ["sst", "u10"]})
    assert not statistics_file(path).exists()              # nothing written


def test_a_netcdf_file_written_by_xarray_with_a_land_mask(tmp_path):
    xr = pytest.importorskip("xarray")
    values = sst_and_wind(2)[..., 0]                       # no channel axis: one "channel"
    ds = xr.Dataset({"sst": (("time", "latitude", "longitude"), values.astype(np.float32))})
    path = tmp_path / "sst.nc"
    ds.to_netcdf(path, engine="netcdf4", encoding={"sst": {"_FillValue": np.nan}})
    plan = {"sst": (False, ROWS)}
    merged = merge_statistics([partial_statistics(path, plan)])
    write_statistics(path, merged, split="train")
    got = load_statistics(path)["sst"]
    flat = values.astype(np.float32).astype(np.float64)
    assert got.count.tolist() == [int(np.isfinite(flat).sum())]
    assert got.mean[0] == pytest.approx(np.nanmean(flat), rel=1e-12)
    assert got.std[0] == pytest.approx(np.nanstd(flat), rel=1e-10)
    assert math.isfinite(got.scale()[0])


def test_an_older_file_reads_and_one_with_nan_is_refused(tmp_path):
    values = sst_and_wind()[..., 1:]
    values[np.isnan(values)] = 0.0
    path = write_h5(tmp_path / "d.h5", values)
    stored(path)
    target = statistics_file(path)
    doc = json.loads(target.read_text())
    entry = doc["datasets"]["train/f"]
    del entry["missing"]                                   # the form before NaN-awareness
    target.write_text(json.dumps(doc))
    assert load_statistics(path)["train/f"].count.tolist() == [ROWS * 48]
    entry["mean"] = [float("nan")]                         # written by the old code
    target.write_text(json.dumps(doc))
    with pytest.raises(ArrayDataError, match=r"non-finite mean or std .*'train/f' channel"
                                             r"\(s\) \[0\].*spmd data stats CONFIG"):
        load_statistics(path)
    # an older partial (one count for all channels) still merges
    part = partial_statistics(path, {"train/f": (True, ROWS)})
    old = json.loads(json.dumps(part))
    old["datasets"]["train/f"]["count"] = old["datasets"]["train/f"]["count"][0]
    old["datasets"]["train/f"].pop("missing")
    assert merge_statistics([old])["datasets"]["train/f"]["count"] == [ROWS * 48]
