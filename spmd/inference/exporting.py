"""`spmd export`: a trained model as artifacts that need no spmd to use.

    OUT/predict.jax       the task's prediction function with the trained parameters baked
                          in, serialized by `jax.export` (StableHLO), its batch dimension
                          symbolic: `jax.export.deserialize(data).call(x)` in any process
                          with a compatible jax, for any batch size
    OUT/params/           the parameters alone (`nnx.state(model)`), written by Orbax's
                          StandardCheckpointer: Flax's NNX checkpoint recipe restores them
    OUT/export.json       what was exported: run, step, input name, shape and dtype

The function is exported for one device (the parameters are loaded whole onto one device
first), on the platform the export runs on unless `platforms` names others.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from spmd.engine.mesh import abstract_mesh_context
from spmd.errors import SpmdError
from spmd.inference.loading import Trained

log = logging.getLogger("spmd.inference")

FUNCTION_FILE = "predict.jax"
PARAMS_DIR = "params"
MANIFEST_FILE = "export.json"


@dataclass(frozen=True)
class ExportSummary:
    out_dir: Path
    input_name: str
    input_shape: tuple[str | int, ...]    # "batch" for the symbolic dimension
    input_dtype: str
    output_shape: tuple[str | int, ...]
    platforms: tuple[str, ...]
    bytes: int


def export_model(trained: Trained, out_dir: str | Path, *,
                 platforms: Sequence[str] | None = None) -> ExportSummary:
    """Write OUT/predict.jax, OUT/params/ and OUT/export.json (see the module docstring)."""
    from jax import export

    if len(trained.mesh.devices.flat) != 1:
        raise SpmdError("spmd export works on a model loaded onto one device "
                        "(spmd.load(path) without mesh=)")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SpmdError(f"{out_dir} exists and is not empty; give a new directory")
    task, model = trained.task, trained.model
    name = task.prediction_input()
    field = task.batch_fields()[name]

    def predict(x: jax.Array) -> jax.Array:
        # mesh.axis_types=explicit: the model's out_sharding=P(...) resolve against the
        # abstract mesh, entered inside the function (a jax.set_mesh around the export would
        # also cover the batch dimension's shape check, which then fails to refine at call)
        with abstract_mesh_context(trained.mesh):
            return task.predict(model, {name: x})

    (batch,) = export.symbolic_shape("batch")
    spec = jax.ShapeDtypeStruct((batch, *field.example_shape), field.dtype)
    try:
        exported = export.export(jax.jit(predict), platforms=platforms)(spec)
        data = exported.serialize()
    except Exception as e:
        raise SpmdError(f"exporting task {trained.config.task}'s predict function failed "
                        f"(jax.export, batch dimension symbolic): {type(e).__name__}: "
                        f"{str(e)[:1500]}") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / FUNCTION_FILE).write_bytes(data)
    _save_params(model, out_dir / PARAMS_DIR)
    out_shape = tuple(str(d) if not isinstance(d, int) else d
                      for d in exported.out_avals[0].shape)
    summary = ExportSummary(out_dir, name, ("batch", *field.example_shape),
                            np.dtype(field.dtype).name, out_shape,
                            tuple(exported.platforms), len(data))
    (out_dir / MANIFEST_FILE).write_text(json.dumps({
        "task": trained.config.task, "checkpoint": trained.source, "step": trained.step,
        "function": FUNCTION_FILE, "params": PARAMS_DIR, "input": name,
        "input_shape": list(summary.input_shape), "input_dtype": summary.input_dtype,
        "output_shape": list(out_shape), "platforms": list(summary.platforms),
        "jax_version": jax.__version__,
    }, indent=1))
    log.info("exported %s step %d to %s (%d bytes of StableHLO)", trained.config.task,
             trained.step, out_dir, len(data))
    return summary


def _save_params(model: nnx.Module, where: Path) -> None:
    import orbax.checkpoint as ocp

    if where.exists():
        shutil.rmtree(where)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(where.absolute(), nnx.state(model))
        checkpointer.wait_until_finished()
