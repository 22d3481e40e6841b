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
  the files (spmd.data.gridded_windows); nothing is made (`spmd data make` refuses).
- The model's input is `(lat, lon, input_steps * C + K)`: the frames, then the K
  constants, which stay the same through a rollout (only the frames are fed back).
- With data.normalize the frames (not the constants) are normalized per channel with the
  train split's NaN-aware statistics, stored beside the data (`spmd data stats CONFIG`, or
  the coordinator's `prepare` when they are missing or stale) and kept in
  run.dir/normalization.json as TrajectoryTask keeps its own.
- The evaluation adds, per channel and lead, latitude-weighted RMSE against persistence
  (TrajectoryTask.weather_metrics) and, with `climatology_scores`, the anomaly correlation
  `acc_<channel>_<lead>` against the train split's climatology (`climatology()`: each grid
  point's mean over the train split's times, NaN ignored; read once per process when the
  eval step is compiled).
- The loss and `eval_loss` are weighted by cos(latitude) (normalized to mean 1;
  `latitude_weighted_loss = False` turns it off). With data.nan: mask they are means over
  the valid target points only (the mask field, 1 where the target was not NaN). With
  data.normalize and data.nan mask or fill, a NaN becomes its channel's train mean (0 in
  model units), not data.nan_fill.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from spmd.data.batch import BatchField
from spmd.data.channels import parse_channels
from spmd.data.file_index import load_index
from spmd.data.gridded_timeline import Timeline, build_timeline
from spmd.data.gridded_windows import GriddedWindowSource
from spmd.data.normalization import data_fingerprint, load_statistics, write_statistics
from spmd.data.stores import ArrayDataError
from spmd.errors import ConfigError
from spmd.scores.weather import ACC_PREFIX, acc, lead_key
from spmd.tasks.base import ModelCfg
from spmd.tasks.field_task import run_normalization
from spmd.tasks.trajectory_task import TrajectoryTask

__all__ = ["GriddedTrajectoryTask"]

log = logging.getLogger("spmd.tasks.gridded_task")


class GriddedTrajectoryTask(TrajectoryTask[ModelCfg]):
    """The next frame of gridded variables from the last `input_steps` frames (and the
    constants), rolled out autoregressively; data from data.variables / data.splits."""

    state_name = "channels"
    mask_name = "target_mask"
    latitude_weighted_loss: bool = True     # weight the loss by cos(latitude), mean 1
    climatology_scores: bool = True         # acc_* against the train split's climatology

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
        return float(self.grid().step / np.timedelta64(1, "h"))

    def frame_shape(self) -> tuple[int, ...]:
        g = self.grid()
        return (len(g.lat), len(g.lon), len(self.channels()))

    def constant_channels(self) -> int:
        return len(self.cfg.data.constants)

    def input_channels(self) -> int:
        return self.window().input_steps * self.frame_channels() + self.constant_channels()

    def _fields(self, target_steps: int) -> dict[str, BatchField]:
        fields = super()._fields(target_steps)
        nlat, nlon, c = self.frame_shape()
        fields[self.input_name] = BatchField((nlat, nlon, self.input_channels()), np.float32,
                                             self.frame_axes)
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
        return GriddedWindowSource.from_config(
            self.cfg, split, fields, input_name=self.input_name, target_name=self.target_name,
            mask_name=self.mask_name if d.nan == "mask" else None,
            shuffle=shuffle, target_steps=target_steps, nan_fill=fill)

    def data_incomplete(self) -> bool:
        return False

    def make_data(self, **options) -> str:
        raise ConfigError(f"data.path={self.cfg.data.path}: the task {self.cfg.task} reads "
                          f"existing weather / climate files; there is nothing to make")

    def describe_data(self) -> str:
        train = self._source("train", True)
        test = self._source("test", False, self.rollout_steps())
        return (f"{train.describe()}\nsplit test ({test._range_text()}): {test.count} "
                f"windows of {self.rollout_steps()} rollout steps; train order: "
                f"{train.index.describe()}")

    def prepare(self, is_coordinator: bool) -> None:
        """Check the files; with data.normalize, the coordinator computes the train split's
        channel statistics and stores them beside the data when they are missing or stale
        (as `spmd data stats CONFIG` does)."""
        self.grid()
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

    def normalization(self) -> tuple[np.ndarray, np.ndarray] | None:
        if not self.cfg.data.normalize:
            return None
        cached = self.__dict__.get("_normalization")
        if cached is None:
            cached = run_normalization(self.cfg, (self.state_name,),
                                       self._stored_normalization)[self.state_name]
            self._normalization = cached
        return cached

    def climatology(self) -> np.ndarray:
        """The train split's climatology, float32 (lat, lon, C) in physical units: each grid
        point's and channel's mean over every time of the train split's windows, NaN left
        out (NaN where a point is never valid, e.g. sst over land). Cached per task."""
        cached = self.__dict__.get("_climatology")
        if cached is None:
            cached = train_climatology(self._statistics_source())
            self._climatology = cached
        return cached

    def weather_metrics(self, preds: list, truths: list, batch) -> dict:
        """TrajectoryTask's lat-weighted scores, and with `climatology_scores` the
        latitude-weighted ACC per channel and lead against `climatology()` (masked points
        and points never valid in the train split left out)."""
        metrics = super().weather_metrics(preds, truths, batch)
        if not self.climatology_scores:
            return metrics
        c, steps = self.frame_channels(), len(preds)
        mask = batch.get(self.mask_name)
        if mask is not None:
            mask = jnp.stack([mask[..., k * c:(k + 1) * c] for k in range(steps)], 1) > 0
        table = acc(jnp.stack(preds, 1), jnp.stack(truths, 1), jnp.asarray(self.climatology()),
                    self.latitudes(), mask=mask)               # (lead, channel)
        for k in range(steps):
            for i, name in enumerate(self.channel_names()):
                metrics[lead_key(ACC_PREFIX, name, k + 1, steps)] = table[k, i]
        return metrics

    # ------------------------------------------------------------ objective

    def rollout(self, model, inputs: jax.Array, steps: int) -> list[jax.Array]:
        """`steps` predicted frames in model units; the constants (the input's last K
        channels) go with every step unchanged."""
        k = self.constant_channels()
        c = self.frame_channels()
        frames = inputs[..., :inputs.shape[-1] - k] if k else inputs
        const = inputs[..., inputs.shape[-1] - k:] if k else None
        x, out = self._scaled(frames, True), []
        for _ in range(steps):
            frame = model(x if const is None else jnp.concatenate(
                [x, const.astype(x.dtype)], axis=-1))
            out.append(frame)
            x = jnp.concatenate([x[..., c:], frame.astype(x.dtype)], axis=-1)
        return out

    def _masked_mse(self, pred: jax.Array, target: jax.Array, mask: jax.Array | None
                    ) -> jax.Array:
        """Mean squared error over the valid points (mask), weighted by cos(latitude)
        normalized to mean 1 when `latitude_weighted_loss`."""
        err = (pred - target) ** 2
        weight = jnp.ones(err.shape[1:2], err.dtype)
        if self.latitude_weighted_loss:
            w = np.cos(np.deg2rad(self.latitudes()))
            weight = jnp.asarray(w / w.mean(), err.dtype)
        weight = jnp.broadcast_to(weight[:, None, None], err.shape[1:])
        if mask is not None:
            weight = weight * mask
        else:
            weight = jnp.broadcast_to(weight, err.shape)
        return jnp.sum(err * weight) / jnp.maximum(jnp.sum(weight), 1e-12)

    def loss(self, model, batch):
        steps = self.window().target_steps
        pred = jnp.concatenate(self.rollout(model, batch[self.input_name], steps), axis=-1)
        return self._masked_mse(pred, self._scaled(batch[self.target_name], True),
                                batch.get(self.mask_name)), {}

    def eval_metrics(self, model, batch) -> dict:
        metrics = super().eval_metrics(model, batch)
        mask = batch.get(self.mask_name)
        c = self.frame_channels()
        pred = self.rollout(model, batch[self.input_name], 1)[0]
        truth = self._scaled(batch[self.target_name][..., :c], True)
        metrics["eval_loss"] = self._masked_mse(pred, truth,
                                                None if mask is None else mask[..., :c])
        return metrics

    def sample_outputs(self, model, batch) -> dict:
        if not self.constant_channels():
            return super().sample_outputs(model, batch)
        return self._samples(model, batch)

    def _samples(self, model, batch) -> dict:
        from spmd.tasks.field_task import relative_l2

        steps, c, k = self.rollout_steps(), self.frame_channels(), self.constant_channels()
        x = batch[self.input_name]
        preds = [self._scaled(p, False) for p in self.rollout(model, x, steps)]
        truths = self._truths(batch[self.target_name], steps)
        lead_error = jnp.stack([relative_l2(p, t) for p, t in zip(preds, truths)], axis=1)
        last = x.shape[-1] - k - c
        return {"input": x[..., last], "truth": truths[-1][..., 0],
                "prediction": preds[-1][..., 0], "error": (preds[-1] - truths[-1])[..., 0],
                "lead_error": lead_error}


CLIMATOLOGY_READ_BYTES = 4 << 30     # above this, a part of each block of the train times


def train_climatology(source: GriddedWindowSource,
                      max_bytes: int = CLIMATOLOGY_READ_BYTES) -> np.ndarray:
    """Per grid point and channel, the mean of the finite values over every time the
    split's windows use (as `GriddedWindowSource.channel_statistics` walks them, a block at
    a time), float32 (lat, lon, C); NaN where no value is finite. When those frames exceed
    `max_bytes`, the first 1/k of each block only (evenly over the split, logged)."""
    windows = source.count                          # checks the files, finds the windows
    used = np.zeros(len(source.timeline.times), bool)
    for t0 in source._starts[:windows]:
        used[t0:t0 + source.span] = True
    frame_bytes = 4 * int(np.prod(source.frame))
    every = max(1, -(-int(used.sum()) * frame_bytes // max_bytes))
    if every > 1:
        log.info("climatology: %d train times of %d bytes each; reading 1/%d of each block "
                 "of %d times", int(used.sum()), frame_bytes, every, source._block_rows)
    total: np.ndarray | None = None
    count: np.ndarray | None = None
    edges = np.flatnonzero(np.diff(np.concatenate([[0], used.astype(np.int8), [0]])))
    for run_lo, run_hi in zip(edges[::2], edges[1::2]):
        rows = min(source._block_rows, int(run_hi - run_lo))
        for a in range(int(run_lo), int(run_hi), rows):        # the first 1/every of a block
            v = source._frames(a, min(a + -(-rows // every), int(run_hi))).astype(np.float64)
            ok = np.isfinite(v)
            part, n = np.where(ok, v, 0.0).sum(0), ok.sum(0)
            total = part if total is None else total + part
            count = n if count is None else count + n
    if total is None:
        raise ArrayDataError(f"{source.where}: the train split has no time to compute a "
                             f"climatology from; widen data.splits.train")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan).astype(np.float32)
