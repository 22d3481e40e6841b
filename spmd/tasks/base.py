"""A task binds a model to its loss, its batch layout and its data source.

The trainer knows only this interface, so the same loop trains a language model, a
regressor or a neural operator. Data sources are pure functions of (step, row):
that is what makes a resumed run bit-identical and any process count see the
same global batch.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import jax
import numpy as np
from flax import nnx

from spmd.config import Config


@dataclass(frozen=True)
class BatchField:
    """One array of a batch: per-example shape, dtype, and logical axes including `batch`."""

    example_shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]

    def global_shape(self, batch_size: int) -> tuple[int, ...]:
        return (batch_size, *self.example_shape)


class DataSource(Protocol):
    """Rows [start, stop) of the global batch at `step`, identical for any process count."""

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]: ...


class Task(abc.ABC):
    """What the trainer needs from a model family."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @abc.abstractmethod
    def build_model(self, rngs: nnx.Rngs) -> nnx.Module: ...

    @abc.abstractmethod
    def batch_fields(self) -> Mapping[str, BatchField]: ...

    @abc.abstractmethod
    def loss(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict]:
        """Mean loss over the global batch, and auxiliary scalars to log."""

    @abc.abstractmethod
    def train_source(self) -> DataSource: ...

    def prepare(self, is_coordinator: bool) -> None:
        """One-time set-up before training (e.g. make a missing dataset); rank 0 does the work."""

    def eval_source(self) -> DataSource | None:
        return None

    def eval_metrics(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> dict:
        """Per-batch metrics averaged over eval batches (only when eval_source() is not None)."""
        return {}

    def sample_outputs(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> dict | None:
        """Arrays worth looking at (e.g. input, truth, prediction fields) for one eval batch.

        The trainer saves them as run_dir/eval_sample.npz at each evaluation; None = nothing.
        """
        return None

    def eval_batches(self) -> int:
        return self.cfg.data.eval_batches

    def tokens_per_example(self) -> int:
        """Units counted for throughput (tokens for an LM, 1 sample otherwise)."""
        return 1

    def flops_per_example(self) -> float | None:
        """Training FLOPs per example (forward + backward), for MFU; None when unknown."""
        return None


_REGISTRY = {
    "transformer": ("spmd.tasks.lm", "LanguageModelTask"),
    "mlp": ("spmd.tasks.regression", "RegressionTask"),
    "fno": ("spmd.tasks.operator", "OperatorTask"),
}


def make_task(cfg: Config) -> Task:
    """The task for `model.name` (imported lazily: one model family's deps don't load others)."""
    import importlib

    module, cls = _REGISTRY[cfg.model.name]
    return getattr(importlib.import_module(module), cls)(cfg)
