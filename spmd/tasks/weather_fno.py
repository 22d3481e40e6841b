"""The weather flagship's task: a Fourier neural operator steps ERA5-like fields t -> t+1.

`configs/weather_era5.yaml` names it (`task: spmd.tasks.weather_fno:WeatherFNO`). Everything
about the data (variables and levels as channels, date splits, NaN masks, CF decoding,
latitude-weighted loss, lat-weighted RMSE and ACC against persistence and the train
climatology in `spmd eval`) comes from
`GriddedTrajectoryTask`; this module only picks the model, spmd.models.fno's FNO2d, whose
input is the frame's channels plus the constants and whose output is one frame.

The FNO's transforms are periodic in both grid axes: right for longitude, an approximation
for latitude that FourCastNet-style emulators make too. `model.modes` must fit the grid
(2 x modes <= latitudes and longitudes), checked against the files at build time.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from spmd.errors import ConfigError
from spmd.models.fno import FNO2d
from spmd.tasks.base import ModelConfig
from spmd.tasks.gridded_task import GriddedTrajectoryTask

__all__ = ["WeatherFNO", "WeatherFnoConfig"]


class WeatherFnoConfig(ModelConfig):
    """model (spmd.tasks.weather_fno:WeatherFNO): an FNO emulator of gridded weather fields."""

    width: int = Field(32, ge=1, description="Channels inside the Fourier layers.")
    modes: int = Field(8, ge=1, description="Fourier modes kept per grid axis "
                       "(2 x modes <= the number of latitudes and of longitudes).")
    num_layers: int = Field(4, ge=1, description="Fourier layers.")
    projection: int = Field(64, ge=1, description="Hidden channels of the output projection.")
    rollout_steps: int = Field(4, ge=1, description="Autoregressive steps of the evaluation "
                               "rollout (lat-weighted RMSE per lead).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Compute dtype.")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The dtype the parameters are stored in.")


class WeatherFNO(GriddedTrajectoryTask[WeatherFnoConfig]):
    """The next frame of data.variables from the last data.window.input_steps frames and
    data.constants, by an FNO (configs/weather_era5.yaml)."""

    Config = WeatherFnoConfig

    def build_model(self, rngs: nnx.Rngs) -> FNO2d:
        m = self.model_cfg
        nlat, nlon, _ = self.frame_shape()
        if 2 * m.modes > min(nlat, nlon):
            raise ConfigError(f"model.modes={m.modes} needs at least {2 * m.modes} latitudes "
                              f"and longitudes; data.path={self.cfg.data.path} has a grid of "
                              f"{nlat} x {nlon}: lower model.modes to {min(nlat, nlon) // 2}")
        return FNO2d(in_channels=self.input_channels(), out_channels=self.frame_channels(),
                     width=m.width, modes=m.modes, num_layers=m.num_layers,
                     projection=m.projection, rngs=rngs, dtype=jnp.dtype(m.dtype),
                     param_dtype=jnp.dtype(m.param_dtype))
