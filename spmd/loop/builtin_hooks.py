"""The built-in hooks: preemption, metrics, evaluation, checkpointing, plots.

They use the same `Hook` protocol as a user's hooks (spmd.loop.hooks): the preemption hook
stops the run by returning a `Stop`, as a user's hook would, and the trainer, not the hook,
turns it into the exit status. Each hook is given what it needs when it is built (the
runtime, the run directory, the event log, the preemption hook whose stop a final
evaluation and the plots skip); none reads or writes another's state through `StepInfo`.
Evaluation time is not counted as step time.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

import jax
import numpy as np

from spmd.engine.runtime import Runtime
from spmd.loop.hooks import StepInfo, Stop
from spmd.rundir.metrics import EventLog, JsonlWriter, Progress
from spmd.tasks import Task

log = logging.getLogger("spmd.loop.trainer")

SAMPLES_KEPT = 4  # examples of an eval batch kept in eval_sample.npz


class StepClock:
    """Seconds per step between two logged steps, minus time spent outside training."""

    def __init__(self, step: int):
        self._time, self._step, self._excluded = time.perf_counter(), step, 0.0

    def exclude(self, seconds: float) -> None:
        self._excluded += seconds

    def lap(self, step: int) -> float:
        now = time.perf_counter()
        seconds = (now - self._time - self._excluded) / max(step - self._step, 1)
        self._time, self._step, self._excluded = now, step, 0.0
        return seconds


class StopSource(Protocol):
    """What the preemption hook asks: a collective "stop now?" and, once yes, why."""

    reason: str | None

    def should_stop(self, step: int) -> bool: ...


class PreemptionHook:
    """Every step, all ranks agree whether to stop (signal, halt file, wall time).

    Asks for a preempted stop (save, exit 75) the first step `source` says so; `stop` keeps
    that request for the hooks that spend a stopping run's grace time on the save only.
    """

    def __init__(self, source: StopSource):
        self.source = source
        self.stop: Stop | None = None

    def __call__(self, info: StepInfo) -> Stop | None:
        if self.stop is None and self.source.should_stop(info.step):
            self.stop = Stop(self.source.reason or "preempted", preempted=True)
        return self.stop


class MetricsHook:
    """metrics.jsonl records (rank 0), the progress bar, and a warning on a non-finite loss."""

    def __init__(self, rt: Runtime, run_dir: Path, events: EventLog, is_main: bool,
                 clock: StepClock):
        self.rt, self.events, self.clock = rt, events, clock
        self.writer = JsonlWriter(run_dir / "metrics.jsonl", enabled=is_main)
        self.batch = rt.cfg.train.batch_size
        self.units = rt.task.tokens_per_example()
        self.progress: Progress | None = None
        self.is_main = is_main

    def start(self, info: StepInfo) -> None:
        cfg = self.rt.cfg
        self.progress = Progress(cfg.train.steps, info.step,
                                 enabled=self.is_main and cfg.run.progress)

    def __call__(self, info: StepInfo) -> None:
        values = info.values
        step_time = self.clock.lap(info.step)
        record = {"step": info.step, "loss": values["loss"], "step_time_s": step_time,
                  "samples_per_s": self.batch / step_time}
        if self.units > 1:
            record["tokens_per_s"] = self.batch * self.units / step_time
        record.update({k: v for k, v in values.items() if k != "loss"})
        if not np.isfinite(record["loss"]):
            self.events.emit("nonfinite_loss", step=info.step, loss=str(record["loss"]))
        self.writer.write(record)
        if self.progress is not None:
            remaining = self.rt.cfg.train.steps - info.step
            self.progress.update(info.step, record["loss"], record["samples_per_s"],
                                 step_time * remaining)

    def close(self, info: StepInfo | None = None) -> None:
        if self.progress is not None:
            self.progress.close()
        self.writer.close()


def evaluate(rt: Runtime, params, sample_path: Path | None) -> dict[str, float]:
    """Mean of the task's eval metrics over the task's eval batches (fixed batches).

    With a sample step, the first batch's sample outputs (first few examples) go to
    `sample_path` (rank 0).
    """
    source = rt.task.eval_source()
    totals: dict[str, float] = {}
    n = rt.task.eval_batches()
    for i in range(n):
        batch = rt.feed.global_batch(source, i)
        metrics = jax.device_get(rt.eval_step(params, batch))
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) / n
        if i == 0 and rt.sample_step is not None:
            sample = jax.device_get(rt.sample_step(params, batch))
            if sample_path is not None:
                np.savez(sample_path, **{k: np.asarray(v)[:SAMPLES_KEPT]
                                         for k, v in sample.items()})
    return totals


class EvalHook:
    """Evaluates at step 0 of a fresh run, every train.eval_every updates and at the end."""

    def __init__(self, rt: Runtime, run_dir: Path, events: EventLog, metrics: MetricsHook,
                 is_main: bool, preemption: PreemptionHook | None = None):
        self.rt, self.events, self.metrics = rt, events, metrics
        self.preemption = preemption
        self.sample_path = run_dir / "eval_sample.npz" if is_main else None

    def _evaluate(self, info: StepInfo) -> None:
        started = time.perf_counter()
        record = {"step": info.step, **evaluate(self.rt, info.state.params, self.sample_path)}
        self.metrics.writer.write(record)
        self.events.emit("evaluated", **record)
        self.metrics.clock.exclude(time.perf_counter() - started)

    def start(self, info: StepInfo) -> None:
        if info.step == 0:
            self._evaluate(info)  # the baseline every later evaluation is compared with

    def __call__(self, info: StepInfo) -> None:
        if not preempted(self.preemption):  # a stopping run spends its grace time on the save
            self._evaluate(info)


class CheckpointHook:
    """Offers every step to the checkpointer (its policy decides); forces a save at the end."""

    def __init__(self, checkpointer) -> None:
        self.checkpointer = checkpointer

    def __call__(self, info: StepInfo) -> None:
        self.checkpointer.maybe_save(info.step, info.state, force=info.final)

    def close(self, info: StepInfo) -> None:
        self.checkpointer.close()


class PlotsHook:
    """Rank 0 draws the generic curves and the task's own figures when training finishes
    (or a hook stopped it cleanly); a preempted run leaves them to the job that finishes."""

    def __init__(self, run_dir: Path, events: EventLog, task: Task,
                 preemption: PreemptionHook | None = None):
        self.run_dir, self.events, self.task = run_dir, events, task
        self.preemption = preemption

    def __call__(self, info: StepInfo) -> None:
        pass

    def close(self, info: StepInfo) -> None:
        if preempted(self.preemption):
            return
        from spmd.rundir.plots import make_plots

        files = make_plots(self.run_dir, self.task)
        self.events.emit("plotted", files=[p.name for p in files])


def preempted(hook: PreemptionHook | None) -> bool:
    """Whether `hook` (the run's preemption hook, if any) has asked to stop."""
    return hook is not None and hook.stop is not None
