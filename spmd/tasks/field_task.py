"""Field-to-field regression from an array file: the shape of most operator-learning tasks.

`FieldTask` gives a task that learns a map from one field (`input_name`) to another
(`target_name`), read through the generic array source (spmd.data.sources.arrays) from data.path,
split `train` / `test`. A subclass writes its model and says how to make its data:

    class HeatTask(spmd.FieldTask):
        input_name, target_name = "u0", "u1"
        class Config(spmd.ModelConfig): ...
        def build_model(self, rngs): ...
        def field_shape(self): return (grid, grid, grid, 1)     # per example, with channels
        def make_pairs(self, count, seed): return u0, u1         # numpy, (count, *shape)

Invariants: the loss is the mean squared error; evaluation reports `eval_loss` and
`test_rel_l2` (mean per-sample relative L2 error) over `data.eval_batches` test batches;
the data file holds datasets `{split}/{input_name}` and `{split}/{target_name}` (data.fields
may rename them) and is made by `spmd data make` or, when missing, by rank 0 before training.

With `data.normalize: true` the model sees (x - mean_x) / std_x and the loss and `eval_loss`
compare its output with (y - mean_y) / std_y, per channel (the last axis), with the train
split's statistics stored beside the data (spmd.data.stats.normalization, `spmd data stats
CONFIG`; rank 0 computes them when it makes missing data); they are loaded once, at first
use. `test_rel_l2`, `sample_outputs` and `predict` are in physical units (prediction =
output * std_y + mean_y). With `data.normalize: false` the fields are used as stored.
"""

from __future__ import annotations

import abc
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from spmd.atomic_write import write_atomic
from spmd.data.batch import BatchField
from spmd.data.formats.file_index import data_exists
from spmd.data.sources.arrays import ArrayDataError, ArraySource, write_arrays
from spmd.data.stats.normalization import compute_statistics, load_statistics
from spmd.tasks.base import ModelCfg, Task

if TYPE_CHECKING:  # the run's Config assembles the sections of every layer, this one's too
    from spmd.config.schema import Config

log = logging.getLogger("spmd.tasks.field_task")


def relative_l2(pred: jax.Array, truth: jax.Array) -> jax.Array:
    """Per-sample ||pred - truth|| / ||truth|| over all grid points and channels."""
    axes = tuple(range(1, truth.ndim))
    diff = jnp.sqrt(jnp.sum((pred - truth) ** 2, axis=axes))
    return diff / jnp.maximum(jnp.sqrt(jnp.sum(truth**2, axis=axes)), 1e-12)


class FieldTask(Task[ModelCfg]):
    """Input field -> target field, both of shape `field_shape()` with logical `field_axes`.

    Generic in its model config as `Task` is: `spmd.FieldTask[HeatConfig]` types
    `self.model_cfg`; a plain `spmd.FieldTask` subclass works the same, untyped.
    """

    input_name: str = "input"
    target_name: str = "target"
    field_axes: tuple[str | None, ...] = ("batch", "x", "y", "channels")
    sample_title: str = "Test samples at the last evaluation"

    @abc.abstractmethod
    def field_shape(self) -> tuple[int, ...]:
        """Per-example shape of both fields, channels last."""

    @abc.abstractmethod
    def make_pairs(self, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """`count` (input, target) examples for the data file, from `seed`."""

    def data_attrs(self) -> dict:
        """Attributes stored with the data file (what made it)."""
        return {}

    # ------------------------------------------------------------ layout and data

    def batch_fields(self) -> dict[str, BatchField]:
        shape = self.field_shape()
        return {name: BatchField(shape, np.float32, self.field_axes)
                for name in (self.input_name, self.target_name)}

    def dataset_paths(self) -> dict[str, str]:
        return {name: f"{{split}}/{name}" for name in (self.input_name, self.target_name)}

    def prediction_input(self) -> str:
        return self.input_name

    def _source(self, split: str, shuffle: bool) -> ArraySource:
        d = self.cfg.data
        return ArraySource.from_sections(
            self.cfg.source_sections(), split, self.batch_fields(), self.dataset_paths(),
            shuffle=shuffle, count=d.num_train if split == "train" else d.num_test)

    def make_data(self, *, workers: int = 1, force: bool = False, **options) -> str:
        """`spmd data make`: write both splits to data.path (atomically) unless present."""
        d = self.cfg.data
        path = Path(d.path) if d.path is not None else None
        if path is None:
            self._source("train", False)  # raises the error that names data.path
        if data_exists(path) and not force:
            return f"{path} exists ({self.describe_data()})"
        arrays = {}
        for split, count, seed in (("train", d.num_train, d.seed),
                                   ("test", d.num_test, d.seed + 1)):
            inputs, targets = self.make_pairs(count, seed)
            arrays[f"{split}/{self.input_name}"] = inputs
            arrays[f"{split}/{self.target_name}"] = targets
        write_arrays(path, arrays, {"seed": d.seed, **self.data_attrs()})
        return (f"wrote {path}: {d.num_train} train and {d.num_test} test examples of "
                f"{self.input_name} -> {self.target_name}, shape {self.field_shape()}")

    def describe_data(self) -> str:
        train = self._source("train", True)
        return (f"{self.cfg.data.path}: {train.count} train examples, datasets "
                f"{train.datasets}; train order: {train.index.describe()}\n"
                f"{train.describe_reads()}")

    def prepare(self, is_coordinator: bool) -> None:
        path = self.cfg.data.path
        if is_coordinator and path is not None and not data_exists(path):
            log.info("data.path %s is missing: making it now (as `spmd data make` would)", path)
            log.info(self.make_data())
            if self.cfg.data.normalize:
                target, _ = compute_statistics(self.train_source(), "train")
                log.info("data.normalize: stored the train split's statistics in %s", target)

    def train_source(self) -> ArraySource:
        return self._source("train", shuffle=True)

    def eval_source(self) -> ArraySource | None:
        return self._source("test", shuffle=False) if self.cfg.train.eval_every else None

    # ------------------------------------------------------------ normalization

    def normalization(self) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
        """With data.normalize: {field: (mean, std)} of the input and target fields, float32
        arrays of shape (channels,) (std floored at a tiny epsilon) from the statistics of
        the train split stored beside the data; loaded once. None without data.normalize.

        The values used are copied to `run.dir/normalization.json`, so a trained run loads,
        evaluates its own inputs and exports where its data are absent (spmd.load on
        another machine); with the data present, their statistics are checked as always.
        Raises ArrayDataError naming `spmd data stats CONFIG` when they are missing or
        stale."""
        if not self.cfg.data.normalize:
            return None
        cached = self.__dict__.get("_normalization")
        if cached is None:
            cached = self._normalization = run_normalization(
                self.cfg, (self.input_name, self.target_name), self._stored_normalization)
        return cached

    def _stored_normalization(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        source = self.train_source()
        plan = source.statistics_plan()
        names = {field: source.datasets[field] for field in (self.input_name,
                                                              self.target_name)}
        stats = load_statistics(source.path, sorted(set(names.values())),
                                rows={d: plan[d][1] for d in names.values()},
                                where=source.where)
        fields, out = self.batch_fields(), {}
        for field, dataset in names.items():
            st, shape = stats[dataset], fields[field].example_shape
            if shape and st.channels not in (1, shape[-1]):
                raise ArrayDataError(
                    f"{source.where}: the statistics of dataset '{dataset}' have "
                    f"{st.channels} channels but field '{field}' has {shape[-1]}; rerun "
                    f"`spmd data stats CONFIG`")
            out[field] = (st.mean.astype(np.float32), st.scale().astype(np.float32))
        return out

    def normalize(self, name: str, value: jax.Array) -> jax.Array:
        """Field `name` in the units the model works in ((value - mean) / std, per channel)."""
        norm = self.normalization()
        if norm is None:
            return value
        mean, std = norm[name]
        return (value - mean) / std

    def denormalize(self, name: str, value: jax.Array) -> jax.Array:
        """Field `name` back in physical units (value * std + mean, per channel)."""
        norm = self.normalization()
        if norm is None:
            return value
        mean, std = norm[name]
        return value * std + mean

    # ------------------------------------------------------------ objective

    def loss(self, model, batch):
        out = model(self.normalize(self.input_name, batch[self.input_name]))
        return jnp.mean((out - self.normalize(self.target_name, batch[self.target_name])) ** 2), {}

    def eval_metrics(self, model, batch) -> dict:
        truth = batch[self.target_name]
        out = model(self.normalize(self.input_name, batch[self.input_name]))
        pred = self.denormalize(self.target_name, out)
        return {"eval_loss": jnp.mean((out - self.normalize(self.target_name, truth)) ** 2),
                "test_rel_l2": jnp.mean(relative_l2(pred, truth))}

    def predict(self, model, batch):
        """The model's target field for `batch[input_name]`, in physical units."""
        out = model(self.normalize(self.input_name, batch[self.input_name]))
        return self.denormalize(self.target_name, out)

    def sample_outputs(self, model, batch) -> dict:
        x, truth = batch[self.input_name], batch[self.target_name]
        pred = self.predict(model, batch)
        return {"input": x[..., 0], "truth": truth[..., 0], "prediction": pred[..., 0],
                "error": (pred - truth)[..., 0]}

    def plot(self, out_dir, sample) -> list:
        from spmd.tasks.figures import plot_fields

        return [plot_fields(sample, Path(out_dir) / "samples.png", title=self.sample_title)]


NORMALIZATION_COPY = "normalization.json"

Normalization = dict[str, tuple[np.ndarray, np.ndarray]]


def run_normalization(cfg: Config, names: tuple[str, ...],
                      stored: Callable[[], Normalization]) -> Normalization:
    """{name: (mean, std)} a run normalizes with. The statistics a run trains with are part of
    its model: the first use keeps them in `run.dir/normalization.json` (from `stored()`,
    the statistics beside the data, checked against them), and from then on that copy is the
    normalization, read-only, whatever `data.path` says: a resumed run, `spmd eval` and
    `spmd predict` on other data, and `spmd.load` elsewhere all read it, and none rewrites
    it. Data whose own statistics differ get a warning, not a renormalized model; a new run
    directory takes the data's statistics (`spmd data stats CONFIG` recomputes them)."""
    copy = Path(cfg.run.dir) / NORMALIZATION_COPY
    if copy.is_file():
        norm = read_kept_normalization(copy, names)
        if data_exists(cfg.data.path):
            _compare_with_data(norm, stored, copy, cfg.data.path)
        else:
            log.info("data.path %s is absent: normalizing with the statistics the run trained "
                     "with (%s)", cfg.data.path, copy)
        return norm
    norm = stored()
    keep_normalization(copy, norm)
    return norm


def _compare_with_data(norm: Normalization, stored: Callable[[], Normalization], copy: Path,
                       data_path: object) -> None:
    """A warning when the statistics beside `data_path` are not the run's (another data
    set, or statistics recomputed since): the run keeps its own."""
    try:
        theirs = stored()
    except ArrayDataError as e:                    # other data without statistics: fine
        log.info("data.path %s: no statistics to compare with the run's (%s); normalizing "
                 "with the run's (%s)", data_path, e, copy)
        return
    differ = [name for name, (mean, std) in norm.items() if name in theirs and not (
        np.allclose(theirs[name][0], mean, rtol=1e-6, atol=0)
        and np.allclose(theirs[name][1], std, rtol=1e-6, atol=0))]
    if differ:
        log.warning("data.path %s: the statistics of %s differ from the ones the run trained "
                    "with; normalizing with the run's (%s, kept unchanged). A new run.dir "
                    "trains with the data's own.", data_path, ", ".join(differ), copy)


def keep_normalization(path: Path, norm: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """The normalization a run trains with, in its run directory (best effort: every rank
    writes the same bytes, each under its own temporary name, renamed into place)."""
    text = json.dumps({f: {"mean": m.tolist(), "std": s.tolist()} for f, (m, s) in
                       norm.items()}, indent=1)
    try:
        if path.is_file() and path.read_text() == text:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, durable=False)
    except OSError as e:
        log.warning("cannot keep the normalization in %s (%s): loading this run without "
                    "its data will need the data's statistics", path, e)


def read_kept_normalization(path: Path, fields: tuple[str, ...]
                            ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    try:
        doc = json.loads(path.read_text())
        return {f: (np.asarray(doc[f]["mean"], np.float32), np.asarray(doc[f]["std"],
                                                                        np.float32))
                for f in fields}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArrayDataError(f"{path}: the run's normalization cannot be read ({type(e).__name__}: "
                             f"{e}); point data.path at the data and their statistics "
                             f"(`spmd data stats CONFIG`)") from None
