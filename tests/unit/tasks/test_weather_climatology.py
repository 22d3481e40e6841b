"""The weather flagship's climatology (issue 35): GriddedTrajectoryTask.climatology() is the
train split's per-point mean, NaN over land left out, equal to xarray's mean over the train
year of the xarray-written files; the ACC against it is 1 for a perfect forecast."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.env import REPO

xr = pytest.importorskip("xarray")


def test_climatology_is_the_train_years_mean_and_perfect_acc_is_one(tmp_path):
    import jax.numpy as jnp

    from spmd.config.load import build_task, load_config
    from spmd.scores.weather import acc
    from spmd.tasks.weather_fno import WeatherFNO
    from tests.helpers.era5_files import write_era5_years

    data = tmp_path / "era5"
    write_era5_years(data, (2000, 2001), zlib_year=None, sst=True, reversed_lat_year=2001)
    keys = [f"data.path={data}", f"run.dir={tmp_path / 'run'}", "model.modes=2",
            "data.splits.train.start=2000-01-01", "data.splits.train.end=2000-12-31",
            "data.splits.test.start=2001-01-01", "data.splits.test.end=2001-12-31"]
    task = build_task(load_config(REPO / "configs" / "weather_era5.yaml", keys,
                                  task=WeatherFNO))
    clim = task.climatology()
    assert clim.shape == (6, 12, 6) and clim.dtype == np.float32
    ds = xr.open_dataset(data / "era5_2000.nc")
    for i, (name, sel) in enumerate([("t2m", {}), ("u10", {}), ("v10", {}), ("sst", {}),
                                     ("geopotential", {"level": 500}),
                                     ("geopotential", {"level": 850})]):
        v = ds[name].sel(**sel).astype(np.float64)
        want = v.mean("time", skipna=True).values                      # NaN over land
        np.testing.assert_allclose(clim[..., i], want, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert np.isnan(clim[..., 3]).sum() == 8 and np.isfinite(clim[..., :3]).all()

    # over a read limit: the first 1/k of each block of the train times, a per-point mean
    from spmd.tasks.gridded_task import train_climatology

    source = task._statistics_source()
    assert source.count == 365                         # windows of 2 steps: 366 train times
    rows, frame_bytes = min(source.block_rows, 366), 4 * 6 * 12 * 6
    limit = 366 * frame_bytes // 3
    every = -(-366 * frame_bytes // limit)                      # 3 or 4
    part = train_climatology(source, max_bytes=limit)
    times = np.concatenate([np.arange(a, min(a + -(-rows // every), 366))
                            for a in range(0, 366, rows)])
    assert 366 // every <= len(times) < 366
    want = ds["t2m"].astype(np.float64).isel(time=times).mean("time").values
    np.testing.assert_allclose(part[..., 0], want, rtol=1e-6)

    frames = jnp.asarray(np.stack([ds[n].values[:4] for n in ("t2m", "u10", "v10")], -1))
    perfect = acc(frames, frames, jnp.asarray(clim[..., :3]), task.latitudes())
    np.testing.assert_allclose(np.asarray(perfect), 1.0, rtol=1e-5)
