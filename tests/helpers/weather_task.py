"""A tiny weather emulator on xarray-written ERA5-like files (tests/helpers/era5_files.py):
spmd.tasks.gridded_task.GriddedTrajectoryTask with a per-grid-point linear map (a 1 x 1
convolution) of the input channels to the next frame. For end-to-end tests of issue 35."""

from __future__ import annotations

from flax import nnx
from pydantic import Field

import spmd
from spmd.tasks.gridded_task import GriddedTrajectoryTask


class PointwiseLinear(nnx.Module):
    def __init__(self, cin: int, cout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(cin, cout, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


class TinyWeatherTask(GriddedTrajectoryTask):
    class Config(spmd.ModelConfig):
        rollout_steps: int = Field(2, ge=1)

    def build_model(self, rngs: nnx.Rngs) -> PointwiseLinear:
        return PointwiseLinear(self.input_channels(), self.frame_channels(), rngs)
