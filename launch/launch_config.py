"""The `launch:` section: the bounds of start-up, agreement and stopping that the bootstrap,
the preemption watcher, the hang watchdog and `spmd run` read, and the recovery inside the
allocation that a job script's supervisor follows (spmd.launch.supervisor, docs/recovery.md).

It lives here, next to the code that reads it, and imports nothing of spmd (pydantic only),
so `spmd.launch` stays a foundation; `spmd.config` assembles it into the run's `Config`.
"""

from __future__ import annotations

from typing import Literal

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
    malloc_huge_pages: bool = Field(
        True, description="`spmd run` starts each rank with glibc's malloc asking for "
        "transparent huge pages for its blocks (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, glibc "
        "2.35+): XLA's CPU runtime allocates each step's temporary buffer afresh, and the "
        "kernel then faults it in 2 MiB at a time, not 4 KiB (the README's main job: 190 -> "
        "150 s of CPU). A GLIBC_TUNABLES of yours that sets glibc.malloc.hugetlb stays as it "
        "is. false: malloc as glibc sets it up.")
    prepare_timeout_s: float = Field(
        7200.0, gt=0, description="Seconds the other ranks wait for rank 0's one-time data "
        "preparation before training (Task.prepare: making a missing data set, an index, "
        "statistics), logging what they wait for every 30 s. The wait is over the key-value "
        "store, before any collective, so it has no other deadline; past this, the job fails "
        "naming the rank. Make the data beforehand (`spmd data make`) to skip the wait.")
    spare_nodes: int = Field(
        0, ge=0, description="Recovery inside the allocation: the job script (`spmd "
        "jobscript`, or its --spare-nodes) asks for this many nodes more than it trains on; "
        "when a node fails, the ranks are started again on the survivors plus a spare, in the "
        "same job (no requeue). See docs/recovery.md.")
    elastic: Literal["requeue", "shrink"] = Field(
        "requeue", description="When a node failed and no spare is left: requeue (end the "
        "job and requeue it, as without spares) or shrink (start again at once on the "
        "nodes left; the global batch stays train.batch_size over fewer data-parallel ways, "
        "and a batch that does not divide ends the shrunk try with that error, then "
        "requeues).")
    max_restarts: int | None = Field(
        None, ge=0, description="How many times the job script's supervisor starts the "
        "ranks again inside one allocation (after a lost node, a killed rank or a hang). "
        "null: launch.spare_nodes + 1 when spares or elastic=shrink are asked for, else 0; "
        "0: no restart inside the job (a failure ends it: requeue or its error, as always).")
    node_timeout_s: float = Field(
        2.0, ge=0, description="Recovery inside the allocation: every rank sends the job "
        "script's supervisor a liveness beat twice a second; a node none of whose running "
        "ranks has beaten for this long, while the other nodes' ranks beat, is lost, and the "
        "ranks start again without it at once (a slow rank still beats: a straggler is never "
        "removed). 0: no beats; a lost node is then seen from srun and the scheduler only, "
        "in tens of seconds.")
    retry_errors: bool = Field(
        False, description="Also start again after a Python exception on a healthy node "
        "(a passing file-system error), within launch.max_restarts; the same error twice in "
        "a row is never retried. Off: an error in the code or data ends the job with it, "
        "whatever launch.max_restarts says.")

    def restarts(self) -> int:
        """launch.max_restarts, with null resolved (see its description)."""
        if self.max_restarts is not None:
            return self.max_restarts
        return self.spare_nodes + 1 if self.spare_nodes or self.elastic == "shrink" else 0
