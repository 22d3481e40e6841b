"""Training hooks: what runs between steps, every N steps, in the order they were added.

Calling convention. A hook is a callable taking a `StepInfo`. `Trainer.add_hook(fn, every=N)`
calls it after every N-th update, and once more at the last step of the run (the end of
training or a stop, `info.final`), whatever N is. An object hook may also define
`start(info)` (before the first step, `info.step` = the step training starts from) and
`close(info)` (once, after the last step, with the last step's info; not called when
training raised). A `StepInfo` is read-only and holds only the step, the state, the metrics
and `final`: a hook that needs anything else (the task, the run directory, another hook)
is given it when it is constructed.

Stop protocol. A hook ends the run by returning a `Stop`; returning None (or anything else)
lets training go on:

    def stop_when_converged(info: StepInfo) -> Stop | None:
        if info.values["loss"] < 1e-3:
            return Stop("loss below 1e-3")
        return None

The trainer collects the first `Stop` of a step: the hooks after it at that step see
`info.final` True (so the metrics are logged and a checkpoint is forced), no further update
runs, and the trainer alone turns the stop into the exit status (`spmd.errors.ExitCode`):

- `Stop(reason)`: a clean end. Status 0 (`ExitCode.OK`), event `stopped` with the step, the
  hook's name and the reason. Running the same config again resumes from the saved step.
- `Stop(reason, preempted=True)`: the allocation is going away (signal, halt file, wall
  time). Status 75 (`ExitCode.PREEMPTED`, the job script requeues), event `preempted` with
  the step, the reason and the status. The built-in preemption hook returns this.
- `Stop(reason, exit_code=ExitCode.NONFINITE)` (any status but 0): the run itself failed.
  The trainer exits with that status after the `stopped` event; the built-in checkpoint hook
  saves nothing of that step. The built-in non-finite hook returns this.

Step convention: `info.step` counts updates done (1 after the first step; the last is
train.steps). metrics.jsonl, events.jsonl and checkpoint step numbers all use it; an
evaluation at step 0 is of the initial parameters.

This module is the protocol only: it imports nothing of the trainer or of the built-in hooks,
which both import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from spmd.engine.state import TrainState


@dataclass(frozen=True)
class StepInfo:
    """What a hook sees after an update (read-only: hooks tell the trainer things by return)."""

    step: int                       # updates done
    state: TrainState               # the current (sharded) train state; do not keep it
    metrics: dict[str, jax.Array]   # this step's metrics, still on device
    final: bool = False             # the last step of this run (finished or stopping)
    # host copy of `metrics`, filled on first use and shared with `as_final()`'s copy
    _host: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    @property
    def values(self) -> dict[str, float]:
        """The step's metrics as Python floats (one device-to-host transfer, cached)."""
        if self.metrics and not self._host:
            self._host.update({k: float(v) for k, v in jax.device_get(self.metrics).items()})
        return self._host

    def as_final(self) -> StepInfo:
        """This step's info with `final` set: what hooks after a stop request see."""
        return self if self.final else dataclasses.replace(self, final=True)


@dataclass(frozen=True)
class Stop:
    """A hook's request to end the run after this step (see the module docstring)."""

    reason: str              # why, in words: logged and written to events.jsonl
    preempted: bool = False  # True: save and exit 75 for a requeue; False: a clean end, 0
    # A failure of the run itself (e.g. ExitCode.NONFINITE): the trainer exits with it, and
    # the state of this step is not saved. None: 75 when preempted, else 0.
    exit_code: int | None = None


HookFn = Callable[[StepInfo], Stop | None]


@dataclass
class Hook:
    """A hook function with its period and name, as `Trainer.add_hook` registers it."""

    fn: HookFn
    every: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"hook {self.name or self.fn!r}: every={self.every!r} must be an "
                             f"integer >= 1")
        self.name = self.name or getattr(self.fn, "__name__", type(self.fn).__name__)

    def due(self, info: StepInfo) -> bool:
        """Whether this hook runs at `info`'s step: every `every` steps, and at the last."""
        return info.final or info.step % self.every == 0

    def __call__(self, info: StepInfo) -> Stop | None:
        """Run the hook; its stop request, if it made one (other return values are ignored)."""
        request = self.fn(info)
        return request if isinstance(request, Stop) else None

    def start(self, info: StepInfo) -> None:
        start = getattr(self.fn, "start", None)
        if start is not None:
            start(info)

    def close(self, info: StepInfo) -> None:
        close = getattr(self.fn, "close", None)
        if close is not None:
            close(info)
