"""Operator learning: an FNO maps Darcy permeability fields a(x) to pressure fields u(x).

Fields are normalized in the graph with scalar per-field mean/std of the train split
(stored in the dataset file). Loss: mean squared error of the normalized output field.
Reported on the test split: `eval_loss` (the same loss) and `test_rel_l2`, the mean over
samples of ||u_pred - u|| / ||u|| on the de-normalized (physical) fields, as in the FNO paper.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, model_validator

from spmd.data.batch import BatchField
from spmd.data.data_config import DataConfig
from spmd.data.formats.field_files import (
    DatasetError,
    FieldsInfo,
    FieldStats,
    available_cpus,
    check_fields,
    describe,
    field_stats,
    inspect_fields,
)
from spmd.data.sources.arrays import ArraySource
from spmd.models.fno import FIELD, FNO2d
from spmd.tasks.base import ModelConfig, Task
from spmd.tasks.darcy import make_darcy_dataset
from spmd.tasks.field_task import relative_l2

log = logging.getLogger("spmd.tasks.neural_operator")

# Dataset paths of the batch fields in a fields file (spmd.data.formats.field_files); data.fields
# overrides.
DATASETS = {"a": "{split}/a", "u": "{split}/u"}


def dataset_path(model: FnoConfig, data: DataConfig) -> Path:
    """The dataset file of an operator config, or an error naming the keys to set."""
    if data.source != "hdf5" or data.path is None:
        raise DatasetError(
            f"model.name={model.name} trains on fields from an HDF5 file: set "
            f"data.source=hdf5 and data.path=FILE (made by `spmd data make` if missing); "
            f"got data.source={data.source}, data.path={data.path}"
        )
    path = Path(data.path)
    if path.is_dir() or any(c in str(path) for c in "*?["):
        raise DatasetError(
            f"model.name={model.name} trains on one HDF5 fields file made by `spmd data "
            f"make` (its solver parameters and statistics are per file); data.path={path} "
            f"is a {'directory' if path.is_dir() else 'glob'}. Point data.path at one file, "
            f"or train many files with a spmd.FieldTask of your own (it reads directories and "
            f"globs of HDF5, NetCDF4, Zarr and .npy stores: docs/data.md)"
        )
    return path


def make_dataset(model: FnoConfig, data: DataConfig, *, workers: int = 1, in_threads: bool = False,
                 compression: str | None = None) -> FieldsInfo:
    """`spmd data make`: solve the PDE for the config's sizes and write data.path atomically
    (`workers` solver processes, or threads `in_threads`: inside a rank,
    spmd.data.formats.field_files)."""
    path = dataset_path(model, data)
    total = data.num_train + data.num_test
    log.info("making %s: %d Darcy problems on a %dx%d grid (seed %d)", path, total,
             model.grid, model.grid, data.seed)
    started, marks = time.perf_counter(), set()

    def progress(done: int, total: int) -> None:
        quarter = 4 * done // total
        if quarter not in marks:
            marks.add(quarter)
            log.info("  %d/%d samples, %.1fs", done, total, time.perf_counter() - started)

    info = make_darcy_dataset(
        path, grid=model.grid, num_train=data.num_train, num_test=data.num_test,
        seed=data.seed, solver=data.solver, workers=workers, in_threads=in_threads,
        compression=compression,
        progress=progress,
    )
    log.info("wrote %s in %.1fs", describe(info), time.perf_counter() - started)
    return info


def validate_dataset(model: FnoConfig, data: DataConfig) -> FieldsInfo:
    """The dataset file checked against model.grid, channels and data.num_* (or an error)."""
    m, d = model, data
    info = inspect_fields(dataset_path(model, data))
    check_fields(info, grid=m.grid, in_channels=m.in_channels, out_channels=m.out_channels,
                 num_train=d.num_train, num_test=d.num_test)
    return info


class FnoConfig(ModelConfig):
    """model (fno): a 2-D Fourier neural operator on fields of grid x grid points (the
    Darcy flow main job: configs/fno_darcy.yaml)."""

    name: Literal["fno"] = "fno"
    in_channels: int = Field(1, ge=1, description="Channels of the input field.")
    out_channels: int = Field(1, ge=1, description="Channels of the output field.")
    width: int = Field(32, ge=1, description="Channels inside the Fourier layers.")
    modes: int = Field(
        12, ge=1, description="Fourier modes kept per dimension (2 x modes <= grid).")
    num_layers: int = Field(4, ge=1, description="Fourier layers.")
    grid: int = Field(
        64, ge=4, description="Points per side of the fields; must match the data set.")
    projection: int = Field(
        128, ge=1, description="Hidden channels of the output projection.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The compute dtype; bfloat16 with param_dtype float32 is the "
        "usual mixed precision.")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The dtype the parameters (master weights) are stored in.")

    @model_validator(mode="after")
    def _modes_fit(self) -> FnoConfig:
        if 2 * self.modes > self.grid:
            raise ValueError(
                f"modes={self.modes} needs grid >= {2 * self.modes} "
                f"(got {self.grid}): a Fourier layer keeps modes x modes frequencies per half"
            )
        return self


class OperatorTask(Task[FnoConfig]):
    Config = FnoConfig

    def build_model(self, rngs: nnx.Rngs) -> FNO2d:
        m = self.model_cfg
        return FNO2d(in_channels=m.in_channels, out_channels=m.out_channels, width=m.width,
                     modes=m.modes, num_layers=m.num_layers, projection=m.projection,
                     rngs=rngs, dtype=jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype))

    def batch_fields(self) -> dict[str, BatchField]:
        m = self.model_cfg
        f32 = np.dtype(np.float32)
        return {"a": BatchField((m.grid, m.grid, m.in_channels), f32, FIELD),
                "u": BatchField((m.grid, m.grid, m.out_channels), f32, FIELD)}

    # ------------------------------------------------------------ data

    def make_data(self, *, workers: int = 1, force: bool = False,
                  compression: str | None = None, **options) -> str:
        """`spmd data make`: solve the Darcy problems and write data.path (atomic rename)."""
        path = dataset_path(self.model_cfg, self.cfg.data)
        if path.exists() and not force:
            return f"{describe(self._info)} exists and fits the config"
        return describe(make_dataset(self.model_cfg, self.cfg.data, workers=workers,
                                     compression=compression))

    def describe_data(self) -> str:
        return (f"{describe(self._info)}; train order: "
                f"{self.train_source().index.describe()}")

    def prepare(self, is_coordinator: bool) -> None:
        """Rank 0 makes a missing dataset; every rank that sees the file validates it."""
        path = dataset_path(self.model_cfg, self.cfg.data)
        if is_coordinator and not path.exists():
            workers = available_cpus()   # the other ranks wait: use this rank's CPUs
            log.info("data.path %s is missing: making it now with %d solver thread(s) (as "
                     "`spmd data make --workers %d` would)", path, workers, workers)
            make_dataset(self.model_cfg, self.cfg.data, workers=workers, in_threads=True)
        if path.exists():
            _ = self._info  # other ranks validate after the barrier, when sources are made

    @functools.cached_property
    def _info(self) -> FieldsInfo:
        return validate_dataset(self.model_cfg, self.cfg.data)

    @functools.cached_property
    def stats(self) -> dict[str, FieldStats]:
        return field_stats(self._info, self.cfg.data.num_train)

    def _source(self, split: str, count: int, shuffle: bool) -> ArraySource:
        _ = self._info  # the fields file validated against the config first
        return ArraySource.from_sections(self.cfg.source_sections(), split,
                                         self.batch_fields(), DATASETS, shuffle=shuffle,
                                         count=count)

    def train_source(self) -> ArraySource:
        return self._source("train", self.cfg.data.num_train, shuffle=True)

    @functools.cached_property
    def _eval_source(self) -> ArraySource:
        return self._source("test", self.cfg.data.num_test, shuffle=False)

    def eval_source(self) -> ArraySource | None:
        return self._eval_source if self.cfg.train.eval_every else None

    # ------------------------------------------------------------ model

    def _normalize(self, name: str, x: jax.Array) -> jax.Array:
        s = self.stats[name]
        return (x - s.mean) / s.std

    def _denormalize(self, name: str, x: jax.Array) -> jax.Array:
        s = self.stats[name]
        return x * s.std + s.mean

    def predict(self, model: nnx.Module, batch) -> jax.Array:
        """Physical u predicted for physical a."""
        return self._denormalize("u", model(self._normalize("a", batch["a"])))

    def dataset_paths(self) -> dict[str, str]:
        return dict(DATASETS)

    def loss(self, model, batch):
        pred = model(self._normalize("a", batch["a"]))
        return jnp.mean((pred - self._normalize("u", batch["u"])) ** 2), {}

    def eval_metrics(self, model, batch) -> dict:
        pred = model(self._normalize("a", batch["a"]))
        loss = jnp.mean((pred - self._normalize("u", batch["u"])) ** 2)
        rel = relative_l2(self._denormalize("u", pred), batch["u"])
        return {"eval_loss": loss, "test_rel_l2": jnp.mean(rel)}

    def sample_outputs(self, model, batch) -> dict:
        # The whole (sharded) batch: a slice of it need not divide the mesh. The trainer
        # keeps the first few examples.
        a, u = batch["a"], batch["u"]
        pred = self.predict(model, batch)
        return {"input": a[..., 0], "truth": u[..., 0], "prediction": pred[..., 0],
                "error": (pred - u)[..., 0]}

    def plot(self, out_dir, sample) -> list:
        from spmd.tasks.figures import plot_fields

        return [plot_fields(sample, Path(out_dir) / "samples.png")]

    def flops_per_example(self) -> float:
        """Forward + backward (3x forward): pointwise maps, spectral mixing and the real FFTs."""
        m = self.model_cfg
        points = m.grid * m.grid
        pointwise = 2 * points * ((m.in_channels + 2) * m.width + m.num_layers * m.width**2
                                  + m.width * m.projection + m.projection * m.out_channels)
        mixing = m.num_layers * 8 * 2 * m.modes * m.modes * m.width * m.width
        ffts = m.num_layers * 2 * m.width * 2.5 * points * np.log2(points)
        return float(3.0 * (pointwise + mixing + ffts))
