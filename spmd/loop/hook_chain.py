"""The chain of built-in hooks a run gets around the user's own, in the order they run after
each update.

Invariants
- The order is: stragglers' arrival, the profiler (when run.profile asks), preemption (it
  makes a step final, so it comes before everything that saves or evaluates), stragglers'
  departure, the non-finite check (before anything that reads metrics or saves: it stops a
  non-finite run first), metrics and progress, evaluation, the user's hooks, on rank 0 the
  plots, and the checkpoint.
- Hooks close in the same order: rank 0 draws the plots (from metrics.jsonl and the last
  evaluation sample) while the last save is written in the background, and only then waits
  for it (the checkpoint's close). A plot that fails is logged and never costs the save.
- Every rank builds the same chain (the collectives among them run in the same order); only
  the plots differ, and they hold no collective.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from spmd.checkpoint import Checkpointer
from spmd.comm import RankGroup, StopVote
from spmd.config.schema import Config
from spmd.data.loader.nan_probe import nonfinite_in_batches
from spmd.engine.runtime import Runtime
from spmd.launch import HALT_FILE_NAME, LaunchEnv, PreemptionWatcher, job_end_time
from spmd.loop.builtin_hooks import (
    CheckpointHook,
    EvalHook,
    MetricsHook,
    NonfiniteHook,
    PlotsHook,
    PreemptionHook,
)
from spmd.loop.hooks import Hook
from spmd.loop.profiler_hook import ProfilerHook, profiling
from spmd.loop.stragglers import StragglerMonitor
from spmd.rundir.metrics import EventLog

log = logging.getLogger("spmd.loop.trainer")


def hook_chain(cfg: Config, rt: Runtime, env: LaunchEnv, events: EventLog,
               checkpointer: Checkpointer, metrics: MetricsHook,
               user_hooks: list[Hook]) -> list[Hook]:
    """The built-in hooks around the user's, in the order they run after each update."""
    run_dir, is_main = Path(cfg.run.dir), env.rank == 0
    # What this rank sees (signals, the halt file, the deadline), agreed among all ranks.
    watcher = PreemptionWatcher.install(halt_file=run_dir / HALT_FILE_NAME, env=env)
    stop_vote = StopVote(watcher, RankGroup(env, cfg.launch.barrier_timeout_s,
                                            "launch.barrier_timeout_s", "preempt"))
    end_time = job_end_time(env, os.environ)
    if end_time is not None:
        stop_vote.deadline = end_time - cfg.launch.walltime_margin_s
        log.info("allocation ends at %s; stopping %ss before", time.ctime(end_time),
                 cfg.launch.walltime_margin_s)
    preemption = PreemptionHook(stop_vote)
    # Host-side step time per rank: from leaving one step's preemption vote (a collective,
    # so all ranks leave it together) to arriving at the next step's hooks.
    stragglers = StragglerMonitor(
        RankGroup(env, cfg.launch.barrier_timeout_s, "launch.barrier_timeout_s",
                  "stragglers") if env.size > 1 else None,
        env.rank, socket.gethostname(), cfg.run.log_every, cfg.launch.straggler_factor,
        events, is_main)
    metrics.fields_of.append(stragglers.fields)
    hooks = [Hook(stragglers.arrive, 1, "stragglers")]
    if profiling(cfg.run.profile, env.rank):  # the trace stops right after an update
        hooks.append(Hook(ProfilerHook(cfg.run.profile, run_dir, env.rank, events), 1,
                          "profiler"))
    # before any hook that reads metrics or saves: it stops a non-finite run first
    nonfinite = NonfiniteHook(cfg.train, (cfg.run.log_every, cfg.checkpoint.every,
                                          cfg.checkpoint.persistent_every), events,
                              data_probe=lambda lo, hi: nonfinite_in_batches(
                                  rt.task.train_source(), range(lo, hi),
                                  cfg.train.batch_size))
    hooks += [Hook(preemption, 1, "preemption"),
              Hook(stragglers.depart, 1, "stragglers-depart"),
              Hook(nonfinite, 1, "nonfinite"), Hook(metrics, cfg.run.log_every, "metrics"),
              Hook(metrics.advance, 1, "progress")]
    if rt.eval_step is not None and cfg.train.eval_every:
        hooks.append(Hook(EvalHook(rt, run_dir, events, metrics, is_main, preemption),
                          cfg.train.eval_every, "evaluation"))
    hooks += user_hooks
    if is_main and cfg.run.plots:   # drawn at close, while the last save is written
        hooks.append(Hook(PlotsHook(run_dir, events, rt.task, preemption),
                          max(cfg.train.steps, 1), "plots"))
    hooks.append(Hook(CheckpointHook(checkpointer, preemption, nonfinite), 1, "checkpoint"))
    return hooks
