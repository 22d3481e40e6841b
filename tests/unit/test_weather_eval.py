"""`spmd eval` of a weather emulator reports latitude-weighted RMSE against persistence.

End to end, as a user runs it: ERA5-like yearly NetCDF4 files written by xarray
(tests/helpers/era5_files.py), a tiny GriddedTrajectoryTask trained for a few steps
(`spmd train`), then `spmd eval --json`. Two independent checks:
- persistence's lat-weighted RMSE equals one computed here with xarray from the files alone
  (cos-latitude weights of mean 1, the first eval windows of the test year), per lead;
- the model's lat_rmse is the square root of the lat_mse the last evaluation logged in
  metrics.jsonl (the same parameters and the same eval batches).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.env import REPO, clean_env, run_spmd

xr = pytest.importorskip("xarray")

BATCH, EVAL_BATCHES = 8, 2
CONFIG = """\
task: tests.helpers.weather_task:TinyWeatherTask
run: {{dir: {run}, log_every: 1, progress: false}}
model: {{rollout_steps: 2}}
train: {{steps: 3, batch_size: {batch}, eval_every: 3}}
optimizer: {{lr: 1.0e-3}}
data:
  source: netcdf
  path: {data}
  variables: [t2m, {{geopotential: [500]}}]
  splits: {{train: {{end: 2000-12-31}}, test: {{start: 2001-01-01}}}}
  eval_batches: {eval_batches}
  window: {{input_steps: 1, target_steps: 1, stride: 1}}
"""


@pytest.mark.slow
def test_spmd_eval_reports_lat_weighted_rmse_against_persistence(tmp_path):
    from tests.helpers.era5_files import write_era5_years

    data = tmp_path / "era5"
    write_era5_years(data, (2000, 2001), zlib_year=None)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(run=tmp_path / "run", data=data, batch=BATCH,
                                    eval_batches=EVAL_BATCHES))
    env = clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO))
    r = run_spmd("train", str(config), env=env, cwd=REPO, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = run_spmd("eval", str(tmp_path / "run"), "--json", env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads(out.stdout.splitlines()[-1])["metrics"]

    keys = [k for k in metrics if "lat_rmse" in k]
    assert {"lat_rmse_t2m_1", "lat_rmse_t2m_2", "persistence_lat_rmse_t2m_1",
            "persistence_lat_rmse_t2m_2"} <= set(keys)
    assert any("geopotential" in k for k in keys) and not any("lat_mse" in k for k in metrics)

    # persistence from the files alone: the first BATCH * EVAL_BATCHES windows of 2001
    ds = xr.open_dataset(data / "era5_2001.nc")
    t2m = ds["t2m"].values.astype(np.float64)
    w = np.cos(np.deg2rad(ds["latitude"].values))
    w = (w / w.mean())[None, :, None]
    n = BATCH * EVAL_BATCHES
    for lead in (1, 2):
        err = (t2m[lead:n + lead] - t2m[:n]) ** 2
        want = np.sqrt((err * w).mean(axis=(1, 2)).mean())
        assert metrics[f"persistence_lat_rmse_t2m_{lead}"] == pytest.approx(want, rel=1e-4)

    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines() if x]
    last = [x for x in records if "lat_mse_t2m_1" in x][-1]
    for lead in (1, 2):
        assert metrics[f"lat_rmse_t2m_{lead}"] == pytest.approx(
            np.sqrt(last[f"lat_mse_t2m_{lead}"]), rel=1e-5)
        assert np.isfinite(metrics[f"lat_rmse_t2m_{lead}"])
