"""`spmd predict`: batched inference over a data file, optionally rolled out autoregressively.

The input field (`Task.prediction_input()`) is read from the file with the task's batch
layout, in the file's example order, batch after batch, each batch sharded over every
device of the job exactly as in training (under `spatial` a process reads and holds only
its slab of a field). `Task.predict` maps a batch to the prediction, the model in eval mode
(`model.eval()`: no dropout). With `rollout` N > 1
each prediction is fed back as the next input (a surrogate stepping in time), and every
step is kept. Process 0 writes the predictions to an HDF5 file or a Zarr v3 store (`format`,
default from the output's name: `.zarr` is Zarr), batch by batch into an array created with
its full shape, under a temporary name renamed into place when complete
(spmd.inference.outputs). Either format holds the same layout and attributes:

    prediction   (examples, *field)            rollout 1
                 (examples, steps, *field)     rollout N > 1: step k is k + 1 model steps on

The last batch is padded with the file's first examples and the padding is dropped.

A task that reads its data its own way (`Task.prediction_source`: a gridded run's
GriddedTrajectoryTask) reads `--input` as it read its training data: the windows of split
`--split` (`all`: every window) of those files, with the same variables, levels, constants,
CF decoding, calendar and latitude order, normalized with the run's own statistics. Its
predictions are in physical units, and an output named `.nc` is a NetCDF forecast file with
their coordinates (spmd.inference.forecast_netcdf). A rollout feeds each prediction back
through `Task.next_input` (a trajectory task: the newest frame, constants kept).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from spmd.comm.host_gather import gather_to_host
from spmd.data.loader.feed import BatchFeed
from spmd.data.sources.arrays import ArrayDataError, ArraySource
from spmd.engine.mesh import in_mesh, mesh_context
from spmd.engine.model_errors import framed
from spmd.engine.pipeline_checks import check_pipeline
from spmd.errors import SpmdError
from spmd.inference.loading import Trained
from spmd.inference.outputs import open_output, output_format
from spmd.sharding import activation_sharding
from spmd.sharding.pipeline import pipeline_schedule

log = logging.getLogger("spmd.inference")


@dataclass(frozen=True)
class PredictionSummary:
    """What `predict_file` wrote."""

    output: Path
    input: Path
    dataset: str
    examples: int
    rollout: int
    shape: tuple[int, ...]      # of the output dataset
    seconds: float
    format: str                 # of the output: hdf5 | zarr


def input_source(trained: Trained, path: Path, split: str, dataset: str | None,
                 batch_size: int) -> tuple[ArraySource, str]:
    """The input field's source in `path`: `dataset`, else the task's dataset path for the
    split (as data.fields or the task name it), else a dataset named like the field."""
    task, cfg = trained.task, trained.config
    name = task.prediction_input()
    field = task.batch_fields()[name]
    if dataset is not None:
        candidates = [dataset]
    else:
        template = cfg.data.fields.get(name) or task.dataset_paths().get(name, name)
        candidates = list(dict.fromkeys([template.format(split=split), name]))
    problems = []
    for candidate in candidates:
        # its errors name this command's flags (--input, --dataset), not config keys
        source = ArraySource(path, {name: candidate}, {name: field}, batch_size, shuffle=False,
                             config_key="--input", fields_key="--dataset")
        try:
            source.check()
            return source, candidate
        except ArrayDataError as e:
            problems.append(str(e))
    raise SpmdError(f"--input {path}: no usable dataset for the input field '{name}' (tried "
                    f"{candidates}; name one with --dataset): " + "; ".join(problems))


def predict_file(trained: Trained, input_path: str | Path, output_path: str | Path, *,
                 split: str = "test", dataset: str | None = None, rollout: int = 1,
                 batch_size: int | None = None, format: str | None = None
                 ) -> PredictionSummary:
    """Predict every example of `input_path` on `trained.mesh`; process 0 writes the output
    (`format` hdf5 or zarr; default: zarr for an output path ending in .zarr, else hdf5)."""
    if rollout < 1:
        raise SpmdError(f"--rollout {rollout}: give 1 or more steps")
    kind = output_format(Path(output_path), format)
    started = time.perf_counter()
    task, cfg, mesh, rules = trained.task, trained.config, trained.mesh, trained.rules
    input_path, output_path = Path(input_path), Path(output_path)
    batch = int(batch_size or cfg.train.batch_size)
    name = task.prediction_input()
    field = task.batch_fields()[name]
    source = task.prediction_source(input_path, split, batch)
    if source is None:
        source, found = input_source(trained, input_path, split, dataset, batch)
    elif dataset is not None:
        raise SpmdError(f"--dataset {dataset}: the task {cfg.task} reads --input as it read "
                        f"its training data (data.variables {cfg.data.variables}); leave "
                        f"--dataset out, and choose the times with --split")
    else:
        found = f"split {split}"
    count = source.count
    feed = BatchFeed({name: field}, batch, mesh, rules)
    in_sharding = feed.shardings[name]
    schedule = check_pipeline(cfg.train, cfg.mesh, task, rules, mesh)

    def predict(params, inputs):
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            model = trained.layout.merge(params, train=False)
            with framed("predict", type(task).__name__, model):
                return task.predict(model, inputs)

    abstract = {name: jax.ShapeDtypeStruct(field.global_shape(batch), field.dtype,
                                           sharding=in_sharding)}
    with mesh_context(mesh):   # mesh.axis_types=explicit: traced under jax.set_mesh
        out = jax.eval_shape(predict, trained.params, abstract)
        try:
            following = jax.eval_shape(task.next_input, abstract[name], out)
        except (TypeError, ValueError):             # shapes that do not concatenate
            following = None
    feeds_back = following is not None and tuple(following.shape) == abstract[name].shape
    if rollout > 1 and not feeds_back:
        raise SpmdError(f"--rollout {rollout} feeds each prediction back as input field "
                        f"'{name}' {abstract[name].shape}, but predictions have shape "
                        f"{tuple(out.shape)}; use --rollout 1 for this task")
    same = tuple(out.shape) == abstract[name].shape
    step = in_mesh(jax.jit(predict, out_shardings=in_sharding if same else None), mesh)
    advance = in_mesh(jax.jit(task.next_input, out_shardings=in_sharding), mesh)
    shape = (count, *((rollout,) if rollout > 1 else ()), *out.shape[1:])
    grid = (source.forecast_grid() if kind == "netcdf" and hasattr(source, "forecast_grid")
            else None)
    writer = open_output(output_path, kind, shape, np.dtype(out.dtype),
                         enabled=jax.process_index() == 0, grid=grid)
    try:
        for b in range(math.ceil(count / batch)):
            rows = min(batch, count - b * batch)
            inputs = feed.global_batch(source, b)
            for k in range(rollout):
                pred = step(trained.params, inputs)
                host = gather_to_host(pred)
                writer.write(b * batch, k if rollout > 1 else None, np.asarray(host)[:rows])
                if k + 1 < rollout:
                    inputs = {name: advance(inputs[name], pred).astype(field.dtype)}
        writer.commit({"task": cfg.task or "", "checkpoint": trained.source,
                       "step": trained.step, "input": str(input_path), "dataset": found,
                       "rollout": rollout, "batch_size": batch})
    finally:
        writer.close()
        source.close()
    seconds = time.perf_counter() - started
    log.info("predicted %d examples x %d step(s) of %s in %.1f s -> %s (%s)", count,
             rollout, found, seconds, output_path, kind)
    return PredictionSummary(output_path, input_path, found, count, rollout, shape, seconds,
                             kind)
