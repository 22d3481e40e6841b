"""Experiment trackers (`run.trackers`): TensorBoard, and offline W&B and MLflow as extras.

Why: metrics.jsonl is the record of a run, but people compare runs in TensorBoard, W&B or
MLflow. A tracker receives every scalar metrics.jsonl receives (train and eval records, `lr`,
throughput, MFU where known) at the record's step, and the resolved config as
hyper-parameters once. metrics.jsonl stays the source of truth and is always written; only
rank 0 creates trackers (spmd.loop.builtin_hooks.MetricsHook).

Compute nodes have no internet, so everything writes to files under run.dir:
- tensorboard: tensorboardX event files in run.dir/tensorboard (`tensorboard --logdir`),
  one per process that wrote: events.out.tfevents.<time>.<host>.<pid>, so that two
  processes on one host in the same second (a fast requeue) never truncate each other's.
- wandb: W&B's offline mode (unless WANDB_MODE says otherwise) in run.dir/wandb; upload
  later from a login node with `wandb sync RUN_DIR/wandb/offline-run-*`.
- mlflow: MLflow's file store in run.dir/mlruns (unless MLFLOW_TRACKING_URI is set);
  `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN_DIR/mlruns`. MLflow 3 keeps
  that store in "maintenance mode" and refuses it unless MLFLOW_ALLOW_FILE_STORE=true; it is
  the one store that needs neither a server nor a database driver (mlflow-skinny has none),
  so the tracker sets that variable for this process unless the user set it (a user's
  `false` is kept, and then the tracker does not start).
Each library is imported only when its tracker is made: a missing extra is one error that
names `run.trackers` and the pip extra to install; a tracker that fails to start for any
other reason is one error (spmd.errors.SpmdError) that names `run.trackers`, the tracker,
the library's first line and what to set, never a raw traceback, and the trackers already
started are closed.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from spmd.errors import SpmdError

# Keys of a metrics.jsonl record that are coordinates, not scalars to track.
NOT_SCALARS = frozenset({"step", "time"})
EXTRAS = {"tensorboard": ("tensorboardX", "spmd-hpc"), "wandb": ("wandb", "spmd-hpc[wandb]"),
          "mlflow": ("mlflow", "spmd-hpc[mlflow]")}
# What to check or set when a tracker's library is installed but the tracker fails to start.
HINTS = {
    "tensorboard": "check that RUN_DIR/tensorboard can be written",
    "wandb": "W&B writes offline to run.dir/wandb unless WANDB_MODE says otherwise: unset "
             "WANDB_MODE or set WANDB_MODE=offline (online needs internet and `wandb login`)",
    "mlflow": "the default store, run.dir/mlruns, needs MLFLOW_ALLOW_FILE_STORE=true with "
              "MLflow 3 (spmd sets it unless you set it yourself); or set MLFLOW_TRACKING_URI "
              "to a store this node can reach",
}
# MLflow >= 3 opens a file store (`file:` URI or a path) only with this variable true.
MLFLOW_FILE_STORE_VAR = "MLFLOW_ALLOW_FILE_STORE"


class Tracker(Protocol):
    """Receives the scalars of each metrics record, at its step; closed once at the end."""

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics record, minus its coordinates (`step`, `time`)."""
    return {k: float(v) for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, int | float) and not isinstance(v, bool)}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; lists and None become strings, so every
    tracker's hyper-parameter table takes the values as they are."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def _require(name: str) -> ModuleType:
    module, extra = EXTRAS[name]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SpmdError(f"run.trackers lists {name!r} but {module} is not installed: "
                        f"pip install '{extra}' (or remove {name!r} from run.trackers)") from e


class TensorBoardTracker:
    """Scalars and the config (hparams plugin + a text summary) in run.dir/tensorboard."""

    def __init__(self, run_dir: Path, hparams: Mapping[str, Any], config_text: str = ""):
        tbx = _require("tensorboard")
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import hparams as hparams_summary

        self._summary = Summary
        self.logdir = run_dir / "tensorboard"
        # flush_secs: a killed job loses at most this much of its TensorBoard curves;
        # tensorboardX names a file <time to the second>.<host> and opens it "wb": the pid
        # keeps two processes' files apart
        self.writer = tbx.SummaryWriter(logdir=str(self.logdir), flush_secs=10,
                                        filename_suffix=f".{os.getpid()}")
        for summary in hparams_summary(dict(hparams), {}):
            self.writer.file_writer.add_summary(summary)
        if config_text:
            self.writer.add_text("config", f"```\n{config_text}\n```", 0)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        # One event per record with every scalar in it (tensorboardX's own protobuf): a
        # quarter of the cost of one add_scalar event per value.
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v)
                                       for k, v in scalars.items()])
        self.writer.file_writer.add_summary(summary, step)

    def close(self) -> None:
        self.writer.close()


def stable_id(run_dir: Path) -> str:
    """One id per run directory, so every requeued job of a run appends to the same W&B run."""
    return "spmd-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]


class WandbTracker:
    """A W&B run in run.dir/wandb, offline unless WANDB_MODE is set (`wandb sync` later)."""

    def __init__(self, run_dir: Path, hparams: Mapping[str, Any]):
        wandb = _require("wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "spmd"),
                              name=run_dir.name, id=stable_id(run_dir), resume="allow",
                              dir=str(run_dir), config=dict(hparams),
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run per job in the file store run.dir/mlruns (or MLFLOW_TRACKING_URI).

    Sets MLFLOW_ALLOW_FILE_STORE=true for this process before importing mlflow, unless the
    user set it: MLflow 3 refuses a file store without it (MLflow 2 ignores it)."""

    def __init__(self, run_dir: Path, hparams: Mapping[str, Any]):
        os.environ.setdefault(MLFLOW_FILE_STORE_VAR, "true")
        # MLflow 3 sends usage telemetry: on a compute node with no internet each try
        # waits for its timeout. Off unless the user says otherwise.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        _require("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "spmd")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(name))
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                             tags={"spmd.run_dir": str(run_dir)}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in hparams.items()]
        for i in range(0, len(params), 100):   # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items() if math.isfinite(v)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def create_trackers(names: list[str], run_dir: Path, config: Mapping[str, Any],
                    config_text: str = "") -> list[Tracker]:
    """The trackers `run.trackers` names, each given the resolved config (nested dict)."""
    hparams = flatten(config)
    makers = {"tensorboard": lambda: TensorBoardTracker(run_dir, hparams, config_text),
              "wandb": lambda: WandbTracker(run_dir, hparams),
              "mlflow": lambda: MlflowTracker(run_dir, hparams)}
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SpmdError(f"run.trackers: unknown tracker(s) {unknown}; choose from "
                        f"{sorted(makers)}")
    made: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):
            made.append(_start(name, makers[name]))
    except BaseException:
        for tracker in made:   # started before the one that failed: leave nothing open
            try:
                tracker.close()
            except Exception:
                pass
        raise
    return made


def _start(name: str, make: Callable[[], Tracker]) -> Tracker:
    """make(), with any failure but a missing extra turned into one line that names the
    tracker, the library's own first line and what to set (HINTS)."""
    try:
        return make()
    except SpmdError:
        raise
    except Exception as e:
        lines = str(e).strip().splitlines()
        line = lines[0] if lines else ""
        line = line if len(line) <= 240 else line[:240] + "..."
        first = f"{type(e).__name__}: {line}" if line else type(e).__name__
        raise SpmdError(f"run.trackers: the {name} tracker did not start ({first}); "
                        f"{HINTS[name]}") from e
