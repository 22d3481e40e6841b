"""spmd.scores.weather against straightforward loops and against xarray's weighted means.

The loops below write WeatherBench2's definitions out element by element (no broadcasting
shared with the module); xarray's `DataArray.weighted(w).mean(skipna=True)` is the reference
WeatherBench2 itself computes with.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd.scores import weather as wm

LAT = np.linspace(90, -90, 7)            # ERA5 order, poles included
LAT_INNER = np.array([-60.0, -20.0, 10.0, 45.0, 80.0])


def fields(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


def loop_weights(lat):
    w = [math.cos(math.radians(x)) for x in lat]
    mean = sum(w) / len(w)
    return [x / mean for x in w]


def loop_rmse(f, t, lat, valid=None):
    """f, t: (sample, lead, lat, lon, channel); sqrt of the mean over samples of the weighted
    spatial mean over the valid points."""
    w = loop_weights(lat)
    s, leads, ny, nx, c = f.shape
    out = np.zeros((leads, c))
    for k in range(leads):
        for ch in range(c):
            per_sample = []
            for i in range(s):
                num = den = 0.0
                for y in range(ny):
                    for x in range(nx):
                        ok = valid is None or valid[i, k, y, x, ch]
                        if ok and np.isfinite(f[i, k, y, x, ch]) and np.isfinite(t[i, k, y, x, ch]):
                            num += w[y] * (f[i, k, y, x, ch] - t[i, k, y, x, ch]) ** 2
                            den += w[y]
                if den > 0:
                    per_sample.append(num / den)
            out[k, ch] = math.sqrt(sum(per_sample) / len(per_sample))
    return out


def loop_acc(f, t, clim, lat):
    w = loop_weights(lat)
    s, leads, ny, nx, c = f.shape
    out = np.zeros((leads, c))
    for k in range(leads):
        for ch in range(c):
            total = 0.0
            for i in range(s):
                fo = ff = oo = 0.0
                for y in range(ny):
                    for x in range(nx):
                        fa = f[i, k, y, x, ch] - clim[y, x, ch]
                        oa = t[i, k, y, x, ch] - clim[y, x, ch]
                        fo += w[y] * fa * oa
                        ff += w[y] * fa * fa
                        oo += w[y] * oa * oa
                total += fo / math.sqrt(ff * oo)
            out[k, ch] = total / s
    return out


def test_latitude_weights_have_mean_one_and_follow_cos():
    w = wm.latitude_weights(LAT)
    assert w.mean() == pytest.approx(1.0)
    np.testing.assert_allclose(w, loop_weights(LAT), rtol=1e-12, atol=1e-15)
    assert w[0] == 0 and w[-1] == 0 and w[3] == w.max()        # poles 0, equator largest
    np.testing.assert_allclose(wm.latitude_weights(LAT[::-1]), w[::-1])


def test_area_weights_are_wb2_cell_areas():
    lat = np.linspace(-90, 90, 5)
    x = np.deg2rad(lat)
    bounds = np.concatenate([[-np.pi / 2], (x[:-1] + x[1:]) / 2, [np.pi / 2]])
    area = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    np.testing.assert_allclose(wm.latitude_weights(lat, "area"), area / area.mean())
    np.testing.assert_allclose(wm.latitude_weights(lat[::-1], "area"), (area / area.mean())[::-1])
    assert wm.latitude_weights(lat, "area")[0] > 0


def test_latitude_weights_refuse_radians_and_2d():
    with pytest.raises(ValueError, match=r"\[-90, 90\]"):
        wm.latitude_weights([0.0, 100.0])
    with pytest.raises(ValueError, match="1-D"):
        wm.latitude_weights(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="kind"):
        wm.latitude_weights(LAT, "gauss")


def test_rmse_per_lead_and_channel_equals_loops():
    f, t = fields(0, (4, 3, 7, 6, 2)), fields(1, (4, 3, 7, 6, 2))
    got = wm.rmse(f, t, LAT)
    assert got.shape == (3, 2)
    np.testing.assert_allclose(got, loop_rmse(f, t, LAT), rtol=1e-12)
    # a plain (unweighted) RMSE differs: the weighting does something
    assert not np.allclose(got, np.sqrt(((f - t) ** 2).mean(axis=(0, 2, 3))), rtol=1e-3)


def test_rmse_ignores_nan_and_mask_as_loops_do():
    f, t = fields(2, (3, 2, 5, 4, 2)), fields(3, (3, 2, 5, 4, 2))
    t[:, :, 1:3, 0:2, 0] = np.nan              # land in channel 0
    f[0, 1, 4, 3, 1] = np.nan                  # one bad forecast value
    land = np.ones((5, 4, 2), bool)
    land[0, :, 1] = False                      # a masked row in channel 1
    got = wm.rmse(f, t, LAT_INNER, mask=land)
    valid = np.broadcast_to(land, f.shape)
    np.testing.assert_allclose(got, loop_rmse(f, t, LAT_INNER, valid), rtol=1e-12)
    assert np.all(np.isfinite(got))


def test_a_sample_with_no_valid_point_is_left_out_and_all_nan_is_nan():
    f, t = fields(4, (3, 1, 5, 4, 1)), fields(5, (3, 1, 5, 4, 1))
    t[1] = np.nan
    np.testing.assert_allclose(wm.rmse(f, t, LAT_INNER),
                               wm.rmse(f[[0, 2]], t[[0, 2]], LAT_INNER))
    t[:] = np.nan
    assert np.isnan(wm.rmse(f, t, LAT_INNER)).all()


def test_acc_equals_loops_and_is_one_for_a_perfect_forecast():
    f, t = fields(6, (4, 2, 7, 5, 3)), fields(7, (4, 2, 7, 5, 3))
    clim = fields(8, (7, 5, 3))
    lat = np.linspace(80, -80, 7)
    np.testing.assert_allclose(wm.acc(f, t, clim, lat), loop_acc(f, t, clim, lat), rtol=1e-12)
    np.testing.assert_allclose(wm.acc(t, t, clim, lat), 1.0)
    np.testing.assert_allclose(wm.acc(2 * t - clim, t, clim, lat), 1.0)   # scaled anomaly
    np.testing.assert_allclose(wm.acc(2 * clim - t, t, clim, lat), -1.0)


def test_persistence_and_climatology_baselines():
    traj = np.cumsum(fields(9, (12, 5, 4, 2)), axis=0)            # (time, lat, lon, C)
    initial = traj[:8]                                            # 8 start times
    truth = np.stack([traj[1 + k: 9 + k] for k in range(3)], 1)   # leads 1..3
    got = wm.persistence_rmse(initial, truth, LAT_INNER)
    want = loop_rmse(np.repeat(initial[:, None], 3, axis=1), truth, LAT_INNER)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.all(np.diff(got, axis=0) > 0)        # a random walk drifts away with lead

    clim = wm.climatology(traj)
    np.testing.assert_allclose(clim, traj.mean(axis=0))
    got = wm.climatology_rmse(clim, truth, LAT_INNER)
    want = loop_rmse(np.broadcast_to(clim, truth.shape), truth, LAT_INNER)
    np.testing.assert_allclose(got, want, rtol=1e-12)

    gappy = traj.copy()
    gappy[:6, 0, 0, 0] = np.nan
    assert wm.climatology(gappy)[0, 0, 0] == pytest.approx(traj[6:, 0, 0, 0].mean())


def test_jax_inputs_give_jax_results_inside_jit():
    f, t = fields(10, (4, 2, 7, 6, 2)), fields(11, (4, 2, 7, 6, 2))
    t[:, :, 2, 2, 0] = np.nan
    got = jax.jit(lambda a, b: wm.rmse(a, b, LAT))(jnp.asarray(f), jnp.asarray(t))
    assert isinstance(got, jax.Array)
    np.testing.assert_allclose(np.asarray(got), wm.rmse(f, t, LAT), rtol=1e-5)


def test_weather_scores_and_finish_scores_give_rmse_per_channel_and_lead():
    f, t = fields(12, (6, 2, 5, 4, 2)), fields(13, (6, 2, 5, 4, 2))
    initial = fields(14, (6, 5, 4, 2))
    clim = np.zeros((5, 4, 2))
    scores = jax.jit(lambda a, b, x: wm.weather_scores(
        [a[:, 0], a[:, 1]], [b[:, 0], b[:, 1]], x, LAT_INNER, channels=["t2m", "z500"],
        climate=clim))(jnp.asarray(f), jnp.asarray(t), jnp.asarray(initial))
    assert sorted(scores) == sorted(
        f"{p}_{c}_{k}" for p in ("lat_mse", "persistence_lat_mse", "climatology_lat_mse",
                                 "acc", "persistence_acc")
        for c in ("t2m", "z500") for k in (1, 2))
    held = np.repeat(initial[:, None], 2, axis=1)
    clim = fields(15, (5, 4, 2))
    got = {k: float(v) for k, v in wm.weather_scores(
        [f[:, 0], f[:, 1]], [t[:, 0], t[:, 1]], initial, LAT_INNER, climate=clim).items()}
    climate_rmse = loop_rmse(np.broadcast_to(clim, t.shape), t, LAT_INNER)
    model_acc, held_acc = loop_acc(f, t, clim, LAT_INNER), loop_acc(held, t, clim, LAT_INNER)
    done = wm.finish_scores(got)
    for k in (1, 2):
        for i, c in enumerate(("c0", "c1")):
            assert done[f"climatology_lat_rmse_{c}_{k}"] == pytest.approx(
                climate_rmse[k - 1, i], rel=1e-10)
            assert done[f"acc_{c}_{k}"] == pytest.approx(model_acc[k - 1, i], rel=1e-10)
            assert done[f"persistence_acc_{c}_{k}"] == pytest.approx(held_acc[k - 1, i],
                                                                     rel=1e-10)
    # two equal batches averaged (as evaluate() does), then the square roots
    half = {k: float(v) for k, v in wm.weather_scores(
        [f[:3, 0], f[:3, 1]], [t[:3, 0], t[:3, 1]], initial[:3], LAT_INNER).items()}
    other = {k: float(v) for k, v in wm.weather_scores(
        [f[3:, 0], f[3:, 1]], [t[3:, 0], t[3:, 1]], initial[3:], LAT_INNER).items()}
    done = wm.finish_scores({"eval_loss": 0.5, **{k: (half[k] + other[k]) / 2 for k in half}})
    assert done["eval_loss"] == 0.5
    want = loop_rmse(f, t, LAT_INNER)
    persisted = loop_rmse(np.repeat(initial[:, None], 2, axis=1), t, LAT_INNER)
    for k in (1, 2):
        for i, c in enumerate(("c0", "c1")):
            assert done[f"lat_rmse_{c}_{k}"] == pytest.approx(want[k - 1, i], rel=1e-10)
            assert done[f"persistence_lat_rmse_{c}_{k}"] == pytest.approx(persisted[k - 1, i],
                                                                          rel=1e-10)
    assert not any("_mse_" in k for k in done)
    with pytest.raises(ValueError, match="channel names"):
        wm.weather_scores([f[:, 0]], [t[:, 0]], initial, LAT_INNER, channels=["only"])


def test_grid_mismatch_names_the_axis():
    with pytest.raises(ValueError, match="latitudes for an axis"):
        wm.rmse(fields(0, (2, 4, 4, 1)), fields(1, (2, 4, 4, 1)), LAT_INNER)


xr = pytest.importorskip("xarray")


def test_against_xarray_weighted_means():
    """WeatherBench2's computation: xarray weighted means over (latitude, longitude) with
    skipna, the mean over time, then the square root; ACC per time from weighted sums."""
    f, t = fields(15, (5, 7, 6, 2)), fields(16, (5, 7, 6, 2))
    t[:, 2:4, 1, 0] = np.nan
    clim = fields(17, (7, 6, 2))
    dims = ("time", "latitude", "longitude", "channel")
    coords = {"latitude": LAT}
    fa, ta = xr.DataArray(f, dims=dims, coords=coords), xr.DataArray(t, dims=dims, coords=coords)
    ca = xr.DataArray(clim, dims=dims[1:], coords=coords)
    weights = np.cos(np.deg2rad(fa.latitude))
    weights = weights / weights.mean()

    sq = ((fa - ta) ** 2).weighted(weights).mean(("latitude", "longitude"), skipna=True)
    want = np.sqrt(sq.mean("time")).values
    np.testing.assert_allclose(wm.rmse(f, t, LAT), want, rtol=1e-12)
    # the same as rmse with a lead axis of one
    np.testing.assert_allclose(wm.rmse(f[:, None], t[:, None], LAT)[0], want, rtol=1e-12)

    fa_, oa_ = (fa - ca).where(ta.notnull()), (ta - ca)
    spatial = ("latitude", "longitude")
    num = (fa_ * oa_).weighted(weights).mean(spatial, skipna=True)
    den = np.sqrt((fa_**2).weighted(weights).mean(spatial, skipna=True)
                  * (oa_**2).weighted(weights).mean(spatial, skipna=True))
    np.testing.assert_allclose(wm.acc(f, t, clim, LAT), (num / den).mean("time").values,
                               rtol=1e-12)


def test_a_trajectory_task_with_latitudes_scores_its_rollout_and_persistence(tmp_path):
    """TrajectoryTask.eval_metrics adds lat_mse / persistence_lat_mse per channel and lead
    when the task has latitudes (a NaN truth left out), and nothing without them."""
    from spmd.config.schema import Config, DataConfig, RunConfig, TrainConfig
    from spmd.data.data_config import WindowConfig
    from spmd.tasks.trajectory_task import TrajectoryTask

    class Grid(TrajectoryTask):
        lat = LAT_INNER

        def build_model(self, rngs):
            raise NotImplementedError

        def frame_shape(self):
            return (5, 4, 2)

        def make_trajectories(self, count, seed):
            raise NotImplementedError

        def rollout_steps(self):
            return 2

        def latitudes(self):
            return self.lat

        def channel_names(self):
            return ["t2m", "z500"]

    cfg = Config(data=DataConfig(window=WindowConfig(input_steps=2, target_steps=1, stride=1)),
                 train=TrainConfig(batch_size=3), run=RunConfig(dir=tmp_path / "run"))
    task = Grid(cfg)
    x = fields(20, (3, 5, 4, 4))                  # two input frames of 2 channels
    y = fields(21, (3, 5, 4, 4))                  # two target frames
    y[0, 1, 1, 2] = np.nan                        # lead 2, channel t2m: left out

    def model(inputs):
        return 0.5 * inputs[..., 2:]

    metrics = jax.jit(lambda b: task.eval_metrics(model, b))(
        {"input": jnp.asarray(x), "target": jnp.asarray(y)})
    lead1 = 0.5 * x[..., 2:]
    lead2 = 0.25 * x[..., 2:]
    forecast = np.stack([lead1, lead2], 1)
    truth = np.stack([y[..., :2], y[..., 2:]], 1)
    want = wm.mse(forecast, truth, LAT_INNER)
    persisted = wm.mse(np.stack([x[..., 2:]] * 2, 1), truth, LAT_INNER)
    for k in (1, 2):
        for i, c in enumerate(("t2m", "z500")):
            assert float(metrics[f"lat_mse_{c}_{k}"]) == pytest.approx(want[k - 1, i], rel=1e-5)
            assert float(metrics[f"persistence_lat_mse_{c}_{k}"]) == pytest.approx(
                persisted[k - 1, i], rel=1e-5)
    assert np.isfinite(float(metrics["lat_mse_t2m_2"]))
    assert not any(k.startswith(("climatology_", "acc_", "persistence_acc")) for k in metrics)

    clim = fields(22, (5, 4, 2))                  # with a climatology: its RMSE, and ACCs
    Grid.score_climatology = lambda self: clim
    metrics = jax.jit(lambda b: task.eval_metrics(model, b))(
        {"input": jnp.asarray(x), "target": jnp.asarray(y)})
    climate = wm.mse(np.broadcast_to(clim, truth.shape), truth, LAT_INNER)
    model_acc = wm.acc(forecast, truth, clim, LAT_INNER)
    held_acc = wm.acc(np.stack([x[..., 2:]] * 2, 1), truth, clim, LAT_INNER)
    for k in (1, 2):
        for i, c in enumerate(("t2m", "z500")):
            for key, table in (("climatology_lat_mse", climate), ("acc", model_acc),
                               ("persistence_acc", held_acc)):
                assert float(metrics[f"{key}_{c}_{k}"]) == pytest.approx(table[k - 1, i],
                                                                        rel=1e-4)
    Grid.lat = None
    assert not any(k.startswith(("lat_", "persistence_")) for k in jax.eval_shape(
        lambda b: task.eval_metrics(model, b),
        {"input": jnp.asarray(x), "target": jnp.asarray(np.nan_to_num(y))}))


def test_the_rollout_figure_reads_the_last_evaluations_scores(tmp_path):
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    from spmd.tasks.figures import last_weather_scores, plot_weather_rmse

    metrics = tmp_path / "metrics.jsonl"
    first = {"step": 0, "lat_mse_t2m_1": 9.0, "persistence_lat_mse_t2m_1": 4.0}
    last = {"step": 50, "eval_loss": 0.1, **{f"lat_mse_{c}_{k}": float(k * k) for c in
                                             ("t2m", "z_500") for k in (1, 2, 3)},
            **{f"persistence_lat_mse_{c}_{k}": 4.0 * k * k for c in ("t2m", "z_500")
               for k in (1, 2, 3)}}
    metrics.write_text(json.dumps(first) + "\n" + json.dumps(last) + "\n" + '{"step": 5')
    step, scores = last_weather_scores(metrics)
    assert step == 50 and sorted(scores) == ["t2m", "z_500"]
    np.testing.assert_allclose(scores["z_500"]["model"], [1, 2, 3])
    np.testing.assert_allclose(scores["t2m"]["persistence"], [2, 4, 6])
    assert sorted(scores["t2m"]) == ["model", "persistence"]
    png = plot_weather_rmse(step, scores, tmp_path / "lat_rmse.png", dt=6.0)
    assert png.read_bytes()[:4] == b"\x89PNG"
    height = matplotlib.image.imread(png).shape[0]

    # with the climatology baseline and ACC: a third line and a row of ACC panels
    last.update({f"{p}_{c}_{k}": v for c in ("t2m", "z_500") for k in (1, 2, 3) for p, v in
                 (("climatology_lat_mse", 16.0), ("acc", 1 - 0.1 * k),
                  ("persistence_acc", 1 - 0.2 * k))})
    metrics.write_text(json.dumps(last) + "\n")
    step, scores = last_weather_scores(metrics)
    np.testing.assert_allclose(scores["t2m"]["climatology"], [4, 4, 4])
    np.testing.assert_allclose(scores["z_500"]["acc"], [0.9, 0.8, 0.7])
    np.testing.assert_allclose(scores["z_500"]["persistence_acc"], [0.8, 0.6, 0.4])
    png = plot_weather_rmse(step, scores, tmp_path / "lat_rmse_acc.png")
    assert matplotlib.image.imread(png).shape[0] == 2 * height
    assert last_weather_scores(tmp_path / "none.jsonl") is None
