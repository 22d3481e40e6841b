"""The built-in hooks: preemption, metrics, evaluation, checkpointing, plots.

They use the same `Trainer.add_hook` mechanism as a user's hooks; the trainer adds them
in this order, so a preemption decided at a step makes that step final for the others
(metrics are logged, a checkpoint is forced). Evaluation time is not counted as step time.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import numpy as np

from spmd.engine.runtime import Runtime
from spmd.errors import ExitCode
from spmd.launch import PreemptionWatcher
from spmd.rundir.metrics import EventLog, JsonlWriter, Progress
from spmd.train.hooks import StepInfo

log = logging.getLogger("spmd.train.trainer")

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


class PreemptionHook:
    """Every step, all ranks agree whether to stop (signal, halt file, wall time)."""

    def __init__(self, watcher: PreemptionWatcher):
        self.watcher = watcher

    def __call__(self, info: StepInfo) -> None:
        if self.watcher.should_stop(info.step):
            info.final, info.stop_reason = True, self.watcher.reason or "preempted"
            info.trainer.exit_code = ExitCode.PREEMPTED


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
                 is_main: bool):
        self.rt, self.events, self.metrics = rt, events, metrics
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
        if info.stop_reason is None:  # a stopping run spends its grace time on the save
            self._evaluate(info)


class CheckpointHook:
    """Offers every step to the checkpointer (its policy decides); forces a save at the end."""

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def __call__(self, info: StepInfo) -> None:
        self.checkpointer.maybe_save(info.step, info.state, force=info.final)

    def close(self, info: StepInfo) -> None:
        self.checkpointer.close()


class PlotsHook:
    """Rank 0 draws the generic curves and the task's own figures when training finishes."""

    def __init__(self, run_dir: Path, events: EventLog):
        self.run_dir, self.events = run_dir, events

    def __call__(self, info: StepInfo) -> None:
        pass

    def close(self, info: StepInfo) -> None:
        if info.stop_reason is not None:
            return
        from spmd.rundir.plots import make_plots

        files = make_plots(self.run_dir, info.runtime.task)
        self.events.emit("plotted", files=[p.name for p in files])
