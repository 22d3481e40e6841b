"""The built-in hooks: preemption, non-finite values, metrics, evaluation, checkpointing, plots.

They use the same `Hook` protocol as a user's hooks (spmd.loop.hooks): the preemption hook
stops the run by returning a `Stop`, as a user's hook would, and the trainer, not the hook,
turns it into the exit status. Each hook is given what it needs when it is built (the
runtime, the run directory, the event log, the preemption hook whose stop a final
evaluation and the plots skip); none reads or writes another's state through `StepInfo`.
Evaluation time is not counted as step time. Every metrics record (train and eval) goes
through `MetricsHook.record`: metrics.jsonl, and on rank 0 the trackers of `run.trackers`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from spmd.config.schema import Config
from spmd.engine.engine_config import TrainConfig
from spmd.engine.runtime import Runtime
from spmd.engine.state import learning_rate
from spmd.errors import ExitCode
from spmd.loop.hooks import StepInfo, Stop
from spmd.loop.split_eval import evaluate
from spmd.loop.throughput import FlopRate
from spmd.rundir.console import Progress, phase_done
from spmd.rundir.metrics import EventLog, JsonlWriter
from spmd.rundir.trackers import Tracker, create_trackers, scalars_of
from spmd.tasks import Task

log = logging.getLogger("spmd.loop.trainer")



class StepClock:
    """Seconds per step between two logged steps, minus time spent outside training.

    `began`: when training began (the first `lap`, which the trainer takes after compiling).
    """

    def __init__(self, step: int):
        self._time, self._step, self._excluded = time.perf_counter(), step, 0.0
        self.began: float | None = None

    def exclude(self, seconds: float) -> None:
        self._excluded += seconds

    def lap(self, step: int) -> float:
        now = time.perf_counter()
        if self.began is None:
            self.began = now
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
    """metrics.jsonl records and the trackers (rank 0), the progress bar, and a warning on a
    non-finite loss. A train record has the step, its wall-clock `time`, the loss, the
    learning rate the step used (`lr`), step time, throughput, model FLOP/s and MFU where
    the task gives FLOPs (spmd.loop.throughput), and the step's own metrics."""

    def __init__(self, rt: Runtime, run_dir: Path, events: EventLog, is_main: bool,
                 clock: StepClock, config: Config | None = None):
        # config: the run's, for run.progress, run.trackers and what trackers record (None:
        # no progress line, no trackers)
        self.rt, self.events, self.clock, self.config = rt, events, clock, config
        self.run_dir = run_dir
        self.writer = JsonlWriter(run_dir / "metrics.jsonl", enabled=is_main)
        self.batch = rt.sections.train.batch_size
        self.units = rt.task.tokens_per_example()
        # the optimizer's own definition, jitted: called eagerly, each of its jnp operations
        # compiles a program of its own in every new process (7 for a cosine schedule)
        self.schedule = jax.jit(learning_rate(rt.sections))
        self.host = jax.devices("cpu")[0]   # the schedule is evaluated here, not on a GPU
        self.flop_rate = FlopRate.create(rt.task.flops_per_example(), self.batch,
                                         rt.mesh.size, rt.mesh.devices.flat[0].device_kind)
        self.progress: Progress | None = None
        self.trackers: list[Tracker] = []
        self.is_main = is_main
        # more fields of a step's train record (the straggler monitor's, at its checks)
        self.fields_of: list[Callable[[int], dict]] = []

    def start(self, info: StepInfo) -> None:
        cfg = self.config
        self.progress = Progress(self.rt.sections.train.steps, info.step,
                                 enabled=self.is_main and cfg is not None and cfg.run.progress)
        if self.is_main and cfg is not None and cfg.run.trackers:
            self.trackers = create_trackers(cfg.run.trackers, self.run_dir,
                                            cfg.model_dump(mode="json", by_alias=True),
                                            cfg.to_yaml())

    def record(self, record: dict) -> None:
        """One metrics record (train or eval): metrics.jsonl, then every tracker."""
        self.writer.write(record)
        if self.trackers:
            scalars = scalars_of(record)
            for tracker in self.trackers:
                tracker.log(scalars, int(record["step"]))

    def learning_rate(self, step: int) -> float:
        """The learning rate of the update that made `step` (optax counts from 0)."""
        with jax.default_device(self.host):
            return float(self.schedule(max(step - 1, 0)))

    def __call__(self, info: StepInfo) -> None:
        values = info.values
        step_time = self.clock.lap(info.step)
        record = {"step": info.step, "time": time.time(), "loss": values["loss"],
                  "step_time_s": step_time, "samples_per_s": self.batch / step_time}
        if self.units > 1:
            record["tokens_per_s"] = self.batch * self.units / step_time
        if self.flop_rate is not None:
            record.update(self.flop_rate.of(step_time))
        if self.is_main:
            record["lr"] = self.learning_rate(info.step)
        record.update({k: v for k, v in values.items() if k != "loss"})
        for fields in self.fields_of:
            record.update(fields(info.step))
        if not np.isfinite(record["loss"]):
            self.events.emit("nonfinite_loss", step=info.step, loss=str(record["loss"]))
        self.record(record)
        if self.progress is not None:
            remaining = self.rt.sections.train.steps - info.step
            self.progress.update(info.step, record["loss"], record["samples_per_s"],
                                 step_time * remaining)

    def advance(self, info: StepInfo) -> None:
        """Every step (the `progress` hook): the progress bar's count, with no device sync."""
        if self.progress is not None:
            self.progress.advance(info.step)

    def close(self, info: StepInfo | None = None) -> None:
        if self.progress is not None:
            self.progress.close()
            steps = info.step - self.progress.start if info is not None else 0
            if self.is_main and steps > 0 and self.clock.began is not None:
                seconds = time.perf_counter() - self.clock.began
                phase_done("training", seconds, f"steps {self.progress.start} -> {info.step}, "
                           f"{steps / max(seconds, 1e-9):.2f} steps/s")
        self.writer.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


class EvalHook:
    """Evaluates at step 0 of a fresh run, every train.eval_every updates and at the end;
    with the EMA of the parameters when train.eval_ema is set (`Runtime.eval_params`)."""

    def __init__(self, rt: Runtime, run_dir: Path, events: EventLog, metrics: MetricsHook,
                 is_main: bool, preemption: PreemptionHook | None = None):
        self.rt, self.events, self.metrics = rt, events, metrics
        self.preemption = preemption
        self.sample_path = run_dir / "eval_sample.npz" if is_main else None

    def _evaluate(self, info: StepInfo) -> None:
        started = time.perf_counter()
        params = self.rt.eval_params(info.state)   # the EMA's with train.eval_ema
        # data.eval_batches whole batches at most (quick, during training; `spmd eval` scores
        # the whole split), every window once
        record = {"step": info.step, **evaluate(self.rt, params, self.sample_path,
                                                max_batches=self.rt.task.eval_batches())}
        self.metrics.record(record)
        seconds = time.perf_counter() - started
        self.events.emit("evaluated", **record, seconds=round(seconds, 4))  # spmd report
        self.metrics.clock.exclude(seconds)

    def start(self, info: StepInfo) -> None:
        if info.step == 0:
            self._evaluate(info)  # the baseline every later evaluation is compared with

    def __call__(self, info: StepInfo) -> None:
        if not preempted(self.preemption):  # a stopping run spends its grace time on the save
            self._evaluate(info)


class NonfiniteHook:
    """Ends the run on a non-finite loss or gradient norm before that state can be saved.

    It reads the step's metrics only where they are read anyway or where a checkpoint may be
    taken: logged steps, the checkpoint periods and the last step (`check_every`), so it adds
    no host synchronization in between. `train.nonfinite: stop`: the first non-finite step
    seen ends the run; `skip`: the optimizer left such steps out (spmd.engine.state) and the
    run ends after `train.max_skips` of them in a row. Either way with ExitCode.NONFINITE,
    and the checkpoint hook saves nothing of the stopping step.

    With `skip`, every step folds its `skips_in_a_row` into the longest streak since the last
    check, on device (`_longer`, dispatched without waiting), so a streak that reached
    `max_skips` and ended between two checks still stops the run at the next check.
    """

    def __init__(self, train: TrainConfig, check_every: tuple[int, ...], events: EventLog,
                 data_probe: Callable[[int, int], str | None] | None = None):
        self.mode, self.max_skips = train.nonfinite, train.max_skips
        self.data_probe = data_probe    # (first, last step) -> a NaN in their batches, or None
        self.check_every = tuple(n for n in check_every if n > 0)
        self.events = events
        self.checked = 0                # the last step whose metrics were read
        self.longest: jax.Array | None = None   # skip: the longest streak since `checked`
        self.stop: Stop | None = None

    def start(self, info: StepInfo) -> None:
        self.checked = info.step

    def __call__(self, info: StepInfo) -> Stop | None:
        streak = info.metrics.get("skips_in_a_row") if self.mode == "skip" else None
        if streak is not None:
            self.longest = streak if self.longest is None else _longer(self.longest, streak)
        if not (info.final or any(info.step % n == 0 for n in self.check_every)):
            return None
        since, self.checked = self.checked, info.step
        values = info.values
        if self.mode == "skip":
            in_a_row = int(values.get("skips_in_a_row", 0))
            longest = max(in_a_row, int(jax.device_get(self.longest))
                          if self.longest is not None else 0)
            self.longest = None
            if longest < self.max_skips:
                return None
            within = "" if in_a_row == longest else f" within steps {since + 1}..{info.step}"
            why = (f"{longest} steps in a row{within} had a non-finite loss or gradient norm "
                   f"and were skipped (train.max_skips={self.max_skips})")
        else:
            if not values.get("nonfinite"):
                return None
            when = (f"step {info.step}" if since == info.step - 1
                    else f"a step in {since + 1}..{info.step}")
            why = f"non-finite loss or gradient norm at {when} (train.nonfinite=stop)"
        remedy = (f"raise train.max_skips above {self.max_skips}" if self.mode == "skip"
                  else "set train.nonfinite=skip")
        found = self.data_probe(since, info.step) if self.data_probe is not None else None
        advice = (f"{found}: the data hold it, and lowering optimizer.lr will not help; fix "
                  f"the files (`spmd data stats CONFIG` counts missing values; gridded "
                  f"data.variables take data.nan: mask or fill) or {remedy}"
                  if found else f"lower optimizer.lr (or {remedy}) and run again")
        reason = (f"{why}: at step {info.step} loss {values['loss']}, grad_norm "
                  f"{values['grad_norm']}; nothing of it was saved, the newest checkpoint is "
                  f"finite: {advice}")
        log.error("stopping: %s", reason)
        self.events.emit("nonfinite_stop", step=info.step, mode=self.mode,
                         loss=str(values["loss"]), grad_norm=str(values["grad_norm"]))
        self.stop = Stop(reason, exit_code=ExitCode.NONFINITE)
        return self.stop


_longer = jax.jit(jnp.maximum)   # two streaks' longer, on device (NonfiniteHook)


class CheckpointHook:
    """Offers every step to the checkpointer (its policy decides); forces a save at the
    last step, and tells the checkpointer whether the run ends there (checkpoint.final) or
    is preempted. Nothing is saved of a step whose state `nonfinite` found non-finite."""

    def __init__(self, checkpointer, preemption: PreemptionHook | None = None,
                 nonfinite: NonfiniteHook | None = None) -> None:
        self.checkpointer = checkpointer
        self.preemption = preemption
        self.nonfinite = nonfinite

    def __call__(self, info: StepInfo) -> None:
        if self.nonfinite is not None and self.nonfinite.stop is not None:
            return
        self.checkpointer.maybe_save(info.step, info.state, force=info.final,
                                     finished=info.final and not preempted(self.preemption))

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

        try:
            files = make_plots(self.run_dir, self.task)
        except Exception as e:   # a figure is never worth the last checkpoint, closed next
            log.warning("plots in %s failed, training is unaffected: %s: %s (redraw them "
                        "with `spmd plot %s`)", self.run_dir / "plots", type(e).__name__, e,
                        self.run_dir)
            return
        self.events.emit("plotted", files=[p.name for p in files])


def preempted(hook: PreemptionHook | None) -> bool:
    """Whether `hook` (the run's preemption hook, if any) has asked to stop."""
    return hook is not None and hook.stop is not None
