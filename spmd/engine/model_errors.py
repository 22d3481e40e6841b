"""Exceptions from the user's model, or from Flax/JAX inside it, framed in one line first.

A raw traceback from deep inside `jax.jit` tracing does not say whether it came from
building the model, the train step or evaluation, nor which task. `framed(stage, task)`
wraps each place spmd calls into the task's model; an exception that is not spmd's own
(`SpmdError`) becomes a `ModelError` whose message is

    <stage> of task <TaskClass> failed[ in module <Class> at <path>]
      <OriginalType>: <first line of the original message>
      hint: <what to try, for the known cases>

The original exception stays chained (`__cause__`), and its whole traceback is written to
this rank's log files (not the console). The exit status is `ExitCode.USER_ERROR` (the
message names what to fix), from the one table in spmd.errors.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from flax import nnx

from spmd.errors import ExitCode, SpmdError

log = logging.getLogger("spmd.model")

# What each stage is called in the framed line.
STAGES = {
    "build": "building the model (Task.build_model)",
    "init": "initializing the parameters (Task.build_model under jit)",
    "train_mode": "putting the model in train mode (Task.train_mode)",
    "eval_mode": "putting the model in eval mode (Task.eval_mode)",
    "train_step": "tracing the train step (Task.loss)",
    "eval_step": "tracing the eval step (Task.eval_metrics)",
    "sample": "tracing the eval sample (Task.sample_outputs)",
    "compile": "compiling the train step",
    "predict": "predicting (Task.predict)",
}

# (pattern in the original message, hint); the first match wins.
_HINTS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"No [`'](\w+)[`'] argument was provided"),   # Flax's backticks or quotes
     "the model needs the mode flag '{0}': set it in your Task's train_mode/eval_mode, e.g. "
     "`def train_mode(self, model): model.train(); model.set_attributes({0}=False)` "
     "(docs/own_model.md, 'Train and eval modes')"),
    (re.compile(r"auto mesh context or metadata is required"),
     "the model creates a sharded variable eagerly (nnx.with_partitioning with eager "
     "sharding on): spmd places parameters itself, so build it under `with "
     "nnx.use_eager_sharding(False):` (or nnx.eval_shape), or pass shardings explicitly"),
    (re.compile(r"PartitionSpec when you are not under a mesh context"
                r"|cannot contain axis names that are of type Auto"),
     "the model uses JAX's explicit sharding (out_sharding=P(...) or reshard with "
     "mesh-axis names): set mesh.axis_types=explicit, so that spmd builds the mesh with "
     "AxisType.Explicit axes and traces under jax.set_mesh, the mesh context it needs "
     "(docs/sharding.md, 'Explicit sharding'); or name logical axes instead "
     "(spmd.constrain / with_axes) or pass NamedShardings"),
    (re.compile(r"could not be resolved unambiguously|acts as an assert when all axes"),
     "under mesh.axis_types=explicit every operation needs an unambiguous sharding: pass "
     "out_sharding=P(...) where JAX asks (or jax.sharding.reshard instead of a sharding "
     "constraint), or train this model with mesh.axis_types=auto (spmd's own models and "
     "models annotated with logical names are written for auto)"),
]


class ModelError(SpmdError):
    """An exception from the task's model (or Flax/JAX inside it), framed with the stage."""

    exit_code = ExitCode.USER_ERROR

    def __init__(self, stage: str, task: str, cause: BaseException, where: str | None = None):
        self.stage, self.task, self.where = stage, task, where
        self.hint = hint_for(cause)
        text = str(cause).strip().splitlines()
        original = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
        head = f"{STAGES.get(stage, stage)} of task {task} failed"
        lines = [head + (f" in {where}" if where else ""), f"  {original}"]
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        lines.append("  (the full traceback is in this rank's log; `spmd --debug` prints it)")
        super().__init__("\n".join(lines))


def hint_for(e: BaseException) -> str | None:
    """The hint for a known Flax/JAX error, or None."""
    text = str(e)
    for pattern, hint in _HINTS:
        found = pattern.search(text)
        if found:
            return hint.format(*found.groups())
    return None


def _innermost_module(tb: TracebackType | None) -> nnx.Module | None:
    """The `self` of the innermost traceback frame that is a method of an nnx.Module."""
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, nnx.Module):
            found = candidate
        tb = tb.tb_next
    return found


def module_path(e: BaseException, model: Any = None) -> str | None:
    """`module <Class> at <path>` of the innermost model module the traceback passes
    through (the path when `model` is given and holds it), or None."""
    module = _innermost_module(e.__traceback__)
    if module is None:
        return None
    where = f"module {type(module).__name__}"
    if model is not None:
        try:
            for path, node in nnx.iter_graph(model):
                if node is module:
                    return where + (f" at {'/'.join(map(str, path))}" if path else " (the root)")
        except Exception:  # noqa: BLE001 - a path is a courtesy; the frame is what matters
            pass
    return where


def _to_log_files(e: BaseException, head: str) -> None:
    """The whole traceback into this rank's log files only (the console gets the frame)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s; traceback:\n%s",
                            (head, "".join(traceback.format_exception(e))), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


@contextmanager
def framed(stage: str, task: str, model: Any = None) -> Iterator[None]:
    """Frame any exception but spmd's own raised inside as a `ModelError` of `stage`."""
    try:
        yield
    except SpmdError:
        raise
    except Exception as e:
        error = ModelError(stage, task, e, module_path(e, model))
        _to_log_files(e, str(error).splitlines()[0])
        raise error from e
