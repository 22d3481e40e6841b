"""The `launch:` section: the bounds of start-up, agreement and stopping that the bootstrap,
the preemption watcher, the hang watchdog and `spmd run` read.

It lives here, next to the code that reads it, and imports nothing of spmd (pydantic only),
so `spmd.launch` stays a foundation; `spmd.config` assembles it into the run's `Config`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LaunchConfig(BaseModel):
    """launch: start-up, agreement and stopping of the job's ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    init_timeout_s: float = Field(
        300.0, gt=0, description="Seconds the distributed start-up (jax.distributed) may take.")
    heartbeat_timeout_s: float = Field(
        100.0, gt=0, description="Seconds without a heartbeat from a rank after which the "
        "coordination service declares it dead.")
    barrier_timeout_s: float = Field(
        300.0, gt=0, description="Seconds a barrier among the ranks (the preemption agreement, "
        "the run.dir lease) may wait.")
    walltime_margin_s: float = Field(
        300.0, ge=0, description="Stop (and save) this many seconds before the allocation's "
        "known end time.")
    step_timeout_s: float | None = Field(
        None, ge=0, description="The hang watchdog: a rank whose training step has not "
        "completed for this long dumps every thread's stack, names the ranks that did not "
        "reach the step, and the job exits with status 76 (HUNG). null: automatic, max(600, "
        "20 x the median step time after warm-up); 0: off. Compilation, restore and "
        "checkpoint saves have their own bounds.")
    straggler_factor: float = Field(
        1.3, gt=1, description="A rank whose host-side step time exceeds this factor x the "
        "median over ranks for 3 checks in a row (one check every run.log_every steps) is "
        "named as a straggler.")
    kill_wait_s: float = Field(
        30.0, ge=0, description="`spmd run` on SIGTERM/SIGINT: ranks still running "
        "checkpoint.timeout_s + this many seconds later (a stuck rank never reaches its save) "
        "are killed (Slurm's KillWait).")
    prepare_timeout_s: float = Field(
        7200.0, gt=0, description="Seconds the other ranks wait for rank 0's one-time data "
        "preparation before training (Task.prepare: making a missing data set, an index, "
        "statistics), logging what they wait for every 30 s. The wait is over the key-value "
        "store, before any collective, so it has no other deadline; past this, the job fails "
        "naming the rank. Make the data beforehand (`spmd data make`) to skip the wait.")
