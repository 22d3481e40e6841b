"""The weather flagship, configs/weather_era5.yaml, end to end as a user runs it (issue 35).

One module-scoped run, shared by every test here: ERA5-like yearly NetCDF4 files written by
xarray (tests/helpers/era5_files.py: u10 CF-packed int16, sst NaN over land, geopotential
with a level dimension), the flagship config pointed at them with overrides (a tiny FNO,
date splits of the fixture's two years), then `spmd data info`, `spmd data stats`,
`spmd run -n 2` (data.nan: mask, data.normalize, lat-weighted loss) and `spmd eval --json`.
Independent checks:
- the channel table and the test split's window count; NaN-aware statistics (land left out);
- finite losses and eval losses on 2 ranks with NaN over land;
- `spmd eval` scores every window of the test year once (363, in batches of 8: its last
  batch is partial) and says so, with the time range; persistence's lat-weighted RMSE over
  them equals one computed here with xarray from the files alone (cos-latitude weights of
  mean 1), per lead;
- `spmd eval --batches 2` on other files (t2m scaled by 1.1) scores their first 16 windows
  (persistence equal to xarray's on those files) with the statistics the run trained with:
  the run's normalization.json is byte for byte what training wrote;
- the anomaly correlation against the train split's climatology (acc_<channel>_<lead>, and
  persistence's) is reported, finite and in [-1, 1], land left out; the climatology's
  lat-weighted RMSE equals one computed with xarray from the train year's mean
  (tests/unit/tasks/test_weather_climatology.py checks the climatology against xarray).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.cli_batch import run_batch
from tests.helpers.env import REPO, clean_env, run_spmd

xr = pytest.importorskip("xarray")

BATCH, EVAL_BATCHES, STEPS = 8, 2, 6
FLAGSHIP = REPO / "configs" / "weather_era5.yaml"


def overrides(data, run) -> list[str]:
    """The flagship config on the fixture: its two years, a tiny FNO, a few steps; no plots
    (nothing here looks at them; test_weather_metrics checks lat_rmse.png)."""
    return [f"data.path={data}", f"run.dir={run}", "run.log_every=1", "run.progress=false",
            "run.plots=false",
            "data.splits.train.start=2000-01-01", "data.splits.train.end=2000-12-31",
            "data.splits.test.start=2001-01-01", "data.splits.test.end=2001-12-31",
            f"data.eval_batches={EVAL_BATCHES}", f"train.steps={STEPS}",
            f"train.batch_size={BATCH}", "train.eval_every=3", "schedule.warmup_steps=0",
            "model.width=8", "model.modes=2", "model.num_layers=1", "model.projection=8",
            "model.rollout_steps=2", "checkpoint.every=3", "checkpoint.persistent_every=3"]


@pytest.fixture(scope="module")
def flagship(tmp_path_factory):
    """Data info, data stats, a 2-rank run and `spmd eval` of the flagship, once."""
    from tests.helpers.era5_files import write_era5_years

    root = tmp_path_factory.mktemp("flagship")
    data, run = root / "era5", root / "run"
    write_era5_years(data, (2000, 2001), zlib_year=None, sst=True)
    env = clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO))
    keys = overrides(data, run)
    out = {"data": data, "run": run}
    # data info and data stats in one child process (tests/helpers/cli_batch.py)
    out["info"], out["stats"] = run_batch([
        ({**env, "SPMD_MPI": "0"}, ["data", "info", str(FLAGSHIP), *keys]),
        ({**env, "SPMD_MPI": "0"}, ["data", "stats", str(FLAGSHIP), *keys, "--json"])])
    out["train"] = run_spmd("run", "-n", "2", str(FLAGSHIP), *keys, env=env, cwd=REPO,
                            timeout=400)
    out["eval"] = out["eval_other"] = None
    if out["train"].returncode == 0:
        out["eval"] = run_spmd("eval", str(run), "--json", env=env, cwd=REPO, timeout=300)
        other = root / "other"              # the same layout, other values and statistics
        other.mkdir()
        for year in (2000, 2001):
            with xr.open_dataset(data / f"era5_{year}.nc") as ds:
                ds = ds.load()
            ds["t2m"] = ds["t2m"] * 1.1
            ds.to_netcdf(other / f"era5_{year}.nc")
        copy = run / "normalization.json"
        out["normalization"] = (copy.read_bytes(), copy.stat().st_mtime_ns)
        out["other"] = other
        out["eval_other"] = run_spmd("eval", str(run), "--json", "--batches", "2",
                                     f"data.path={other}", env=env, cwd=REPO, timeout=300)
    return out


def records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def eval_report(flagship, key: str = "eval") -> dict:
    out = flagship[key]
    assert out is not None and out.returncode == 0, (out.stderr[-3000:] if out else "no eval")
    return json.loads(out.stdout.splitlines()[-1])


def eval_metrics(flagship) -> dict:
    return eval_report(flagship)["metrics"]


def lat_weights(ds) -> np.ndarray:
    w = np.cos(np.deg2rad(ds["latitude"].values))
    return (w / w.mean())[None, :, None]


@pytest.mark.slow
def test_data_info_prints_channels_and_stats_skip_land(flagship):
    from tests.helpers.era5_files import grid, land

    info = flagship["info"]
    assert info.returncode == 0, info.stderr[-3000:]
    assert "geopotential_850" in info.stdout and "lsm" in info.stdout
    assert "u10" in info.stdout and "sst" in info.stdout
    assert "split test (2001-01-01T00:00 .. 2001-12-31T00:00): 363 windows" in info.stdout
    stats = flagship["stats"]
    assert stats.returncode == 0, stats.stderr[-3000:]
    channels = json.loads(stats.stdout.splitlines()[-1])["channels"]
    sea = int((~land(*grid())).sum())
    sst = channels["sst"]
    assert sst["count"] == 366 * sea and np.isfinite(sst["mean"])   # land NaN left out
    assert abs(channels["u10"]["mean"]) < 20                         # decoded, not raw counts


@pytest.mark.slow
def test_mask_trains_finite_on_two_ranks(flagship):
    """SST with NaN over land, data.nan: mask, data.normalize: `spmd run -n 2` trains with
    finite losses and evaluates."""
    r = flagship["train"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logged = records(flagship["run"])
    losses = [x["loss"] for x in logged if "loss" in x]
    evals = [x["eval_loss"] for x in logged if "eval_loss" in x]
    assert len(losses) == STEPS and np.isfinite(losses).all() and max(losses) < 50
    assert len(evals) == 3 and np.isfinite(evals).all()
    last = [x for x in logged if "eval_loss" in x][-1]
    assert np.isfinite(last["lat_mse_sst_1"]) and np.isfinite(last["persistence_lat_mse_t2m_1"])
    # each evaluation during training says what it scored: data.eval_batches whole batches
    assert (last["windows_scored"], last["windows_in_split"]) == (BATCH * EVAL_BATCHES, 363)
    assert (last["windows_from"], last["windows_to"]) == ("2001-01-01T00:00", "2001-01-18T00:00")


@pytest.mark.slow
def test_spmd_eval_reports_lat_weighted_rmse_against_persistence(flagship):
    metrics = eval_metrics(flagship)
    keys = [k for k in metrics if "lat_rmse" in k]
    assert {"lat_rmse_t2m_1", "lat_rmse_t2m_2", "persistence_lat_rmse_t2m_1",
            "persistence_lat_rmse_t2m_2"} <= set(keys)
    assert any("geopotential" in k for k in keys) and not any("lat_mse" in k for k in metrics)

    # every window of the test year once: 363 daily windows of 3 steps, in batches of 8
    report = eval_report(flagship)
    n = 363
    assert (report["windows_scored"], report["windows_in_split"]) == (n, n)
    assert (report["windows_from"], report["windows_to"]) == ("2001-01-01T00:00",
                                                              "2001-12-31T00:00")
    # persistence from the files alone, over all those windows
    ds = xr.open_dataset(flagship["data"] / "era5_2001.nc")
    t2m, w = ds["t2m"].values.astype(np.float64), lat_weights(ds)
    for lead in (1, 2):
        err = (t2m[lead:n + lead] - t2m[:n]) ** 2
        want = np.sqrt((err * w).mean(axis=(1, 2)).mean())
        assert metrics[f"persistence_lat_rmse_t2m_{lead}"] == pytest.approx(want, rel=1e-4)

    for lead in (1, 2):
        assert np.isfinite(metrics[f"lat_rmse_t2m_{lead}"])
        assert np.isfinite(metrics[f"lat_rmse_sst_{lead}"])      # land left out, not NaN
        for channel in ("t2m", "sst", "geopotential_850"):       # ACC vs the train climatology
            assert -1 <= metrics[f"acc_{channel}_{lead}"] <= 1, metrics.get(f"acc_{channel}_{lead}")
            assert -1 <= metrics[f"persistence_acc_{channel}_{lead}"] <= 1
            assert np.isfinite(metrics[f"climatology_lat_rmse_{channel}_{lead}"])

    # the climatology baseline from the files alone: the train year's mean, as the forecast
    clim = xr.open_dataset(flagship["data"] / "era5_2000.nc")["t2m"].values.astype(
        np.float64).mean(0)
    for lead in (1, 2):
        err = (t2m[lead:n + lead] - clim) ** 2
        want = np.sqrt((err * w).mean(axis=(1, 2)).mean())
        assert metrics[f"climatology_lat_rmse_t2m_{lead}"] == pytest.approx(want, rel=1e-4)


def test_gridded_names_are_exported_where_users_look():
    import spmd
    import spmd.data
    from spmd.data.sources.gridded_windows import GriddedWindowSource
    from spmd.tasks.gridded_task import GriddedTrajectoryTask
    from spmd.tasks.weather_fno import WeatherFNO

    assert spmd.GriddedTrajectoryTask is GriddedTrajectoryTask
    assert spmd.data.GriddedWindowSource is GriddedWindowSource
    assert "GriddedTrajectoryTask" in spmd.__all__ and "GriddedWindowSource" in spmd.data.__all__
    assert issubclass(WeatherFNO, spmd.GriddedTrajectoryTask)
    assert "spmd.tasks.weather_fno:WeatherFNO" in FLAGSHIP.read_text()


@pytest.mark.slow
def test_eval_on_other_files_keeps_the_runs_statistics_and_scores_what_it_is_told(flagship):
    report = eval_report(flagship, "eval_other")
    assert (report["windows_scored"], report["windows_in_split"]) == (BATCH * 2, 363)
    copy = flagship["run"] / "normalization.json"
    assert (copy.read_bytes(), copy.stat().st_mtime_ns) == flagship["normalization"]
    ds = xr.open_dataset(flagship["other"] / "era5_2001.nc")
    t2m, w, n = ds["t2m"].values.astype(np.float64), lat_weights(ds), BATCH * 2
    for lead in (1, 2):                      # the other files' values, not the run's data
        err = (t2m[lead:n + lead] - t2m[:n]) ** 2
        want = np.sqrt((err * w).mean(axis=(1, 2)).mean())
        assert report["metrics"][f"persistence_lat_rmse_t2m_{lead}"] == pytest.approx(
            want, rel=1e-4)


@pytest.mark.slow
def test_predict_writes_a_netcdf_forecast_in_physical_units_with_coordinates(flagship,
                                                                           tmp_path):
    """Issue 49, item 7: `spmd predict` reads the files the run trained on (constants,
    levels, NaN over land) and writes a forecast xarray opens with its coordinates."""
    out = tmp_path / "forecast.nc"
    r = run_spmd("predict", str(flagship["run"]), "--input", str(flagship["data"]),
                 "--output", str(out), "--rollout", "2",
                 env=clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO)), cwd=REPO,
                 timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    fc = xr.open_dataset(out)
    truth = xr.open_dataset(flagship["data"] / "era5_2001.nc")
    channels = ["t2m", "u10", "v10", "sst", "geopotential_500", "geopotential_850"]
    assert [v for v in fc.data_vars] == channels
    assert fc["t2m"].dims == ("time", "lead", "latitude", "longitude")
    n = 364                          # every test window of 1 input and 1 target step
    assert fc.sizes == {"time": n, "lead": 2, "latitude": 6, "longitude": 12}
    np.testing.assert_array_equal(fc["time"].values, truth["time"].values[:n])
    np.testing.assert_array_equal(fc["valid_time"].values[:, 0], truth["time"].values[1:n + 1])
    assert list(fc["prediction_timedelta"].values) == [np.timedelta64(24, "h"),
                                                       np.timedelta64(48, "h")]
    np.testing.assert_array_equal(fc["latitude"].values, truth["latitude"].values)
    assert fc["t2m"].attrs["units"] == truth["t2m"].attrs["units"] == "K"
    pred = fc["t2m"].values
    assert np.isfinite(pred).all() and not np.array_equal(pred[:, 0], pred[:, 1])
    # physical units: within a few kelvin of the truth after 6 training steps, not z-scores
    assert abs(pred[:, 0].mean() - truth["t2m"].values[1:n + 1].mean()) < 5, pred.mean()
    z500 = fc["geopotential_500"].values[:, 0]
    want = truth["geopotential"].sel(level=500).values[1:n + 1]
    assert abs(z500.mean() - want.mean()) < 0.1 * abs(want.mean())

    # on other files (t2m x 1.1), as data.path too: the run's statistics, untouched
    other = tmp_path / "other.nc"
    r = run_spmd("predict", str(flagship["run"]), "--input", str(flagship["other"]),
                 "--output", str(other), f"data.path={flagship['other']}",
                 env=clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO)), cwd=REPO,
                 timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    copy = flagship["run"] / "normalization.json"
    assert (copy.read_bytes(), copy.stat().st_mtime_ns) == flagship["normalization"]
    assert xr.open_dataset(other).sizes["lead"] == 1


@pytest.mark.slow
def test_a_run_whose_data_moved_loads_with_the_new_path_and_says_what_is_missing(
        flagship, tmp_path):
    """Issue 49, item 8: the run's kept statistics cover moved data; a missing path is
    named missing, not "possibly truncated"."""
    import shutil
    import subprocess
    import sys

    moved = tmp_path / "moved"
    shutil.copytree(flagship["data"], moved, ignore=shutil.ignore_patterns("stats.json"))
    run = tmp_path / "run"
    shutil.copytree(flagship["run"], run, ignore=shutil.ignore_patterns("local"))
    config = run / "config.yaml"
    config.write_text(config.read_text().replace(str(flagship["data"]), str(tmp_path / "gone")))
    code = (f"import spmd\nfrom spmd.errors import SpmdError\n"
            f"t = spmd.load({str(run)!r}, overrides=['data.path={moved}'])\n"
            f"print(type(t.model).__name__, t.step)\n"
            f"try:\n    spmd.load({str(run)!r})\n"
            f"except SpmdError as e:\n    print('ERROR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO)),
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    loaded, error = r.stdout.splitlines()[-2:]
    assert loaded.split()[1] == str(STEPS), loaded
    assert "does not exist" in error and str(tmp_path / "gone") in error, error
    assert "truncated" not in error
