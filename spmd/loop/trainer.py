"""The training loop: one rank's view of a run, from bootstrap to the last save.

`Trainer(cfg).run()` bootstraps this rank, checks what the config asks of the devices before
anything is written in run.dir (`check`: a rejected run leaves run.dir as it was), restores
the newest committed checkpoint (or initializes), then loops: one jitted update, then the
hooks that are due. Everything between updates (preemption, metrics, evaluation,
checkpoints, plots, a user's own) is a hook added with `add_hook(fn, every=N)`; see
spmd.loop.hooks for the calling convention.
A hook stops the run by returning a `Stop`; the trainer alone turns that into the exit
status (spmd.errors.ExitCode) and the `stopped` or `preempted` event.
Preemption is watched from bootstrap on: before the first step (preparing, restoring,
compiling) a signal ends every rank at once with status 75, there being nothing new to save
(spmd.loop.early_stop); from the first step on, the preemption hook's vote saves and stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import psutil
from jax.sharding import Mesh

from spmd.checkpoint import Checkpointer, create_checkpointer
from spmd.comm.hang_watchdog import StepWatchdog, publish_host
from spmd.comm.host_gather import sync_devices
from spmd.comm.job_failure import FailureWatch
from spmd.comm.prepare_wait import prepare_on_rank0
from spmd.config.load import build_task
from spmd.config.schema import Config
from spmd.data.stats.run_inputs import check_run_inputs
from spmd.engine.executables import shared_store
from spmd.engine.mesh import build_mesh
from spmd.engine.runtime import CheckedRules, Runtime, build_runtime, check_rules
from spmd.errors import ExitCode
from spmd.launch import (
    LaunchEnv,
    PreemptionWatcher,
    bootstrap,
    shutdown,
)
from spmd.loop.builtin_hooks import (
    MetricsHook,
    StepClock,
)
from spmd.loop.early_stop import EarlyStop
from spmd.loop.failure_report import record_hang, report_failure
from spmd.loop.hook_chain import hook_chain
from spmd.loop.hooks import Hook, HookFn, StepInfo, Stop
from spmd.loop.recipe import fill_missing, keep_data_order, previous_recipe, restore_state
from spmd.rundir.console import phase_done
from spmd.rundir.lease import RunLease
from spmd.rundir.metrics import EventLog, drop_records_after, setup_logging
from spmd.tasks import Task

log = logging.getLogger("spmd.loop.trainer")


class Stopped(NamedTuple):
    """A stop the trainer collected at a step: the hook that asked, and its request."""

    hook: str
    request: Stop


class Checked(NamedTuple):
    """What `Trainer.check` built before run.dir was touched: the task, the mesh and the
    checked rules (`build_runtime` does not check them again)."""

    task: Task
    mesh: Mesh
    rules: CheckedRules


@dataclass
class _Opened:
    """What a run has opened so far, for its error path and its clean-up: the run.dir
    lease, the event log, and whether this rank logs to its file in run.dir yet."""

    lease: RunLease | None = None
    events: EventLog | None = None
    log_file: bool = False


class Trainer:
    """Trains `cfg` (its task, or `task`) on every device of every rank of the job."""

    def __init__(self, cfg: Config, task: Task | None = None):
        self.cfg = cfg
        self.task = task
        self.exit_code: int = ExitCode.OK  # set by `fit` from how the run ended
        self._user_hooks: list[Hook] = []
        self._hang: StepWatchdog | None = None  # armed by `fit` for its loop
        self._checked: Checked | None = None    # `check`'s task and mesh, for `build`
        self._early: EarlyStop | None = None    # a signal before the first step: exit 75

    def add_hook(self, fn: HookFn, *, every: int = 1, name: str = "") -> Hook:
        """Call `fn(StepInfo)` after every `every`-th update and at the run's last step.

        `fn` may return a `Stop` to end the run after this step (spmd.loop.hooks).
        """
        hook = Hook(fn, every, name)
        self._user_hooks.append(hook)
        return hook

    # ------------------------------------------------------------------ whole run

    def run(self, debug: bool = False) -> int:
        """Bootstrap this rank, train, shut the distributed runtime down; the exit status."""
        # The job's start for `spmd report`: this process's start (imports count as bootstrap).
        started = (psutil.Process().create_time(), time.time())
        launch = self.cfg.launch
        env = bootstrap(init_timeout_s=launch.init_timeout_s,
                        heartbeat_timeout_s=launch.heartbeat_timeout_s,
                        watch_preemption=True)
        early = self._early = EarlyStop(PreemptionWatcher.install(env=env), env)
        # another rank's error (or early stop) ends this one at once
        failures = FailureWatch(env, on_failure=early.before_end).start()
        early.start()
        publish_host(env)  # a hang report names the host of a rank that cannot answer
        opened, failed = _Opened(), False
        try:
            order_note = self._keep_data_order()
            # A run rejected for its config leaves run.dir as it was (or absent): checked first.
            self._checked = self.check(env)
            return self.fit(env, self._open_run_dir(env, opened, debug, order_note, started))
        except SystemExit:  # a status every rank agreed on (a refused lease): no failure
            early.disarm()   # decided: a signal from here on (Hydra's SIGUSR1 as the other
            raise            # ranks close) must not turn it into a preemption
        except BaseException as e:
            early.disarm()   # the status is this error's, whatever signal comes while ending
            failed = True
            report_failure(env, e, opened.events, logs_to_file=opened.log_file)
            raise
        finally:
            self._close_run(env, failures, opened, failed)

    def _keep_data_order(self) -> tuple[int, str] | None:
        """The run's own data order where the config leaves it unset (spmd.loop.recipe):
        `self.cfg` becomes the settled config, and the task is rebuilt on it. A line for the
        log, or None."""
        settled, note = keep_data_order(self.cfg, Path(self.cfg.run.dir))
        if settled is not self.cfg:
            self.cfg = settled
            if self.task is not None:
                self.task = type(self.task)(settled)
        return note

    def _open_run_dir(self, env: LaunchEnv, opened: _Opened, debug: bool,
                      order_note: tuple[int, str] | None,
                      started: tuple[float, float]) -> EventLog:
        """One writer per run.dir: rank 0 leases it before anything is written there (refused:
        every rank exits 2); then this rank's log file and the event log, returned. `opened`
        holds each as soon as it is open, for the error path and the clean-up."""
        cfg, early = self.cfg, self._early
        assert early is not None
        run_dir = Path(cfg.run.dir)
        lease = opened.lease = RunLease.acquire(run_dir, env, cfg.run.lease_stale_s,
                                                cfg.launch.barrier_timeout_s)
        early.on_end.append(lease.release)
        run_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(run_dir, env.rank, debug, cfg.run.log_level)
        opened.log_file = True
        if order_note is not None and env.rank == 0:
            log.log(*order_note)
        if cfg.run.compilation_cache is not None:
            use_compilation_cache(cfg.run.compilation_cache)
        events = opened.events = EventLog(run_dir / "events.jsonl", env.rank)
        early.events = events  # a stop before the first step records `preempted`
        process_start, run_start = started
        events.emit("started", launcher=env.launcher, size=env.size, node=env.node_id,
                    restart_count=env.restart_count, job_id=env.job_id, task=cfg.task,
                    nodes=env.num_nodes, process_start=round(process_start, 3),
                    run_start=round(run_start, 3),
                    chain=os.environ.get("SPMD_CHAIN") or None)  # spmd report: queue
        lease.start(events)  # logs the acquisition or take-over; heartbeat while training
        return events

    def _close_run(self, env: LaunchEnv, failures: FailureWatch, opened: _Opened,
                   failed: bool) -> None:
        early = self._early
        assert early is not None
        if env.size > 1 and not failed:
            # jax.distributed.shutdown, after disarming the peer watchdog: a barrier of all
            # ranks, which a failed job skips (the CLI ends the failed rank at once); a
            # failure announced meanwhile still ends this rank (FailureWatch)
            shutdown()
        failures.stop(wait=not failed)
        early.disarm()
        early.watcher.reset()  # a later run in this process starts without this signal
        if opened.lease is not None:
            opened.lease.release()  # finished, preempted (75) or failed: every rank is done
        if opened.events is not None:
            opened.events.close()

    def check(self, env: LaunchEnv) -> Checked:
        """What can be checked before anything is read or written in run.dir, raising the
        error that names the config key: the task resolves, `mesh.axes` fits the devices,
        the rule table (`mesh.rules`, the task's own rules, `mesh.axis_aliases`), the
        pipeline and gradient-accumulation settings against the mesh. A run rejected here
        leaves run.dir untouched, or not created (the lease, the logs and the events come
        after). What needs the task's data or the model (`build`) is checked after."""
        cfg = self.cfg
        task = self.task or build_task(cfg)
        mesh = build_mesh(cfg.mesh, jax.devices(), env.node_of_rank)
        return Checked(task, mesh, check_rules(cfg.engine_sections(), task, mesh))

    def build(self, env: LaunchEnv) -> Runtime:
        """The task's one-time preparation (rank 0), then every sharding and jitted step."""
        checked = self._checked or self.check(env)
        task = checked.task
        # rank 0 first, the others waiting over the key-value store (no collective yet: the
        # first one, below, would give up after Gloo's fixed 30 s), bounded by
        # launch.prepare_timeout_s and saying what they wait for
        began = time.perf_counter()
        self._phase("the data's preparation (Task.prepare)")
        prepare_on_rank0(env, task.prepare, self.cfg.launch.prepare_timeout_s)
        self._phase("the model's set-up")
        if env.size > 1:
            sync_devices("spmd:task-prepared")   # no part left running if the run ends here
        phase_done("data", time.perf_counter() - began, "prepared (Task.prepare)")
        began = time.perf_counter()
        rt = build_runtime(self.cfg.engine_sections(), checked.mesh, task, checked.rules)
        phase_done("model", time.perf_counter() - began, "shardings and jitted steps")
        shape = {k: v for k, v in rt.mesh.shape.items() if v > 1}
        log.info("task %s; mesh %s over %d devices, %d processes; params %s B total, %s B "
                 "per device", self.cfg.task, shape or "(all axes 1)", rt.mesh.size, env.size,
                 f"{rt.model.report.total_bytes:,}", f"{rt.model.report.bytes_per_device:,}")
        return rt

    def fit(self, env: LaunchEnv, events: EventLog) -> int:
        """Train on an initialized JAX runtime; returns the process exit status."""
        cfg, run_dir, is_main = self.cfg, Path(self.cfg.run.dir), env.rank == 0
        # the previous job's recipe: every rank reads config.yaml before build's barrier
        # (rank 0 rewrites it after the restore)
        previous = previous_recipe(run_dir)
        rt = self.build(env)
        # run.keep_executables: where this rank's compiled programs are kept and loaded from
        # (the run's store: the train step; the shared one beside JAX's cache: both)
        store, shared = ((run_dir / "executables", shared_store())
                         if cfg.run.keep_executables else (None, None))
        began = time.perf_counter()
        self._phase("the restore")
        checkpointer = create_checkpointer(cfg.checkpoint, run_dir=run_dir, env=env, events=events)
        restored = restore_state(rt, checkpointer, previous, run_dir, events,
                                 cfg.checkpoint.params_only)
        # the data the run began with, or one line naming the file that changed
        check_run_inputs(cfg.data, run_dir, restored.step if restored else None, is_main)
        if is_main:  # only a config that builds (task, mesh, shardings) and restores (the
            # recipe may change: spmd.loop.recipe) replaces the run's
            with self._held():
                (run_dir / "config.yaml").write_text(cfg.to_yaml())
        if restored is not None:
            state, start = fill_missing(rt, restored), restored.step
            events.emit("restored", step=start, source=restored.source, detail=restored.detail,
                        **{k: round(v, 4) for k, v in restored.timings.items()},
                        seconds=round(time.perf_counter() - began, 4))
        else:
            state, start = rt.init(shared), 0
            events.emit("initialized", step=0, seconds=round(time.perf_counter() - began, 4))
        if restored is not None and start >= cfg.train.steps:  # a rerun of a finished run
            return self._already_finished(start, is_main, events, checkpointer)

        if is_main and restored is not None:  # steps after the restored one were lost
            with self._held():
                replayed = drop_records_after(run_dir / "metrics.jsonl", start)
            if replayed:
                log.info("moved %d metrics records of steps after the restored step %d (they "
                         "are trained again) to metrics.replayed.jsonl", replayed, start)
        clock = StepClock(start)
        self._hang = StepWatchdog(env, cfg.launch.step_timeout_s,
                                  on_hang=lambda report: record_hang(run_dir, events, report))
        metrics = MetricsHook(rt, run_dir, events, is_main, clock, cfg)
        hooks = hook_chain(self.cfg, rt, env, events, checkpointer, metrics,
                           self._user_hooks)
        info = StepInfo(step=start, state=state, metrics={}, final=start >= cfg.train.steps)
        stopped: Stopped | None = None
        try:
            for hook in hooks:
                hook.start(info)
            self._phase("the compilation")
            compiled, seconds, how = rt.load_or_compile_train_step(store, env.rank, shared)
            events.emit("compiled", seconds=round(seconds, 3), how=how)
            if self._early is not None:  # training starts: a signal now is the vote's
                self._early.disarm()
            clock.lap(start)  # compile time is not step time
            self._hang.start(start)
            info, stopped = self._loop(compiled, rt, info, hooks)
        except BaseException:
            metrics.close()
            raise
        finally:
            self._hang.stop()  # the last saves below have their own bounds
        closing = {}
        for hook in hooks:
            began = time.perf_counter()
            hook.close(info)
            closing[hook.name] = round(time.perf_counter() - began, 4)
        events.emit("closed", seconds=closing)  # the last save's wait, for `spmd report`
        self.exit_code = self._end(info.step, stopped, events)
        return self.exit_code

    def _loop(self, compiled: Callable, rt: Runtime, info: StepInfo,
              hooks: list[Hook]) -> tuple[StepInfo, Stopped | None]:
        """Updates from `info.step` to train.steps, or until a hook stops the run: the last
        step's info (`info` itself when no update was left) and the stop, if any."""
        source, total, state = rt.task.train_source(), self.cfg.train.steps, info.state
        order = getattr(source, "index", None)      # on-disk sources: the record order
        if jax.process_index() == 0 and hasattr(order, "describe"):
            log.info("train data order: %s", order.describe())
        for step in range(info.step, total):
            state, metrics = compiled(state, rt.feed.global_batch(source, step))
            # the time this step waited for its batch (host read, or the background read)
            metrics = {**metrics, "input_wait_s": rt.feed.last_wait_s}
            info = StepInfo(step=step + 1, state=state, metrics=metrics, final=step + 1 == total)
            info, stopped = self._after_update(info, hooks)
            if self._hang is not None:
                self._hang.beat(step + 1)
            if stopped is not None:
                return info, stopped
        return info, None

    def _after_update(self, info: StepInfo,
                      hooks: list[Hook]) -> tuple[StepInfo, Stopped | None]:
        """The due hooks, in order. The first stop request makes the step final for the
        hooks after it; a later request at the same step is logged and ignored. A save has
        its own bounds (checkpoint.timeout_s), so the hang watchdog excuses it."""
        stopped: Stopped | None = None
        for hook in hooks:
            if not hook.due(info):
                continue
            timed = self._hang is None or hook.name not in OWN_BOUNDS
            with contextlib.nullcontext() if timed else self._hang.excused():
                request = hook(info)
            if request is None:
                continue
            if stopped is None:
                stopped, info = Stopped(hook.name, request), info.as_final()
            else:
                log.info("hook %s also asked to stop at step %d (%s); %s's stop stands",
                         hook.name, info.step, request.reason, stopped.hook)
        return info, stopped

    def _already_finished(self, step: int, is_main: bool, events: EventLog,
                          checkpointer: Checkpointer) -> int:
        """The restored step is train.steps or past it: nothing to train, so nothing is
        compiled; says so, records the end for `spmd report`, exits OK (every rank restored
        the same step, so all return here together)."""
        total = self.cfg.train.steps
        if self._early is not None:  # finished: a signal now changes nothing (status 0)
            self._early.disarm()
        if is_main:
            state = (f"already finished at step {step} (train.steps={total})" if step == total
                     else f"is already at step {step}, past train.steps={total}")
            log.warning("run.dir %s %s: nothing to do; raise train.steps to train further",
                        self.cfg.run.dir, state)
        checkpointer.close()
        events.emit("finished", step=step, reason="nothing to do: train.steps reached before")
        self.exit_code = ExitCode.OK
        return self.exit_code

    def _phase(self, what: str) -> None:
        """What this rank does now, for the line of a stop before the first step."""
        if self._early is not None:
            self._early.phase = what

    def _held(self) -> contextlib.AbstractContextManager:
        """A local write a stop before the first step waits for (spmd.loop.early_stop)."""
        return self._early.held() if self._early is not None else contextlib.nullcontext()

    @staticmethod
    def _end(step: int, stopped: Stopped | None, events: EventLog) -> int:
        """The exit status for how the run ended, and its last event: the one place a stop
        becomes a status (spmd.errors.ExitCode)."""
        if stopped is None:
            events.emit("finished", step=step)
            return ExitCode.OK
        hook, request = stopped
        if request.exit_code is not None and request.exit_code != ExitCode.OK:
            events.emit("stopped", step=step, hook=hook, reason=request.reason,
                        exit_code=int(request.exit_code))
            return int(request.exit_code)
        if request.preempted:
            events.emit("preempted", step=step, reason=request.reason,
                        exit_code=ExitCode.PREEMPTED)
            return ExitCode.PREEMPTED
        log.info("hook %s stopped the run at step %d: %s", hook, step, request.reason)
        events.emit("stopped", step=step, hook=hook, reason=request.reason,
                    exit_code=ExitCode.OK)
        return ExitCode.OK


OWN_BOUNDS = frozenset({"checkpoint", "profiler"})  # hooks the hang watchdog does not time


def use_compilation_cache(path: Path) -> None:
    """Point JAX's persistent compilation cache at `path` (run.compilation_cache)."""
    path = Path(path).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    log.info("compilation cache %s", path)
