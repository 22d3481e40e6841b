"""A weather-style surrogate: an FNO steps 2-D Kolmogorov flow forward in time.

A user project on spmd's public API (`spmd`, and spmd's FNO `spmd.models.fno.FNO2d`).
The data are trajectories of the vorticity of forced 2-D turbulence on the periodic
square (solver.py: pseudo-spectral Navier-Stokes, Kolmogorov forcing sin(k_f y)); as a
`spmd.TrajectoryTask` the task only says how to make them. spmd writes them to
`model.files` Zarr stores in data.path, trains the FNO on windows of them (the next
frame from the last `data.window.input_steps` frames) and evaluates by rolling it out
`model.rollout_steps` steps on the test trajectories (`rollout_rel_l2_<k>`).

The stored vorticity is divided by `model.vorticity_scale`, so fields are of order one.
"""

from __future__ import annotations

import numpy as np
from flax import nnx
from pydantic import Field, model_validator

import spmd
import spmd.data
from examples.kolmogorov.solver import KolmogorovFlow, trajectories
from spmd.models.fno import FNO2d


class KolmogorovTask(spmd.TrajectoryTask):
    state_name = "vorticity"
    sample_title = "Kolmogorov flow: vorticity, FNO rollout"

    class Config(spmd.ModelConfig):
        # the surrogate (spmd.models.fno.FNO2d)
        width: int = Field(32, ge=1)
        modes: int = Field(12, ge=1)
        layers: int = Field(4, ge=1)
        projection: int = Field(64, ge=1)
        # the flow and its solver (solver.py)
        grid: int = Field(32, ge=8)
        reynolds: float = Field(100.0, gt=0)
        forcing_wavenumber: int = Field(4, ge=1)
        drag: float = Field(0.1, ge=0)
        solver_dt: float = Field(0.05, gt=0)        # the largest solver step (CFL)
        spinup: float = Field(5.0, ge=0)            # time from the random start to frame 0
        snapshot_dt: float = Field(0.25, gt=0)      # time between frames = one model step
        trajectory_steps: int = Field(20, ge=2)     # frames per trajectory
        vorticity_scale: float = Field(4.0, gt=0)   # stored vorticity = w / scale
        # the dataset and the evaluation
        files: int = Field(4, ge=1)                 # member stores in data.path
        rollout_steps: int = Field(8, ge=1)         # lead times of the evaluation rollout

        @model_validator(mode="after")
        def _fits(self):
            if self.grid % 2 or 2 * self.modes > self.grid:
                raise ValueError(f"model.grid={self.grid} must be even and at least twice "
                                 f"model.modes={self.modes}")
            if self.rollout_steps >= self.trajectory_steps:
                raise ValueError(f"model.rollout_steps={self.rollout_steps} needs trajectories "
                                 f"longer than that: raise model.trajectory_steps (now "
                                 f"{self.trajectory_steps})")
            return self

    def flow(self) -> KolmogorovFlow:
        m = self.model_cfg
        return KolmogorovFlow(grid=m.grid, reynolds=m.reynolds,
                              forcing_wavenumber=m.forcing_wavenumber, drag=m.drag,
                              max_dt=m.solver_dt)

    def build_model(self, rngs: nnx.Rngs) -> FNO2d:
        m = self.model_cfg
        return FNO2d(in_channels=self.input_channels(), out_channels=self.frame_channels(),
                     width=m.width, modes=m.modes, num_layers=m.layers,
                     projection=m.projection, rngs=rngs)

    def frame_shape(self) -> tuple[int, ...]:
        return (self.model_cfg.grid, self.model_cfg.grid, 1)

    def dt(self) -> float:
        return self.model_cfg.snapshot_dt

    def make_trajectories(self, count: int, seed: int) -> np.ndarray:
        m = self.model_cfg
        with np.errstate(over="ignore", invalid="ignore"):
            w = trajectories(self.flow(), count, seed, snapshots=m.trajectory_steps,
                             snapshot_dt=m.snapshot_dt, spinup=m.spinup)
        if not np.isfinite(w).all():
            raise spmd.data.ArrayDataError(
                f"the Kolmogorov solver diverged (grid {m.grid}, Reynolds number "
                f"{m.reynolds}, step {m.solver_dt}): lower model.solver_dt (about 0.05 at "
                f"grid 32, 0.025 at 64, 0.01 at 128); nothing was written")
        return (w / m.vorticity_scale).astype(np.float32)[..., None]

    def data_attrs(self) -> dict:
        m = self.model_cfg
        return {"problem": "2-D Kolmogorov flow, vorticity form, periodic [0, 2 pi)^2",
                "grid": m.grid, "reynolds": m.reynolds,
                "forcing": f"sin({m.forcing_wavenumber} y) x-force", "drag": m.drag,
                "snapshot_dt": m.snapshot_dt, "spinup": m.spinup,
                "vorticity_scale": m.vorticity_scale}
