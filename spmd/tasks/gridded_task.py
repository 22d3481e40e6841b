"""`GriddedTrajectoryTask`: a TrajectoryTask on weather / climate files as they exist.

A subclass writes only its model; the data come from the config (docs/data.md, Weather and
climate files):

    class Emulator(spmd.tasks.gridded_task.GriddedTrajectoryTask):
        class Config(spmd.ModelConfig): ...
        def build_model(self, rngs):   # (batch, lat, lon, input_channels()) -> frame
            ...

    data:
      path: data/era5/                 # yearly NetCDF4 files, or a Zarr store
      variables: [t2m, u10, v10, {geopotential: [500, 850]}]
      constants: [lsm, latitude]       # extra input channels (optional)
      splits: {train: {end: 2001-12-31T23:00}, test: {start: 2002-01-01}}
      window: {input_steps: 1, target_steps: 1, stride: 1}
      nan: mask                        # error (default) | mask | fill

Invariants:
- The frame is `(latitude, longitude, C)` with C the channels of data.variables, read from
  the files (spmd.data.sources.gridded_windows); nothing is made (`spmd data make` refuses).
- The model's input is `(lat, lon, input_steps * C + K)`: the frames, then the K
  constants, which stay the same through a rollout (only the frames are fed back).
- With data.normalize the frames (not the constants) are normalized per channel with the
  train split's NaN-aware statistics, stored beside the data (`spmd data stats CONFIG`, or
  the coordinator's `prepare` when they are missing or stale) and kept in
  run.dir/normalization.json as TrajectoryTask keeps its own.
- The evaluation adds, per channel and lead, latitude-weighted RMSE of the model and of
  persistence (TrajectoryTask.weather_metrics) and, with `climatology_scores`, the RMSE of
  the train split's climatology as a forecast (`climatology_lat_rmse_*`) and the anomaly
  correlations `acc_<channel>_<lead>` (model) and `persistence_acc_*` against it
  (`climatology()`: each grid point's mean over the train split's times, NaN ignored; read
  once per process when the eval step is compiled).
- The loss and `eval_loss` are weighted by cos(latitude) (normalized to mean 1;
  `latitude_weighted_loss = False` turns it off). With data.nan: mask they are means over
  the valid target points only (the mask field, 1 where the target was not NaN). With
  data.normalize and data.nan mask or fill, a NaN becomes its channel's train mean (0 in
  model units), not data.nan_fill.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from spmd.data.batch import BatchField
from spmd.data.cf.channels import parse_channels
from spmd.data.cf.gridded_timeline import Timeline, build_timeline, step_hours
from spmd.data.formats.file_index import load_index
from spmd.data.formats.stores import ArrayDataError
from spmd.data.sources.gridded_windows import GriddedWindowSource
from spmd.data.stats.normalization import data_fingerprint, load_statistics, write_statistics
from spmd.errors import ConfigError
from spmd.tasks.base import ModelCfg
from spmd.tasks.trajectory_task import TrajectoryTask

__all__ = ["GriddedTrajectoryTask"]

log = logging.getLogger("spmd.tasks.gridded_task")


class GriddedTrajectoryTask(TrajectoryTask[ModelCfg]):
    """The next frame of gridded variables from the last `input_steps` frames (and the
    constants), rolled out autoregressively; data from data.variables / data.splits."""

    state_name = "channels"
    mask_name = "target_mask"
    latitude_weighted_loss: bool = True     # weight the loss by cos(latitude), mean 1
    climatology_scores: bool = True         # climatology RMSE, ACC (train climatology)

    # ------------------------------------------------------------ layout

    def grid(self) -> Timeline:
        """The files' checked timeline (scanned once per task)."""
        cached = self.__dict__.get("_grid")
        if cached is None:
            d = self.cfg.data
            if d.path is None or d.variables is None:
                raise ConfigError(f"the task {self.cfg.task} reads gridded files: set "
                                  f"data.path and data.variables")
            where = f"data.path={d.path}"
            paths = [m.path for m in load_index(d.path, where).members]
            cached = build_timeline(paths, parse_channels(d.variables), list(d.constants),
                                    where=where, time_gaps=d.time_gaps,
                                    latitude_order=d.latitude_order)
            self._grid = cached
        return cached

    def channels(self) -> list[str]:
        """The channel names, in order."""
        return [c.name for c in parse_channels(self.cfg.data.variables)]

    def latitudes(self) -> np.ndarray:
        """The frames' latitudes (degrees, in the frame's row order): the evaluation adds
        latitude-weighted scores per channel and lead (TrajectoryTask.weather_metrics)."""
        return np.asarray(self.grid().lat, np.float64)

    def channel_names(self) -> list[str]:
        return self.channels()

    def dt(self) -> float:
        """Hours between two frames (one model step)."""
        grid = self.grid()
        return step_hours(grid.step, grid.calendar)

    def frame_shape(self) -> tuple[int, ...]:
        g = self.grid()
        return (len(g.lat), len(g.lon), len(self.channels()))

    def constant_channels(self) -> int:
        return len(self.cfg.data.constants)

    def _fields(self, target_steps: int) -> dict[str, BatchField]:
        fields = super()._fields(target_steps)
        nlat, nlon, c = self.frame_shape()
        if self.cfg.data.nan == "mask":
            fields[self.mask_name] = BatchField((nlat, nlon, target_steps * c), np.float32,
                                                self.frame_axes)
        return fields

    def make_trajectories(self, count: int, seed: int) -> np.ndarray:
        raise ConfigError(f"the task {self.cfg.task} reads existing files (data.variables); "
                          f"it makes no trajectories")

    # ------------------------------------------------------------ sources and data

    def _source(self, split: str, shuffle: bool, target_steps: int | None = None
                ) -> GriddedWindowSource:
        fields = self.batch_fields() if target_steps is None else self._fields(target_steps)
        d = self.cfg.data
        fill = None
        if d.normalize and d.nan != "error" and not self.__dict__.get("_in_statistics"):
            try:                                # NaN -> the channel's mean: 0 in model units
                fill = self.normalization()[0]
            except ArrayDataError:              # no statistics yet (`spmd data stats`): the
                fill = None                     # loss asks for them again, and fails there
        return GriddedWindowSource.from_sections(
            self.cfg.source_sections(), split, fields, input_name=self.input_name,
            target_name=self.target_name, mask_name=self.mask_name if d.nan == "mask" else None,
            shuffle=shuffle, target_steps=target_steps, nan_fill=fill)

    def prediction_source(self, path: Path, split: str, batch_size: int
                          ) -> GriddedWindowSource:
        """`spmd predict --input PATH`: the files at PATH read as training read data.path
        (the same variables, levels, constants, CF decoding, calendar and latitude order),
        the windows of split `split` of data.splits (`all`: every window of the files), one
        target step each, NaN filled as in training with the run's statistics."""
        d = self.cfg.data
        splits = {"all": {}} if split == "all" else d.splits
        sections = dataclasses.replace(
            self.cfg.source_sections(),
            data=d.model_copy(update={"path": str(path), "splits": splits}),
            batch_size=int(batch_size))
        fill = self.normalization()[0] if d.normalize and d.nan != "error" else None
        return GriddedWindowSource.from_sections(
            sections, split, self._fields(1), input_name=self.input_name,
            target_name=self.target_name,
            mask_name=self.mask_name if d.nan == "mask" else None, shuffle=False,
            target_steps=1, nan_fill=fill, config_key="--input")

    def data_incomplete(self) -> bool:
        return False

    def make_data(self, **options) -> str:
        raise ConfigError(f"data.path={self.cfg.data.path}: the task {self.cfg.task} reads "
                          f"existing weather / climate files; there is nothing to make")

    def describe_data(self) -> str:
        train = self._source("train", True)
        test = self._source("test", False, self.rollout_steps())
        return (f"{train.describe()}\nsplit test ({test.covered_text()}): {test.count} "
                f"windows of {self.rollout_steps()} rollout steps; train order: "
                f"{train.index.describe()}")

    def prepare(self, is_coordinator: bool) -> None:
        """Check the files; with data.normalize, the coordinator computes the train split's
        channel statistics and stores them beside the data when they are missing or stale
        (as `spmd data stats CONFIG` does). The coordinator says what each split covers."""
        self.grid()
        if is_coordinator:
            train = self._source("train", True)
            log.info("split train (%s): %d windows", train.covered_text(), train.count)
            if self.cfg.train.eval_every:
                test = self._source("test", False, self.rollout_steps())
                log.info("split test (%s): %d windows of %d rollout steps",
                         test.covered_text(), test.count, self.rollout_steps())
        if is_coordinator and self.cfg.data.normalize:
            source = self._statistics_source()
            try:
                load_statistics(source.path, [source.statistics_key()], where=source.where)
            except ArrayDataError as e:
                log.info("data.normalize: %s; computing them now", e)
                stamp = data_fingerprint(source.path, source.where)
                target = write_statistics(source.path, source.statistics_part(),
                                          split="train", fingerprint=stamp,
                                          where=source.where,
                                          channel_names={source.statistics_key():
                                                         self.channels()})
                log.info("data.normalize: stored the train split's statistics in %s", target)

    def _statistics_source(self) -> GriddedWindowSource:
        self._in_statistics = True           # statistics skip NaN: no fill needed
        try:
            return self.train_source()
        finally:
            self._in_statistics = False

    def _stored_normalization(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        source = self._statistics_source()
        key = source.statistics_key()
        stats = load_statistics(source.path, [key], where=source.where)[key]
        return {self.state_name: (stats.mean.astype(np.float32),
                                  stats.scale().astype(np.float32))}

    def climatology(self) -> np.ndarray:
        """The train split's climatology, float32 (lat, lon, C) in physical units: each grid
        point's and channel's mean over every time of the train split's windows, NaN left
        out (NaN where a point is never valid, e.g. sst over land). Cached per task."""
        cached = self.__dict__.get("_climatology")
        if cached is None:
            cached = train_climatology(self._statistics_source())
            self._climatology = cached
        return cached

    def score_climatology(self) -> np.ndarray | None:
        """`climatology()` with `climatology_scores` (the evaluation then adds the
        climatology's RMSE and the ACCs), else None."""
        return self.climatology() if self.climatology_scores else None

    # ------------------------------------------------------------ objective

    def frame_mse(self, pred: jax.Array, target: jax.Array, mask: jax.Array | None
                  ) -> jax.Array:
        """Mean squared error over the valid points (mask), weighted by cos(latitude)
        normalized to mean 1 when `latitude_weighted_loss`."""
        if not self.latitude_weighted_loss:
            return super().frame_mse(pred, target, mask)
        w = np.cos(np.deg2rad(self.latitudes()))
        weight = jnp.broadcast_to(jnp.asarray(w / w.mean(), pred.dtype)[:, None, None],
                                  pred.shape[1:])
        weight = weight * mask if mask is not None else jnp.broadcast_to(weight, pred.shape)
        return jnp.sum((pred - target) ** 2 * weight) / jnp.maximum(jnp.sum(weight), 1e-12)


CLIMATOLOGY_READ_BYTES = 4 << 30     # above this, a part of each block of the train times


def train_climatology(source: GriddedWindowSource,
                      max_bytes: int = CLIMATOLOGY_READ_BYTES) -> np.ndarray:
    """Per grid point and channel, the mean of the finite values over every time the
    split's windows use (`GriddedWindowSource.split_frames`, a block at a time), float32
    (lat, lon, C); NaN where no value is finite. When those frames exceed `max_bytes`, the
    first 1/k of each block only (evenly over the split, logged)."""
    used = int(source.used_times().sum())
    frame_bytes = 4 * int(np.prod(source.frame))
    every = max(1, -(-used * frame_bytes // max_bytes))
    if every > 1:
        log.info("climatology: %d train times of %d bytes each; reading 1/%d of each block "
                 "of %d times", used, frame_bytes, every, source.block_rows)
    total: np.ndarray | None = None
    count: np.ndarray | None = None
    for _, frames in source.split_frames(every):
        v = frames.astype(np.float64)
        ok = np.isfinite(v)
        part, n = np.where(ok, v, 0.0).sum(0), ok.sum(0)
        total = part if total is None else total + part
        count = n if count is None else count + n
    if total is None:
        raise ArrayDataError(f"{source.where}: the train split has no time to compute a "
                             f"climatology from; widen data.splits.train")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan).astype(np.float32)
