"""Latitude-weighted scores of gridded forecasts, as WeatherBench2 defines them.

On a regular latitude-longitude grid a row near a pole covers far less of the sphere than a
row at the equator, so a plain mean over grid points over-counts the poles. These functions
weigh each latitude row by `latitude_weights` (cos(latitude), normalised to mean 1, the
WeatherBench convention; `kind="area"` gives WeatherBench2's cell-area weights) and score
per channel and per lead time:

- `spatial_mean`: the weighted mean over latitude and longitude, sum(w x) / sum(w) over the
  valid points (xarray's `DataArray.weighted(w).mean(..., skipna=True)`).
- `rmse`: sqrt(mean over samples of the spatially weighted mean squared error); the square
  root is taken after the time average (WeatherBench2's `RMSE`).
- `acc`: the anomaly correlation coefficient against a climatology C, per sample
  sum(w f' o') / sqrt(sum(w f'^2) sum(w o'^2)) with f' = forecast - C, o' = truth - C (not
  centred again), then averaged over samples (WeatherBench2's `ACC`).
- `persistence` and `climatology`: the two baselines a model must beat; `persistence_rmse`
  and `climatology_rmse` score them.
- `weather_scores` / `finish_scores`: the per-batch form a task's `eval_metrics` returns
  (mean squared errors of the model, persistence and the climatology, and ACCs, averaged
  over equal batches by the evaluation) and the square roots `spmd eval` reports.

Layout: fields are `(sample, [lead, ...], lat, lon, channel)` by default: axis 0 is the
sample (time) axis the scores average over, `lat_axis` (-3) and `lon_axis` (-2) the grid,
and every other axis (lead, channel) is kept. `lat` is the latitude in degrees of each
index along `lat_axis` (any order: north-to-south as ERA5, or south-to-north).

Missing values: a point that is NaN in the forecast or the truth, or False in `mask`
(broadcastable to the fields, e.g. a land-sea mask `(lat, lon, 1)`), is left out of the
spatial sums and the weights renormalised over the rest; a sample with no valid point is
left out of the average over samples. A score with no valid value at all is NaN.

Every function takes numpy or jax arrays and returns the same kind (jax.numpy for jax
inputs, so they run inside a jitted eval step; numpy in float64 otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["acc", "climatology", "climatology_rmse", "finish_scores", "latitude_weights",
           "lead_key", "mse", "persistence", "persistence_rmse", "rmse", "spatial_mean",
           "weather_scores"]

ArrayLike = Any

MSE_PREFIX = "lat_mse"                  # weather_scores' keys, per channel and lead
PERSISTENCE_MSE_PREFIX = "persistence_lat_mse"
CLIMATOLOGY_MSE_PREFIX = "climatology_lat_mse"
ACC_PREFIX = "acc"
PERSISTENCE_ACC_PREFIX = "persistence_acc"
MSE_PREFIXES = (PERSISTENCE_MSE_PREFIX, CLIMATOLOGY_MSE_PREFIX, MSE_PREFIX)   # finish_scores


def _xp(*arrays: Any) -> Any:
    """jax.numpy if any of `arrays` is a jax array (or tracer), else numpy."""
    for a in arrays:
        if a is not None and type(a).__module__.startswith(("jax", "jaxlib")):
            import jax.numpy as jnp

            return jnp
    return np


def _float(xp: Any, a: ArrayLike) -> Any:
    a = xp.asarray(a)
    if xp is np:
        return a.astype(np.float64, copy=False)
    return a if xp.issubdtype(a.dtype, xp.floating) else a.astype(xp.float32)


def latitude_weights(lat: ArrayLike, kind: str = "cos") -> np.ndarray:
    """Weights of latitude rows, mean 1 (numpy float64, shape of `lat`).

    `lat`: latitudes in degrees, 1-D, within [-90, 90], in any order. `kind`: "cos"
    (cos(latitude), WeatherBench's) or "area" (the area of each row's cell, sin(upper) -
    sin(lower) with cell bounds half-way between rows and at the poles: WeatherBench2's, which
    gives a pole row a small positive weight instead of 0). Raises ValueError on latitudes
    that are not 1-D finite degrees."""
    lat = np.asarray(lat, np.float64)
    if lat.ndim != 1 or lat.size == 0:
        raise ValueError(f"latitude_weights: latitudes must be a 1-D array of degrees, got "
                         f"shape {lat.shape}")
    if not np.all(np.isfinite(lat)) or np.any(np.abs(lat) > 90):
        bad = lat[~(np.isfinite(lat) & (np.abs(lat) <= 90))][:3]
        raise ValueError(f"latitude_weights: latitudes must be finite degrees in [-90, 90], "
                         f"got {bad.tolist()} (radians? pass degrees)")
    if kind == "cos":
        w = np.cos(np.deg2rad(lat))
    elif kind == "area":
        order = np.argsort(lat)
        x = np.deg2rad(lat[order])
        bounds = np.concatenate([[-np.pi / 2], (x[:-1] + x[1:]) / 2, [np.pi / 2]])
        w = np.empty_like(x)
        w[order] = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    else:
        raise ValueError(f"latitude_weights: kind={kind!r}; use 'cos' or 'area'")
    w = np.where(np.abs(lat) == 90, 0.0, w) if kind == "cos" else w   # cos(±90°) ~ 6e-17
    if not w.sum() > 0:
        raise ValueError(f"latitude_weights: latitudes {lat.tolist()} are all at the poles; "
                         f"their weights are all 0")
    return w / w.mean()


def _grid_weights(xp: Any, lat: ArrayLike, ndim: int, lat_axis: int, kind: str) -> Any:
    """The latitude weights shaped to broadcast along `lat_axis` of an `ndim`-D array."""
    w = latitude_weights(lat, kind)
    shape = [1] * ndim
    shape[lat_axis % ndim] = w.shape[0]
    return xp.asarray(w.reshape(shape), dtype=xp.float64 if xp is np else None)


def spatial_mean(x: ArrayLike, lat: ArrayLike, *, mask: ArrayLike | None = None,
                 lat_axis: int = -3, lon_axis: int = -2, kind: str = "cos") -> Any:
    """The latitude-weighted mean of `x` over `lat_axis` and `lon_axis`, sum(w x) / sum(w)
    over the valid points (finite, and True in `mask`); NaN where no point is valid. The
    result has `x`'s shape without those two axes."""
    xp = _xp(x, mask)
    x = _float(xp, x)
    lat = np.asarray(lat)
    if x.shape[lat_axis] != lat.shape[0]:
        raise ValueError(f"spatial_mean: {lat.shape[0]} latitudes for an axis {lat_axis} of "
                         f"length {x.shape[lat_axis]} (fields shaped {x.shape}); pass one "
                         f"latitude per row, or set lat_axis")
    w = _grid_weights(xp, lat, x.ndim, lat_axis, kind).astype(x.dtype)
    valid = xp.isfinite(x)
    if mask is not None:
        valid = valid & xp.asarray(mask, dtype=bool)
    axes = (lat_axis % x.ndim, lon_axis % x.ndim)
    weight = xp.where(valid, w, 0)
    num = xp.sum(xp.where(valid, x, 0) * weight, axis=axes)
    den = xp.sum(weight, axis=axes)
    return xp.where(den > 0, num / xp.where(den > 0, den, 1), xp.nan)


def _sample_mean(xp: Any, per_sample: Any, axis: int = 0) -> Any:
    """The mean over `axis` of the finite values (NaN where there are none)."""
    ok = xp.isfinite(per_sample)
    n = xp.sum(ok, axis=axis)
    total = xp.sum(xp.where(ok, per_sample, 0), axis=axis)
    return xp.where(n > 0, total / xp.maximum(n, 1), xp.nan)


def mse(forecast: ArrayLike, truth: ArrayLike, lat: ArrayLike, *,
        mask: ArrayLike | None = None, lat_axis: int = -3, lon_axis: int = -2,
        sample_axis: int | None = 0, kind: str = "cos") -> Any:
    """The latitude-weighted mean squared error: per sample the spatial mean of (forecast -
    truth)^2, then the mean over `sample_axis` (None: per sample). Shape: the fields' without
    the sample and grid axes, e.g. (lead, channel)."""
    xp = _xp(forecast, truth, mask)
    err = (_float(xp, forecast) - _float(xp, truth)) ** 2
    per_sample = spatial_mean(err, lat, mask=mask, lat_axis=lat_axis, lon_axis=lon_axis,
                              kind=kind)
    if sample_axis is None:
        return per_sample
    return _sample_mean(xp, per_sample, _reduced_axis(err.ndim, sample_axis, lat_axis,
                                                      lon_axis))


def _reduced_axis(ndim: int, sample_axis: int, lat_axis: int, lon_axis: int) -> int:
    """Where `sample_axis` of an `ndim`-D array is once the two grid axes are gone."""
    s, grid = sample_axis % ndim, (lat_axis % ndim, lon_axis % ndim)
    if s in grid:
        raise ValueError(f"sample_axis {sample_axis} is a grid axis ({lat_axis}, {lon_axis})")
    return s - sum(g < s for g in grid)


def rmse(forecast: ArrayLike, truth: ArrayLike, lat: ArrayLike, *,
         mask: ArrayLike | None = None, lat_axis: int = -3, lon_axis: int = -2,
         sample_axis: int = 0, kind: str = "cos") -> Any:
    """The latitude-weighted root mean squared error, sqrt(`mse`): the square root after
    the average over samples (WeatherBench2's RMSE). Per channel and lead: shape (lead,
    channel) for fields (sample, lead, lat, lon, channel)."""
    xp = _xp(forecast, truth, mask)
    return xp.sqrt(mse(forecast, truth, lat, mask=mask, lat_axis=lat_axis, lon_axis=lon_axis,
                       sample_axis=sample_axis, kind=kind))


def acc(forecast: ArrayLike, truth: ArrayLike, climate: ArrayLike, lat: ArrayLike, *,
        mask: ArrayLike | None = None, lat_axis: int = -3, lon_axis: int = -2,
        sample_axis: int | None = 0, kind: str = "cos") -> Any:
    """The latitude-weighted anomaly correlation coefficient against the climatology
    `climate` (broadcastable to the fields: (lat, lon, channel), or per sample), per sample
    sum(w f' o') / sqrt(sum(w f'^2) sum(w o'^2)) over the valid points, then the mean over
    `sample_axis` (None: per sample). 1 is a perfect forecast of the anomalies; a forecast
    equal to the climatology has none (NaN)."""
    xp = _xp(forecast, truth, climate, mask)
    f = _float(xp, forecast) - _float(xp, climate)
    o = _float(xp, truth) - _float(xp, climate)
    valid = xp.isfinite(f) & xp.isfinite(o)
    if mask is not None:
        valid = valid & xp.asarray(mask, dtype=bool)
    f, o = xp.where(valid, f, xp.nan), xp.where(valid, o, xp.nan)
    kw = {"lat_axis": lat_axis, "lon_axis": lon_axis, "kind": kind}
    fo, ff, oo = (spatial_mean(a, lat, **kw) for a in (f * o, f * f, o * o))
    den = xp.sqrt(ff * oo)
    per_sample = xp.where(den > 0, fo / xp.where(den > 0, den, 1), xp.nan)
    if sample_axis is None:
        return per_sample
    return _sample_mean(xp, per_sample, _reduced_axis(f.ndim, sample_axis, lat_axis,
                                                      lon_axis))


def persistence(initial: ArrayLike, leads: int, lead_axis: int = 1) -> Any:
    """The persistence forecast: the initial state `initial` (sample, lat, lon, channel)
    repeated for `leads` lead times along `lead_axis` (sample, lead, lat, lon, channel)."""
    xp = _xp(initial)
    initial = xp.asarray(initial)
    stacked = xp.stack([initial] * int(leads), axis=lead_axis)
    return stacked


def climatology(fields: ArrayLike, axis: int = 0) -> Any:
    """The climatology of `fields` (time, lat, lon, channel): the mean over `axis` of the
    finite values at each grid point and channel (NaN where a point is never valid). Any
    grouping (by day of year, by hour) is the caller's: pass each group's fields."""
    xp = _xp(fields)
    return _sample_mean(xp, _float(xp, fields), axis)


def persistence_rmse(initial: ArrayLike, truth: ArrayLike, lat: ArrayLike, *,
                     mask: ArrayLike | None = None, kind: str = "cos") -> Any:
    """`rmse` of the persistence forecast of `initial` (sample, lat, lon, channel) against
    `truth` (sample, lead, lat, lon, channel): shape (lead, channel)."""
    truth_shape = np.shape(truth)
    return rmse(persistence(initial, truth_shape[1]), truth, lat, mask=mask, kind=kind)


def climatology_rmse(climate: ArrayLike, truth: ArrayLike, lat: ArrayLike, *,
                     mask: ArrayLike | None = None, kind: str = "cos") -> Any:
    """`rmse` of the climatology forecast `climate` (broadcastable to `truth`, e.g. (lat,
    lon, channel)) against `truth` (sample, [lead,] lat, lon, channel)."""
    xp = _xp(climate, truth, mask)
    forecast = xp.broadcast_to(_float(xp, climate), np.shape(truth))
    return rmse(forecast, truth, lat, mask=mask, kind=kind)


# ---------------------------------------------------------------- in a task's evaluation


def lead_key(prefix: str, channel: str, lead: int, leads: int) -> str:
    """`<prefix>_<channel>_<lead>`, the lead zero-padded when there are more than 9."""
    return f"{prefix}_{channel}_{lead:0{len(str(leads)) if leads > 9 else 1}d}"


def weather_scores(forecasts: Sequence[ArrayLike], truths: Sequence[ArrayLike],
                   initial: ArrayLike, lat: ArrayLike, *,
                   channels: Sequence[str] | None = None, mask: ArrayLike | None = None,
                   climate: ArrayLike | None = None, kind: str = "cos") -> dict[str, Any]:
    """One eval batch's weather scores, for a task's `eval_metrics` (jit-safe).

    `forecasts` and `truths`: one (batch, lat, lon, channel) array per lead time, in
    physical units; `initial`: the last input frame (batch, lat, lon, channel), the
    persistence forecast. Returns, per channel name `c` (`channels`, default c0, c1, ...)
    and lead k (1-based): `lat_mse_<c>_<k>` and `persistence_lat_mse_<c>_<k>` (the batch
    mean of the per-sample weighted MSE) and, with `climate` (the climatology, e.g. (lat,
    lon, channel); NaN points left out), `climatology_lat_mse_<c>_<k>` (the climatology as
    the forecast), `acc_<c>_<k>` and `persistence_acc_<c>_<k>` (the batch mean of the
    per-sample ACC of the model and of persistence). The evaluation averages them over its
    equal batches, so the mean is over every eval sample; `finish_scores` then takes the
    square roots of the MSEs."""
    leads = len(forecasts)
    if leads != len(truths) or leads == 0:
        raise ValueError(f"weather_scores: {leads} forecasts for {len(truths)} truths")
    xp = _xp(initial, *forecasts, *truths)
    f, t = xp.stack(list(forecasts), axis=1), xp.stack(list(truths), axis=1)
    c = f.shape[-1]
    names = list(channels) if channels is not None else [f"c{i}" for i in range(c)]
    if len(names) != c:
        raise ValueError(f"weather_scores: {len(names)} channel names {names} for {c} "
                         f"channels")
    held = persistence(initial, leads)
    scores = {MSE_PREFIX: mse(f, t, lat, mask=mask, kind=kind),
              PERSISTENCE_MSE_PREFIX: mse(held, t, lat, mask=mask, kind=kind)}
    if climate is not None:
        climate = _float(xp, climate)
        scores[CLIMATOLOGY_MSE_PREFIX] = mse(xp.broadcast_to(climate, t.shape), t, lat,
                                             mask=mask, kind=kind)
        scores[ACC_PREFIX] = acc(f, t, climate, lat, mask=mask, kind=kind)
        scores[PERSISTENCE_ACC_PREFIX] = acc(held, t, climate, lat, mask=mask, kind=kind)
    out = {}
    for prefix, table in scores.items():           # table: (lead, channel)
        for k in range(leads):
            for i, name in enumerate(names):
                out[lead_key(prefix, name, k + 1, leads)] = table[k, i]
    return out


def finish_scores(metrics: Mapping[str, float]) -> dict[str, float]:
    """`metrics` with every `lat_mse_*` / `persistence_lat_mse_*` / `climatology_lat_mse_*`
    mean (over all eval batches) replaced by its square root, `lat_rmse_*` /
    `persistence_lat_rmse_*` / `climatology_lat_rmse_*`; other keys unchanged, in order."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        for prefix in MSE_PREFIXES:
            if key.startswith(prefix + "_"):
                key = prefix.replace("_mse", "_rmse") + key[len(prefix):]
                value = float(np.sqrt(value)) if value >= 0 else float("nan")
                break
        out[key] = value
    return out
