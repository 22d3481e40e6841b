"""Training hooks: what runs between steps, every N steps, in the order they were added.

A hook is a callable taking a `StepInfo`. `Trainer.add_hook(fn, every=N)` calls it after
every N-th update, and once more at the last step of the run (the end of training or a
preemption stop, `info.final`), whatever N is. An object hook may also define
`start(info)` (before the first step, `info.step` = the step training starts from) and
`close(info)` (once, after the last step; not called when training raised).

Step convention: `info.step` counts updates done (1 after the first step; the last is
train.steps). metrics.jsonl, events.jsonl and checkpoint step numbers all use it; an
evaluation at step 0 is of the initial parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from spmd.engine.runtime import Runtime
    from spmd.engine.state import TrainState
    from spmd.train.trainer import Trainer


@dataclass
class StepInfo:
    """What a hook sees after an update."""

    step: int                       # updates done
    state: TrainState               # the current (sharded) train state; do not keep it
    metrics: dict[str, jax.Array]   # this step's metrics, still on device
    runtime: Runtime
    trainer: Trainer
    final: bool = False             # the last step of this run (finished or stopping)
    stop_reason: str | None = None  # set when the run stops early (preemption)
    _host: dict[str, float] | None = field(default=None, repr=False)

    @property
    def values(self) -> dict[str, float]:
        """The step's metrics as Python floats (one device-to-host transfer, cached)."""
        if self._host is None:
            self._host = {k: float(v) for k, v in jax.device_get(self.metrics).items()}
        return self._host


HookFn = Callable[[StepInfo], Any]


@dataclass
class Hook:
    fn: HookFn
    every: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"hook {self.name or self.fn!r}: every={self.every!r} must be an "
                             f"integer >= 1")
        self.name = self.name or getattr(self.fn, "__name__", type(self.fn).__name__)

    def due(self, info: StepInfo) -> bool:
        return info.final or info.step % self.every == 0

    def start(self, info: StepInfo) -> None:
        start = getattr(self.fn, "start", None)
        if start is not None:
            start(info)

    def close(self, info: StepInfo) -> None:
        close = getattr(self.fn, "close", None)
        if close is not None:
            close(info)
