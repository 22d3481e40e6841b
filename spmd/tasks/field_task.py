"""Field-to-field regression from an array file: the shape of most operator-learning tasks.

`FieldTask` gives a task that learns a map from one field (`input_name`) to another
(`target_name`), read through the generic array source (spmd.data.arrays) from data.path,
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
"""

from __future__ import annotations

import abc
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from spmd.data.arrays import ArraySource, write_arrays
from spmd.data.batch import BatchField
from spmd.data.file_index import data_exists
from spmd.tasks.base import ModelCfg, Task

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
        return ArraySource.from_config(self.cfg, split, self.batch_fields(), self.dataset_paths(),
                                       shuffle=shuffle,
                                       count=d.num_train if split == "train" else d.num_test)

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
        train = self._source("train", False)
        return f"{self.cfg.data.path}: {train.count} train examples, datasets {train.datasets}"

    def prepare(self, is_coordinator: bool) -> None:
        path = self.cfg.data.path
        if is_coordinator and path is not None and not data_exists(path):
            log.info("data.path %s is missing: making it now (as `spmd data make` would)", path)
            log.info(self.make_data())

    def train_source(self) -> ArraySource:
        return self._source("train", shuffle=True)

    def eval_source(self) -> ArraySource | None:
        return self._source("test", shuffle=False) if self.cfg.train.eval_every else None

    # ------------------------------------------------------------ objective

    def loss(self, model, batch):
        pred = model(batch[self.input_name])
        return jnp.mean((pred - batch[self.target_name]) ** 2), {}

    def eval_metrics(self, model, batch) -> dict:
        pred, truth = model(batch[self.input_name]), batch[self.target_name]
        return {"eval_loss": jnp.mean((pred - truth) ** 2),
                "test_rel_l2": jnp.mean(relative_l2(pred, truth))}

    def sample_outputs(self, model, batch) -> dict:
        x, truth = batch[self.input_name], batch[self.target_name]
        pred = model(x)
        return {"input": x[..., 0], "truth": truth[..., 0], "prediction": pred[..., 0],
                "error": (pred - truth)[..., 0]}

    def plot(self, out_dir, sample) -> list:
        from spmd.tasks.figures import plot_fields

        return [plot_fields(sample, Path(out_dir) / "samples.png", title=self.sample_title)]
