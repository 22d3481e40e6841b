"""Scores of model outputs that any task can use: pure numpy / jax.numpy functions.

`spmd.scores.weather`: latitude-weighted RMSE and ACC per channel and lead time, and the
persistence and climatology baselines (WeatherBench2's definitions; docs/metrics.md).
This layer may import numpy and jax only, nothing else of spmd: spmd.tasks (a task's
`eval_metrics`) and spmd.inference (`spmd eval`) import it.
"""

from spmd.scores.weather import (
    acc,
    climatology,
    climatology_rmse,
    finish_scores,
    latitude_weights,
    lead_key,
    mse,
    persistence,
    persistence_rmse,
    rmse,
    spatial_mean,
    weather_scores,
)

__all__ = ["acc", "climatology", "climatology_rmse", "finish_scores", "latitude_weights",
           "lead_key", "mse", "persistence", "persistence_rmse", "rmse", "spatial_mean",
           "weather_scores"]
