"""A task binds a model to its loss, its batch layout, its data source and its config.

The trainer knows only this interface, so the same loop trains a language model, a
regressor, a neural operator or a user's own model. A task declares the pydantic class
that validates the YAML `model:` section as its class attribute `Config`; the trainer
hands it the validated run config, and the task reads its own section as `self.model_cfg`
(typed as that `Config` when the task names it, `class MyTask(spmd.Task[MyConfig])`) or,
untyped, as `self.cfg.model`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field

from spmd.data.batch import BatchField, DataSource

if TYPE_CHECKING:
    # jax, optax and flax only name types here: reading a config (`spmd run`, `spmd ckpt
    # ls`, the job scripts) validates `model:` against ModelConfig without importing them
    import jax
    import optax
    from flax import nnx

    # the run's Config assembles the sections of every layer, this one's too
    from spmd.config.schema import Config


class ModelConfig(BaseModel):
    """model: the task's own section, validated by its class attribute `Task.Config` (a
    subclass of this one): strict, frozen.

    `name` is optional for a task named by `task: module:Class`; a registered task's name
    (e.g. `fno`) selects it when `task:` is absent.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(
        None, description="A registered task's name (transformer, mlp, fno, ...): selects the "
        "task when `task:` is absent.")

ModelCfg = TypeVar("ModelCfg", bound=BaseModel)


class Task(abc.ABC, Generic[ModelCfg]):
    """What the trainer needs from a model family. Subclass it, and name it in `task:`.

    `Task[MyConfig]` types `model_cfg` as the task's own `Config` (set both); a plain
    `Task` subclass works the same, with `model_cfg` typed as any pydantic model.

    Randomness and modes: the model that `loss` receives is in train mode (`model.train()`:
    `nnx.Dropout` active), the one that `eval_metrics`, `sample_outputs` and `predict`
    receive is in eval mode (`model.eval()`). `loss` and `eval_metrics` may declare the
    keyword parameters `rngs` and/or `train` (or `**kwargs`); spmd passes only what they
    accept (the 2-argument form gets neither). `rngs` is an `nnx.Rngs` with streams
    `dropout` and `default`, a pure function of (`train.seed`, step): pass it on to the
    model, `model(x, rngs=rngs)`, for Dropout built without `rngs`. A Dropout built with
    `rngs=rngs` keeps its own stream, which spmd reseeds from the same step key, so either
    way a resumed run draws exactly what an uninterrupted one would. Model variables other
    than parameters and RNG streams (e.g. BatchNorm's batch statistics) are not supported.
    A model that needs more than `train()`/`eval()` (e.g. Flax's attention `decode=False`)
    gets it from overrides of `train_mode` and `eval_mode`.
    """

    Config: ClassVar[type[BaseModel]] = ModelConfig

    def __init__(self, cfg: Config):
        """`cfg`: the run's whole config, user API for a task to read (`self.cfg.model`,
        `self.cfg.data`, `self.cfg.train.seed`); frozen, never to be replaced. spmd's own
        components take only their sections of it."""
        self.cfg = cfg

    @property
    def model_cfg(self) -> ModelCfg:
        """This task's `model:` section, validated by its `Config` (the run config's `model`)."""
        return cast(ModelCfg, self.cfg.model)

    @abc.abstractmethod
    def build_model(self, rngs: nnx.Rngs) -> nnx.Module: ...

    @abc.abstractmethod
    def batch_fields(self) -> Mapping[str, BatchField]: ...

    def train_mode(self, model: nnx.Module) -> None:
        """Put `model` into train mode, in place, before `loss` sees it (inside the jitted
        step, on every trace). Default: `model.train()` (Dropout active). Override to set
        more, e.g. `model.set_attributes(deterministic=False, decode=False)`."""
        model.train()

    def eval_mode(self, model: nnx.Module) -> None:
        """Put `model` into eval mode, in place, before `eval_metrics`, `sample_outputs`,
        `predict`, `spmd.load` and `spmd export` see it. Default: `model.eval()` (Dropout
        off). Override to set more, e.g. `model.set_attributes(deterministic=True,
        decode=False)`."""
        model.eval()

    @abc.abstractmethod
    def loss(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict]:
        """Mean loss over the global batch, and auxiliary scalars to log.

        The model is in train mode. An override may add keyword parameters
        `loss(self, model, batch, *, rngs=None, train=True)`: `rngs`, this update's
        `nnx.Rngs` (streams `dropout`, `default`); `train`, True here (the same function
        serves evaluation with False). Either, both, or `**kwargs`; spmd passes what the
        signature accepts.
        """

    @abc.abstractmethod
    def train_source(self) -> DataSource: ...

    def make_data(self, *, workers: int = 1, force: bool = False, **options) -> str | None:
        """`spmd data make`: write this task's data set if missing (or `force`); None = no data
        set to make (the task generates its data). Returns a one-line description."""
        return None

    def describe_data(self) -> str | None:
        """`spmd data info`: the data set checked against the config; None = nothing on disk."""
        return None

    def prepare(self, is_coordinator: bool) -> None:
        """One-time set-up before training (e.g. make a missing dataset); rank 0 does the work."""

    def eval_source(self) -> DataSource | None:
        return None

    def eval_batch_fields(self) -> Mapping[str, BatchField] | None:
        """The batch layout of `eval_source()` when it differs from `batch_fields()` (e.g.
        a rollout target of many time steps, where training reads one); eval_metrics and
        sample_outputs then receive batches of this layout. None (default): batch_fields().
        """
        return None

    def eval_metrics(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> dict:
        """Per-batch metrics, each a mean over the batch's examples (only when eval_source()
        is not None). An evaluation weights batches by their examples, and takes the
        padding of a split's partial last batch out by those means (spmd.loop.split_eval),
        so a metric that is not a mean of per-example values (a maximum, a ratio of batch
        sums) is approximate there.

        The model is in eval mode. Like `loss`, an override may take `rngs` (from a fixed
        key: evaluation is deterministic) and `train` (False) as keyword parameters.
        """
        return {}

    def sample_outputs(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> dict | None:
        """Arrays worth looking at (e.g. input, truth, prediction fields) for one eval batch.

        Computed on the whole (sharded) eval batch; the trainer keeps the first few examples
        in run_dir/eval_sample.npz at each evaluation. None = nothing.
        """
        return None

    def plot(self, run_dir, sample: Mapping[str, object]) -> list:
        """Task-specific figures from an eval sample (paths written); spmd draws the curves."""
        return []

    def prediction_input(self) -> str:
        """The batch field a prediction reads (`spmd predict --input`, `spmd export`): by
        default the first of `batch_fields()`. A rollout feeds predictions back into it."""
        return next(iter(self.batch_fields()))

    def predict(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> jax.Array:
        """The model's prediction for a batch holding `prediction_input()` (physical units:
        undo any normalization the loss works in). Default: the model on that field."""
        return model(batch[self.prediction_input()])

    def next_input(self, inputs: jax.Array, prediction: jax.Array) -> jax.Array:
        """The input field of the next step of a rollout (`spmd predict --rollout N`) from
        this step's input and prediction (both physical units). Default: the prediction
        itself (a task whose prediction has the input's shape)."""
        return prediction

    def prediction_source(self, path: Path, split: str, batch_size: int) -> DataSource | None:
        """The examples `spmd predict --input PATH` reads, when this task reads them its own
        way (an ArraySource whose fields include `prediction_input()`), or None: then the
        input field's dataset in the file (`dataset_paths`, `--dataset`)."""
        return None

    def dataset_paths(self) -> Mapping[str, str]:
        """Each batch field's dataset in a data file, "{split}" standing for train or test
        (`data.fields` overrides them); `spmd predict` finds its input through this."""
        return {name: f"{{split}}/{name}" for name in self.batch_fields()}

    def eval_batches(self) -> int:
        return self.cfg.data.eval_batches

    def tokens_per_example(self) -> int:
        """Units counted for throughput (tokens for an LM, 1 sample otherwise)."""
        return 1

    def flops_per_example(self) -> float | None:
        """Training FLOPs per example (forward + backward), for MFU; None when unknown."""
        return None

    def logical_axis_rules(self) -> Sequence[tuple[str, str | Sequence[str] | None]] | None:
        """The model's own Flax-style logical-axis rules, as for `nnx.logical_axis_rules`:
        `[('embed', None), ('mlp', 'model'), ...]`, (logical name, mesh axis name(s) or None),
        in priority order (a name listed twice: the first wins). They may name the model's
        own mesh axes ('model'); `mesh.axis_aliases` maps those onto spmd's (e.g.
        {model: tensor}). They override the strategy's preset; `mesh.rules` overrides them.
        None: the preset and `mesh.rules` alone."""
        return None

    def optimizer(self, schedule: optax.Schedule) -> optax.GradientTransformation | None:
        """This task's own update rule, replacing the `optimizer:` section's `name`, its
        parameters and weight decay; None (the default): the section's.

        `schedule` is the run's learning rate (the `schedule:` section peaking at
        `optimizer.lr`, as logged in metrics.jsonl's `lr`): use it, and the logged `lr` is
        the one applied. Gradient clipping (`optimizer.grad_clip`) and `train.nonfinite:
        skip` still wrap what is returned; its state is sharded like the parameters."""
        return None
