"""Climate-model files through `spmd run` and `spmd eval` (issue 49, items 5 and 6): the
weather flagship's config on files written by xarray through cftime, as CMIP writes them:

- `tas` annual means of a 200-year 360_day control run (stamped mid-year);
- `tos` monthly means on the noleap calendar, stamped at the middle of each month's bounds,
  land as _FillValue (data.nan: mask).

Each trains on 1 rank with date splits written in its own calendar (`2049-12-30` is the
last day of a 360-day year) and is evaluated; the evaluation scores every window of the test
split once, says which (as dates of the file's calendar), and its persistence RMSE equals one
computed with xarray from the file alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.env import REPO, clean_env, run_spmd, side_by_side
from tests.unit.test_calendars import cmip_monthly, dates, write

xr = pytest.importorskip("xarray")

FLAGSHIP = REPO / "configs" / "weather_era5.yaml"
# (file, variable, nan policy, train end, test start, test windows, first and last test time)
CASES = {
    "annual_360_day": ("tas_Amon_piControl.nc", "tas", "error", "2009-12-30", "2010",
                       40 - 2, "2010-07-01T00:00", "2049-07-01T00:00"),
    "monthly_noleap": ("tos_Omon.nc", "tos", "mask", "1992-12", "1993-01",
                       24 - 2, "1993-01-16T12:00", "1994-12-16T12:00"),
}


def keys(data, run, variable, nan, train_end, test_start) -> list[str]:
    return [f"data.path={data}", f"run.dir={run}", "run.log_every=1", "run.progress=false",
            "run.plots=false", f"data.variables=[{variable}]", "data.constants=[latitude]",
            f"data.nan={nan}", "data.latitude_order=as_stored",
            f"data.splits.train.end={train_end}", f"data.splits.test.start={test_start}",
            "data.splits.train.start=null", "data.splits.test.end=null",
            "train.steps=4", "train.batch_size=8", "train.eval_every=4",
            "schedule.warmup_steps=0", "model.width=8", "model.modes=2", "model.num_layers=1",
            "model.projection=8", "model.rollout_steps=2", "checkpoint.every=4",
            "checkpoint.persistent_every=4"]


@pytest.fixture(scope="module")
def climate_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("climate")
    write(root / CASES["annual_360_day"][0], dates("1850-07-01", 200, "YS-JUL", "360_day"),
          name="tas")
    cmip_monthly(root / CASES["monthly_noleap"][0], 60)
    env = clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO))

    def train_and_eval(case: str) -> dict:
        path, variable, nan, train_end, test_start, *_ = CASES[case]
        run = root / f"run_{case}"
        args = keys(root / path, run, variable, nan, train_end, test_start)
        train = run_spmd("run", "-n", "1", str(FLAGSHIP), *args, env=env, cwd=REPO,
                         timeout=400)
        evaluation = (run_spmd("eval", str(run), "--json", env=env, cwd=REPO, timeout=300)
                      if train.returncode == 0 else None)
        return {"data": root / path, "run": run, "train": train, "eval": evaluation}

    return dict(zip(CASES, side_by_side(*(lambda c=c: train_and_eval(c) for c in CASES))))


@pytest.mark.parametrize("case", list(CASES))
def test_climate_files_train_and_every_test_window_is_scored(climate_runs, case):
    out = climate_runs[case]
    _, variable, _, _, test_start, windows, first, last = CASES[case]
    train = out["train"]
    assert train.returncode == 0, train.stderr[-4000:]
    records = [json.loads(x) for x in (out["run"] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and np.all(np.isfinite(losses)), losses
    assert out["eval"] is not None and out["eval"].returncode == 0, out["eval"].stderr[-4000:]
    report = json.loads(out["eval"].stdout.splitlines()[-1])
    assert (report["windows_scored"], report["windows_in_split"]) == (windows, windows)
    assert (report["windows_from"], report["windows_to"]) == (first, last)

    # persistence over those windows from the file alone (cos-latitude weights of mean 1)
    coder = xr.coders.CFDatetimeCoder(use_cftime=True)
    with xr.open_dataset(out["data"], decode_times=coder) as ds:
        test = ds.sel(time=slice(test_start, None))
        x = test[variable].values.astype(np.float64)
        w = np.cos(np.deg2rad(ds["lat"].values))
    w = (w / w.mean())[None, :, None] * np.ones_like(x[:1])
    metrics = report["metrics"]
    for lead in (1, 2):
        err = (x[lead:windows + lead] - x[:windows]) ** 2
        valid = np.isfinite(err)
        weights = np.broadcast_to(w, err.shape)
        per_window = (np.where(valid, err, 0) * weights).sum((1, 2)) / (valid * weights).sum(
            (1, 2))
        want = np.sqrt(per_window.mean())
        got = metrics[f"persistence_lat_rmse_{variable}_{lead}"]
        assert got == pytest.approx(want, rel=1e-4), (lead, got, want)
        assert np.isfinite(metrics[f"lat_rmse_{variable}_{lead}"])
