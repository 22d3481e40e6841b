"""Climate and reanalysis files through `spmd run` and `spmd eval` (issue 49): the weather
flagship's config on files written by xarray as the field writes them:

- `annual_360_day`: `tas` annual means of a 200-year 360_day control run (cftime, stamped
  mid-year);
- `monthly_noleap`: `tos` monthly means on the noleap calendar, stamped at the middle of
  each month's bounds, land as _FillValue (data.nan: mask);
- `cds_archive`: an ERA5 archive as a user has one after the CDS changed its format: 2000
  downloaded before 2024 (NetCDF3, every variable packed into int16, `time`, `level`) and
  2001 after (NetCDF4, `valid_time`, `pressure_level`), four channels, geopotential on two
  levels, the land-sea mask and latitude as constants.

Each trains on 1 rank with date splits written in its own calendar (`2009-12-30` is the
last day of a 360-day year) and is evaluated; the evaluation scores every window of the test
split once, says which (as dates of the file's calendar), and its persistence RMSE equals one
computed with xarray from the file alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.env import REPO, clean_env, run_spmd, side_by_side
from tests.unit.data.cf.test_calendars import cmip_monthly, dates, write

xr = pytest.importorskip("xarray")

FLAGSHIP = REPO / "configs" / "weather_era5.yaml"
CASES = {
    "annual_360_day": {"data": "tas_Amon_piControl.nc", "test_file": "tas_Amon_piControl.nc",
                       "variables": "[tas]", "scored": "tas", "nan": "error",
                       "constants": "[latitude]", "train_end": "2009-12-30",
                       "test_start": "2010", "windows": 40 - 2,
                       "first": "2010-07-01T00:00", "last": "2049-07-01T00:00"},
    "monthly_noleap": {"data": "tos_Omon.nc", "test_file": "tos_Omon.nc",
                       "variables": "[tos]", "scored": "tos", "nan": "mask",
                       "constants": "[latitude]", "train_end": "1992-12",
                       "test_start": "1993-01", "windows": 24 - 2,
                       "first": "1993-01-16T12:00", "last": "1994-12-16T12:00"},
    "cds_archive": {"data": "era5", "test_file": "era5/era5_2001.nc",
                    "variables": "[t2m, u10, msl, {geopotential: [500, 850]}]",
                    "scored": "t2m", "nan": "error", "constants": "[lsm, latitude]",
                    "train_end": "2000-12-31", "test_start": "2001-01-01",
                    "windows": 365 - 2, "first": "2001-01-01T00:00",
                    "last": "2001-12-31T00:00"},
}


def keys(data, run, case: dict) -> list[str]:
    return [f"data.path={data}", f"run.dir={run}", "run.log_every=1", "run.progress=false",
            "run.plots=false", f"data.variables={case['variables']}",
            f"data.constants={case['constants']}", f"data.nan={case['nan']}",
            f"data.splits.train.end={case['train_end']}",
            f"data.splits.test.start={case['test_start']}",
            "data.splits.train.start=null", "data.splits.test.end=null",
            "train.steps=4", "train.batch_size=8", "train.eval_every=4",
            "schedule.warmup_steps=0", "model.width=8", "model.modes=2", "model.num_layers=1",
            "model.projection=8", "model.rollout_steps=2", "checkpoint.every=4",
            "checkpoint.persistent_every=4"]


def write_cds_archive(root) -> None:
    """2000 as the CDS wrote it before 2024, 2001 as it writes it now."""
    from tests.helpers.era5_files import PACKED, TIME_UNITS, dataset, grid, times, write_era5_years

    write_era5_years(root, (2000,), legacy_cds=True)
    ds = dataset(times((2001,)), *grid()).rename(time="valid_time", level="pressure_level")
    ds.to_netcdf(root / "era5_2001.nc", engine="netcdf4", format="NETCDF4",
                 encoding={"valid_time": dict(TIME_UNITS), "u10": dict(PACKED)})


@pytest.fixture(scope="module")
def climate_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("climate")
    write(root / CASES["annual_360_day"]["data"], dates("1850-07-01", 200, "YS-JUL", "360_day"),
          name="tas")
    cmip_monthly(root / CASES["monthly_noleap"]["data"], 60)
    write_cds_archive(root / CASES["cds_archive"]["data"])
    env = clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO))

    def train_and_eval(name: str) -> dict:
        case = CASES[name]
        run = root / f"run_{name}"
        train = run_spmd("run", "-n", "1", str(FLAGSHIP), *keys(root / case["data"], run, case),
                         env=env, cwd=REPO, timeout=400)
        evaluation = (run_spmd("eval", str(run), "--json", env=env, cwd=REPO, timeout=300)
                      if train.returncode == 0 else None)
        return {"test_file": root / case["test_file"], "run": run, "train": train,
                "eval": evaluation}

    return dict(zip(CASES, side_by_side(*(lambda c=c: train_and_eval(c) for c in CASES))))


@pytest.mark.parametrize("name", list(CASES))
def test_climate_files_train_and_every_test_window_is_scored(climate_runs, name):
    out, case = climate_runs[name], CASES[name]
    train = out["train"]
    assert train.returncode == 0, train.stderr[-4000:]
    records = [json.loads(x) for x in (out["run"] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and np.all(np.isfinite(losses)), losses
    assert out["eval"] is not None and out["eval"].returncode == 0, out["eval"].stderr[-4000:]
    report = json.loads(out["eval"].stdout.splitlines()[-1])
    windows = case["windows"]
    assert (report["windows_scored"], report["windows_in_split"]) == (windows, windows)
    assert (report["windows_from"], report["windows_to"]) == (case["first"], case["last"])

    # persistence over those windows from the file alone (cos-latitude weights of mean 1)
    coder = xr.coders.CFDatetimeCoder(use_cftime=True)
    with xr.open_dataset(out["test_file"], decode_times=coder) as ds:
        time = "valid_time" if "valid_time" in ds.dims else "time"
        test = ds.sel({time: slice(case["test_start"], None)})
        x = test[case["scored"]].values.astype(np.float64)
        lat = ds["lat" if "lat" in ds.coords else "latitude"].values
    w = np.cos(np.deg2rad(lat))
    w = np.broadcast_to((w / w.mean())[None, :, None], x[:1].shape)
    metrics = report["metrics"]
    for lead in (1, 2):
        err = (x[lead:windows + lead] - x[:windows]) ** 2
        valid = np.isfinite(err)
        weights = np.broadcast_to(w, err.shape)
        per_window = (np.where(valid, err, 0) * weights).sum((1, 2)) / (valid * weights).sum(
            (1, 2))
        want = np.sqrt(per_window.mean())
        got = metrics[f"persistence_lat_rmse_{case['scored']}_{lead}"]
        assert got == pytest.approx(want, rel=1e-4), (lead, got, want)
        assert np.isfinite(metrics[f"lat_rmse_{case['scored']}_{lead}"])
