"""Autoregressive surrogates of time-dependent fields, trained on windows of trajectories.

`TrajectoryTask` is the `FieldTask` of time stepping (weather-style emulators): the model
maps the last `data.window.input_steps` frames of a field to the next frame, and a
prediction is fed back as input to step further. A subclass writes its model and says how
to make trajectories:

    class FlowTask(spmd.TrajectoryTask):
        state_name = "vorticity"
        class Config(spmd.ModelConfig): ...
        def build_model(self, rngs): ...        # (batch, x, y, input_channels()) -> frame
        def frame_shape(self): return (grid, grid, 1)
        def make_trajectories(self, count, seed): return w   # (count, time, x, y, C) float32

Invariants:
- On disk, data.path is a directory of `files()` member stores `part-000.<ext>`, ...
  (Zarr for data.source synthetic / zarr, NetCDF4 `.nc`, HDF5 `.h5`), each written
  atomically and holding `train/<state_name>` and `test/<state_name>` of shape
  `[trajectory, time, *frame]`; the trajectories of a split are spread evenly over the
  files, and a file's trajectories depend only on (data.seed, split, file), never on
  `--workers`. Before training, rank 0 makes the files when data.path is missing, empty
  or holds only some of them; a directory of other stores is read as it is.
- Examples are windows of the trajectories (spmd.data.sources.windows, layout "channels": the
  input is `(x, y, input_steps * C)`, the target `(x, y, target_steps * C)`).
- The loss is the mean squared error over all `data.window.target_steps` steps of an
  autoregressive rollout: each step's input is the last `input_steps` frames, predictions
  included.
- Evaluation (the test split, in file order) rolls the model out `rollout_steps()` steps
  from each window's input: `eval_loss` (one-step MSE), `test_rel_l2` (one-step mean
  per-sample relative L2) and `rollout_rel_l2_<k>` for every lead k (zero-padded to sort).
- data.window must be set (no default window). With data.normalize the model works on
  frames normalized per channel with the train split's statistics (`spmd data stats`, or
  made with the data): inputs, rollout and loss in those units, `test_rel_l2`, the rollout
  errors, samples and `predict` in physical units; the run keeps them in
  run.dir/normalization.json (FieldTask's).
"""

from __future__ import annotations

import abc
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from spmd.data.batch import BatchField
from spmd.data.data_config import WindowConfig
from spmd.data.formats.file_index import INDEX_NAME, data_exists, has_magic
from spmd.data.formats.stores import ArrayDataError, is_member_name, write_arrays
from spmd.data.sources.windows import WindowSource
from spmd.data.stats.normalization import compute_statistics, load_statistics
from spmd.errors import ConfigError
from spmd.scores.weather import weather_scores
from spmd.tasks.base import ModelCfg, Task
from spmd.tasks.field_task import relative_l2, run_normalization
from spmd.tasks.figures import (
    last_rollout_errors,
    last_weather_scores,
    plot_rollout_error,
    plot_weather_rmse,
)

log = logging.getLogger("spmd.tasks.trajectory_task")

SPLITS = ("train", "test")
SUFFIXES = {"zarr": ".zarr", "netcdf": ".nc", "hdf5": ".h5"}
FORMAT_OF_SOURCE = {"synthetic": "zarr", "zarr": "zarr", "netcdf": "netcdf", "hdf5": "hdf5"}


def rollout_key(lead: int, steps: int) -> str:
    """The metric name of lead `lead` of `steps`: rollout_rel_l2_3, or _03 when steps > 9."""
    return f"rollout_rel_l2_{lead:0{len(str(steps)) if steps > 9 else 1}d}"


class TrajectoryTask(Task[ModelCfg]):
    """The next frame from the last `input_steps` frames, rolled out autoregressively.

    Generic in its model config as `Task` is. The model maps `(batch, x, y, input_steps *
    C)` to one frame `(batch, x, y, C)`; `frame_shape()` is (x, y, C).
    """

    state_name: str = "state"
    frame_axes: tuple[str | None, ...] = ("batch", "x", "y", "channels")
    input_name: str = "input"
    target_name: str = "target"
    mask_name: str | None = None       # a batch field, 1 where the target is valid (None: none)
    sample_title: str = "Test samples at the last evaluation"

    @abc.abstractmethod
    def frame_shape(self) -> tuple[int, ...]:
        """Per-frame shape of the state, channels last: (x, y, C)."""

    @abc.abstractmethod
    def make_trajectories(self, count: int, seed: int) -> np.ndarray:
        """`count` trajectories from `seed`: float32 `[count, time, *frame_shape()]`."""

    def data_attrs(self) -> dict:
        """Attributes stored with every data file (what made it)."""
        return {}

    def rollout_steps(self) -> int:
        """Model steps of the evaluation rollout: model.rollout_steps if the model config
        has it, else 8."""
        return int(getattr(self.model_cfg, "rollout_steps", 8))

    def dt(self) -> float | None:
        """Physical time between two frames (one model step), for the plots; None: unknown."""
        return None

    def files(self) -> int:
        """Member files of the dataset: model.files if the model config has it, else 1."""
        return int(getattr(self.model_cfg, "files", 1))

    # ------------------------------------------------------------ layout

    def window(self) -> WindowConfig:
        """data.window, required (an error naming it when unset)."""
        d = self.cfg.data
        if d.window is None:
            raise ConfigError(
                f"data.window is not set: the task {self.cfg.task} trains on time windows of "
                f"trajectories; set data.window.input_steps, data.window.target_steps and "
                f"data.window.stride (e.g. 1, 1, 1)")
        return d.window

    def frame_channels(self) -> int:
        return int(self.frame_shape()[-1])

    def constant_channels(self) -> int:
        """Channels after the frames in the model's input that stay fixed through a rollout
        (e.g. orography, a land-sea mask; default 0)."""
        return 0

    def input_channels(self) -> int:
        """Channels of the model's input: input_steps frames stacked along channels, then
        the constant channels."""
        return self.window().input_steps * self.frame_channels() + self.constant_channels()

    def _fields(self, target_steps: int) -> dict[str, BatchField]:
        *space, c = self.frame_shape()
        return {self.input_name: BatchField((*space, self.input_channels()), np.float32,
                                            self.frame_axes),
                self.target_name: BatchField((*space, target_steps * c), np.float32,
                                             self.frame_axes)}

    def batch_fields(self) -> dict[str, BatchField]:
        return self._fields(self.window().target_steps)

    def eval_batch_fields(self) -> dict[str, BatchField] | None:
        if self.rollout_steps() == self.window().target_steps:
            return None
        return self._fields(self.rollout_steps())

    def dataset_paths(self) -> dict[str, str]:
        state = f"{{split}}/{self.state_name}"
        return {self.input_name: state, self.target_name: state}

    def prediction_input(self) -> str:
        return self.input_name

    # ------------------------------------------------------------ sources

    def _source(self, split: str, shuffle: bool, target_steps: int | None = None
                ) -> WindowSource:
        fields = self.batch_fields() if target_steps is None else self._fields(target_steps)
        return WindowSource.from_sections(
            self.cfg.source_sections(), split, fields, f"{{split}}/{self.state_name}",
            input_name=self.input_name, target_name=self.target_name, layout="channels",
            shuffle=shuffle, target_steps=target_steps)

    def train_source(self) -> WindowSource:
        return self._source("train", shuffle=True)

    def eval_source(self) -> WindowSource | None:
        if not self.cfg.train.eval_every:
            return None
        return self._source("test", shuffle=False, target_steps=self.rollout_steps())

    # ------------------------------------------------------------ data on disk

    def data_format(self) -> str:
        """The member store format, from data.source."""
        source = self.cfg.data.source
        if source not in FORMAT_OF_SOURCE:
            raise ConfigError(f"data.source={source}: a trajectory dataset is written as "
                              f"zarr, netcdf or hdf5 member files; set data.source to one of "
                              f"those (synthetic: zarr)")
        return FORMAT_OF_SOURCE[source]

    def data_dir(self) -> Path:
        path = self.cfg.data.path
        if path is None:
            raise ConfigError(f"data.path is not set: the task {self.cfg.task} reads its "
                              f"trajectories from a directory of files (made by `spmd data "
                              f"make CONFIG`)")
        if has_magic(str(path)):
            raise ConfigError(f"data.path={path}: a glob; `spmd data make` writes a "
                              f"directory of files: give data.path a plain directory")
        return Path(path)

    def member_paths(self) -> list[Path]:
        """The member stores make_data writes, in order."""
        suffix = SUFFIXES[self.data_format()]
        return [self.data_dir() / f"part-{i:03d}{suffix}" for i in range(self.files())]

    def data_incomplete(self) -> bool:
        """Whether make_data has work to do before training: data.path is missing, or a
        directory that is empty or holds some but not all of its member stores (an
        interrupted `spmd data make`). Other stores (the user's own) are complete."""
        path = self.cfg.data.path
        if path is None:
            return False
        if not data_exists(path):
            return True
        if has_magic(str(path)) or not Path(path).is_dir():
            return False
        present = [p.exists() for p in self.member_paths()]
        if not any(present):        # an empty directory, or the user's own stores
            return not any(not c.name.startswith(".") for c in Path(path).iterdir())
        return not all(present)

    def _jobs(self) -> list[tuple[Path, dict[str, tuple[int, int]]]]:
        """Per member: (path, {split: (trajectories, seed)})."""
        d, n = self.cfg.data, self.files()
        for key, count in (("data.num_train", d.num_train), ("data.num_test", d.num_test)):
            if count < n:
                raise ConfigError(f"{key}={count} trajectories cannot fill {n} files "
                                  f"(model.files): raise {key} or lower model.files")
        counts = {s: [len(c) for c in np.array_split(np.arange(total), n)]
                  for s, total in zip(SPLITS, (d.num_train, d.num_test))}
        jobs = []
        for i, path in enumerate(self.member_paths()):
            seeds = {s: int(np.random.SeedSequence([d.seed, k, i]).generate_state(1)[0])
                     for k, s in enumerate(SPLITS)}
            jobs.append((path, {s: (counts[s][i], seeds[s]) for s in SPLITS}))
        return jobs

    def _check_foreign(self, mine: list[Path]) -> None:
        """No other member store in the directory (it would join the dataset)."""
        root = self.data_dir()
        if not root.is_dir():
            if root.exists():
                raise ArrayDataError(f"data.path={root}: a file, but a trajectory dataset is "
                                     f"a directory of member files; point data.path at a "
                                     f"directory (the file was left unchanged)")
            return
        names = {p.name for p in mine}
        others = sorted(str(c) for c in root.iterdir()
                        if is_member_name(c) and c.name not in names)
        if others:
            raise ArrayDataError(
                f"data.path={root}: holds other data files {others[:5]} that would join the "
                f"dataset of model.files={self.files()} {self.data_format()} files; move them "
                f"away or choose another data.path (nothing was changed)")

    def make_member(self, path: Path, parts: dict[str, tuple[int, int]]) -> Path:
        """Solve and write one member store (atomically)."""
        arrays, frame = {}, tuple(self.frame_shape())
        for split, (count, seed) in parts.items():
            w = np.asarray(self.make_trajectories(count, seed))
            if w.ndim != 2 + len(frame) or w.shape[0] != count or w.shape[2:] != frame:
                raise ArrayDataError(f"{type(self).__name__}.make_trajectories({count}, {seed})"
                                     f" returned shape {w.shape}; [trajectory, time, *{frame}] "
                                     f"is needed (frame_shape())")
            arrays[f"{split}/{self.state_name}"] = w.astype(np.float32, copy=False)
        steps = {a.shape[1] for a in arrays.values()}
        chunks = {k: (1, 1, *frame) for k in arrays}
        fmt = self.data_format()
        shards = {k: (1, a.shape[1], *frame) for k, a in arrays.items()} if fmt == "zarr" \
            else None
        attrs = {"seed": self.cfg.data.seed, "state": self.state_name,
                 "layout": "[trajectory, time, *frame]", "time_steps": max(steps),
                 **({"dt": self.dt()} if self.dt() is not None else {}), **self.data_attrs()}
        return write_arrays(path, arrays, attrs, format=fmt, chunks=chunks, shards=shards)

    def make_data(self, *, workers: int = 1, force: bool = False, **options) -> str:
        """`spmd data make`: write the member stores missing from data.path (every one with
        `force`), in `workers` processes."""
        d, root = self.cfg.data, self.data_dir()
        self.window()
        jobs = self._jobs()
        self._check_foreign([p for p, _ in jobs])
        todo = [(p, parts) for p, parts in jobs if force or not p.exists()]
        if not todo:
            return f"{root} exists ({self.describe_data()})"
        started = time.perf_counter()
        if workers > 1 and len(todo) > 1:
            with ProcessPoolExecutor(min(workers, len(todo)), mp_context=get_context("spawn")
                                     ) as pool:
                for path in pool.map(self.make_member, *zip(*todo)):
                    log.info("wrote %s", path)
        else:
            for path, parts in todo:
                log.info("wrote %s", self.make_member(path, parts))
        (root / INDEX_NAME).unlink(missing_ok=True)   # the cache of the files just replaced
        return (f"wrote {len(todo)} of {len(jobs)} files in {root} in "
                f"{time.perf_counter() - started:.1f} s: {d.num_train} train and {d.num_test} "
                f"test trajectories of {self.state_name}, frame {tuple(self.frame_shape())}")

    def describe_data(self) -> str:
        train = self._source("train", True)
        test = self._source("test", False, self.rollout_steps())
        files = train.files.members
        return (f"{self.cfg.data.path}: {len(files)} file(s), {train.count} train windows, "
                f"{test.count} test windows of {self.rollout_steps()} rollout steps, dataset "
                f"{train.dataset}; train order: {train.index.describe()}\n"
                f"{train.describe_reads()}")

    def prepare(self, is_coordinator: bool) -> None:
        if is_coordinator and self.data_incomplete():
            log.info("data.path %s is missing or incomplete: making it now (as `spmd data "
                     "make` would)", self.cfg.data.path)
            log.info(self.make_data())
            if self.cfg.data.normalize:
                target, _ = compute_statistics(self.train_source(), "train")
                log.info("data.normalize: stored the train split's statistics in %s", target)

    # ------------------------------------------------------------ normalization

    def normalization(self) -> tuple[np.ndarray, np.ndarray] | None:
        """With data.normalize: (mean, std) per frame channel, float32, of the train split's
        trajectories (the statistics beside the data, or the run's copy when the data are
        absent); None without data.normalize."""
        if not self.cfg.data.normalize:
            return None
        cached = self.__dict__.get("_normalization")
        if cached is None:
            cached = run_normalization(self.cfg, (self.state_name,),
                                       self._stored_normalization)[self.state_name]
            self._normalization = cached
        return cached

    def _stored_normalization(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        source = self.train_source()
        plan = source.statistics_plan()
        stats = load_statistics(source.path, [source.dataset],
                                rows={source.dataset: plan[source.dataset][1]},
                                where=source.where)[source.dataset]
        if stats.channels not in (1, self.frame_channels()):
            raise ArrayDataError(
                f"{source.where}: the statistics of dataset '{source.dataset}' have "
                f"{stats.channels} channels but frames have {self.frame_channels()}; "
                f"rerun `spmd data stats CONFIG`")
        return {self.state_name: (stats.mean.astype(np.float32),
                                  stats.scale().astype(np.float32))}

    def _scaled(self, x: jax.Array, forward: bool) -> jax.Array:
        """Frames stacked along channels to model units (forward) or back to physical."""
        norm = self.normalization()
        if norm is None:
            return x
        c = self.frame_channels()
        reps = x.shape[-1] // c
        mean = jnp.tile(jnp.broadcast_to(norm[0], (c,)), reps)
        std = jnp.tile(jnp.broadcast_to(norm[1], (c,)), reps)
        return (x - mean) / std if forward else x * std + mean

    # ------------------------------------------------------------ objective

    def rollout(self, model, inputs: jax.Array, steps: int) -> list[jax.Array]:
        """`steps` predicted frames in model units (normalized with data.normalize), each
        from the last input_steps frames (fed back); `inputs` in physical units. The
        constants (the input's last `constant_channels()`) go with every step unchanged."""
        c, k, frames = self.frame_channels(), self.constant_channels(), []
        split = inputs.shape[-1] - k
        x = self._scaled(inputs[..., :split] if k else inputs, True)
        const = inputs[..., split:] if k else None
        for _ in range(steps):
            frame = model(x if const is None else jnp.concatenate(
                [x, const.astype(x.dtype)], axis=-1))
            frames.append(frame)
            x = jnp.concatenate([x[..., c:], frame.astype(x.dtype)], axis=-1)
        return frames

    def predict(self, model, batch) -> jax.Array:
        """The next frame in physical units."""
        return self._scaled(self.rollout(model, batch[self.input_name], 1)[0], False)

    def next_input(self, inputs: jax.Array, prediction: jax.Array) -> jax.Array:
        """The input after `prediction` (physical units): the last input_steps frames, the
        newest the prediction, then the constants unchanged (as `rollout` steps)."""
        c, k = self.frame_channels(), self.constant_channels()
        split = inputs.shape[-1] - k
        frames = jnp.concatenate([inputs[..., c:split], prediction.astype(inputs.dtype)],
                                 axis=-1)
        return jnp.concatenate([frames, inputs[..., split:]], axis=-1) if k else frames

    def _truths(self, target: jax.Array, steps: int) -> list[jax.Array]:
        c = self.frame_channels()
        return [target[..., k * c:(k + 1) * c] for k in range(steps)]

    def target_mask(self, batch, channels: int) -> jax.Array | None:
        """The first `channels` channels of the batch's `mask_name` field (1 where the
        target is valid), or None when the task or the batch has none."""
        mask = batch.get(self.mask_name) if self.mask_name else None
        return None if mask is None else mask[..., :channels]

    def frame_mse(self, pred: jax.Array, target: jax.Array, mask: jax.Array | None
                  ) -> jax.Array:
        """The loss and `eval_loss`: the mean squared error of `pred` against `target`
        (model units), over the points where `mask` (None: all) is nonzero. A subclass may
        weight it (GriddedTrajectoryTask: by latitude)."""
        err = (pred - target) ** 2
        if mask is None:
            return jnp.mean(err)
        return jnp.sum(err * mask) / jnp.maximum(jnp.sum(mask), 1e-12)

    def loss(self, model, batch):
        steps = self.window().target_steps
        pred = jnp.concatenate(self.rollout(model, batch[self.input_name], steps), axis=-1)
        return self.frame_mse(pred, self._scaled(batch[self.target_name], True),
                              self.target_mask(batch, pred.shape[-1])), {}

    def eval_metrics(self, model, batch) -> dict:
        steps = self.rollout_steps()
        scaled = self.rollout(model, batch[self.input_name], steps)
        preds = [self._scaled(p, False) for p in scaled]
        truths = self._truths(batch[self.target_name], steps)
        metrics = {"eval_loss": self.frame_mse(scaled[0], self._scaled(truths[0], True),
                                               self.target_mask(batch, self.frame_channels())),
                   "test_rel_l2": jnp.mean(relative_l2(preds[0], truths[0]))}
        for k, (p, t) in enumerate(zip(preds, truths), 1):
            metrics[rollout_key(k, steps)] = jnp.mean(relative_l2(p, t))
        metrics.update(self.weather_metrics(preds, truths, batch))
        return metrics

    def latitudes(self) -> np.ndarray | None:
        """Latitude in degrees of each row of a frame's first spatial axis, or None (the
        default: the frames lie on no latitude-longitude grid). With latitudes the evaluation
        adds latitude-weighted scores per channel and lead (`weather_metrics`)."""
        return None

    def channel_names(self) -> list[str] | None:
        """Names of the frame channels in metric keys (default None: c0, c1, ...)."""
        return None

    def score_climatology(self) -> np.ndarray | None:
        """The climatology `(x, y, C)` in physical units the weather scores are taken
        against (climatology RMSE, ACC), or None (the default: none). Called when the eval
        step is traced."""
        return None

    def weather_metrics(self, preds: list, truths: list, batch) -> dict:
        """With `latitudes()`: `lat_mse_<channel>_<lead>` of the rollout and
        `persistence_lat_mse_<channel>_<lead>` of the last input frame held fixed, in
        physical units (spmd.scores.weather.weather_scores; `spmd eval` reports their square
        roots, lat_rmse_*); with `score_climatology()` also `climatology_lat_mse_*` of the
        climatology as the forecast, and the ACCs `acc_*` (model) and `persistence_acc_*`.
        NaN truths, and points where a `mask_name` field is 0, are left out. {} without
        latitudes."""
        lat = self.latitudes()
        if lat is None:
            return {}
        c, steps, w = self.frame_channels(), len(preds), self.window()
        initial = batch[self.input_name][..., (w.input_steps - 1) * c:w.input_steps * c]
        mask = self.target_mask(batch, steps * c)
        if mask is not None:
            mask = jnp.stack([mask[..., k * c:(k + 1) * c] for k in range(steps)], 1) > 0
        climate = self.score_climatology()
        return weather_scores(preds, truths, initial, lat, channels=self.channel_names(),
                              mask=mask, climate=None if climate is None else
                              jnp.asarray(climate))

    def sample_outputs(self, model, batch) -> dict:
        steps, c = self.rollout_steps(), self.frame_channels()
        x = batch[self.input_name]
        preds = [self._scaled(p, False) for p in self.rollout(model, x, steps)]
        truths = self._truths(batch[self.target_name], steps)
        lead_error = jnp.stack([relative_l2(p, t) for p, t in zip(preds, truths)], axis=1)
        last = x.shape[-1] - self.constant_channels() - c        # the last input frame
        return {"input": x[..., last], "truth": truths[-1][..., 0],
                "prediction": preds[-1][..., 0], "error": (preds[-1] - truths[-1])[..., 0],
                "lead_error": lead_error}

    def plot(self, out_dir, sample) -> list:
        from spmd.tasks.figures import plot_fields

        out = Path(out_dir)
        fields = {k: v for k, v in sample.items() if k != "lead_error"}
        steps = self.rollout_steps()
        made = [plot_fields(fields, out / "samples.png",
                            title=f"{self.sample_title} (lead {steps})")]
        if "lead_error" in sample:
            overall = last_rollout_errors(out.parent / "metrics.jsonl",
                                          [rollout_key(k, steps) for k in range(1, steps + 1)])
            made.append(plot_rollout_error(np.asarray(sample["lead_error"]),
                                           out / "rollout_error.png", self.dt(), overall))
        weather = last_weather_scores(out.parent / "metrics.jsonl")
        if weather is not None:         # a task with latitudes(): model against persistence
            made.append(plot_weather_rmse(*weather, out / "lat_rmse.png", self.dt()))
        return [p for p in made if p is not None]
