"""GriddedWindowSource.channel_statistics merges blocks with the pairwise (Chan et al.)
update of spmd.data.stats.normalization, not a sum of squares: a field of large mean
(geopotential, ~5e4) keeps its standard deviation to float64 rounding (issue 35)."""

from __future__ import annotations

import numpy as np
import pytest

from spmd.data.batch import BatchField
from spmd.data.cf.channels import parse_channels
from spmd.data.sources.gridded_windows import GriddedWindowSource
from tests.helpers.era5_files import TIME_UNITS, grid, times

xr = pytest.importorskip("xarray")
AXES = ("batch", "x", "y", "channels")


def test_std_of_a_large_mean_field_keeps_its_precision(tmp_path):
    lat, lon = grid()
    t = times((2000, 2001, 2002, 2003))
    rng = np.random.default_rng(0)
    z = (5e4 + rng.normal(size=(len(t), len(lat), len(lon)))).astype(np.float32)
    small = (1e7 + 10 * rng.normal(size=z.shape)).astype(np.float32)   # float32 step: 1
    ds = xr.Dataset({"z": (("time", "latitude", "longitude"), z),
                     "big": (("time", "latitude", "longitude"), small)},
                    coords={"time": t, "latitude": lat, "longitude": lon})
    path = tmp_path / "z.nc"
    ds.to_netcdf(path, encoding={"time": dict(TIME_UNITS)}, engine="netcdf4")
    fields = {n: BatchField((len(lat), len(lon), 2), np.float32, AXES)
              for n in ("input", "target")}
    src = GriddedWindowSource(path, parse_channels(["z", "big"]), fields, 4,
                              input_name="input", target_name="target", shuffle=False)
    assert src.count == len(t) - 1
    src._block_rows = 97                     # many blocks of an odd size, merged pairwise
    assert len(list(src.split_frames())) == -(-len(t) // 97)
    stats = src.channel_statistics()
    for i, v in enumerate((z, small)):
        values = v.astype(np.float64)
        assert stats["count"][i] == v.size
        assert stats["mean"][i] == pytest.approx(values.mean(), rel=1e-12)
        assert stats["std"][i] == pytest.approx(values.std(), rel=1e-9)
    assert abs(stats["std"][0] - 1.0) < 1e-3
    # sum-of-squares (the former formula) on the same values: far off for the 1e7 field
    x = small.astype(np.float64).ravel()
    naive = np.sqrt(max(float((x * x).sum()) / x.size - x.mean() ** 2, 0.0))
    assert abs(naive - x.std()) > 1e3 * abs(stats["std"][1] - x.std())
