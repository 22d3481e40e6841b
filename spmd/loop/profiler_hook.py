"""The profiler hook: a JAX profiler trace of chosen updates, and one device-memory profile.

`run.profile.steps: [start, stop]` traces updates start..stop (the updates that make steps
start..stop, as metrics.jsonl counts them) on the ranks in `run.profile.ranks`, into
run.dir/profile/rank<r>/ (jax.profiler.start_trace / stop_trace, with the Perfetto trace that
`spmd profile RUN_DIR` reads; TensorBoard's profile plugin, XProf and Perfetto open it). The
rank's device-memory profile is written once, after the first update of the job, to
run.dir/profile/memory_rank<r>_step<s>.prof (pprof format).

Why a hook: tracing starts after the hooks of step start-1 and stops as soon as update stop
has finished on the device, so the trace holds whole steps and nothing of compilation (unless
start is the job's first update: the trace then starts before the compile). The trainer adds
this hook only when profiling is configured for the rank: off costs nothing.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax

from spmd.loop.hooks import StepInfo
from spmd.rundir.metrics import EventLog
from spmd.rundir.run_config import ProfileConfig

log = logging.getLogger("spmd.loop.profiler")

PROFILE_DIR = "profile"


def rank_trace_dir(run_dir: Path, rank: int) -> Path:
    """Where `rank` writes its traces (`<dir>/plugins/profile/<timestamp>/`)."""
    return run_dir / PROFILE_DIR / f"rank{rank:05d}"


def profiling(profile: ProfileConfig, rank: int) -> bool:
    """Whether this rank traces: run.profile.steps is set and the rank is listed."""
    return profile.steps is not None and rank in profile.ranks


class ProfilerHook:
    """Starts the trace after step start-1, stops it after step stop; memory profile once."""

    def __init__(self, profile: ProfileConfig, run_dir: Path, rank: int, events: EventLog):
        assert profile.steps is not None
        self.start_step, self.stop_step = profile.steps
        self.run_dir, self.rank, self.events = run_dir, rank, events
        self.trace_dir = rank_trace_dir(run_dir, rank)
        self.tracing_from: int | None = None
        self.first_step: int | None = None

    def _start_trace(self, step: int) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.trace_dir), create_perfetto_trace=True)
        self.tracing_from = step

    def _stop_trace(self, info: StepInfo) -> None:
        jax.block_until_ready(info.state)   # the last traced update must be in the trace
        started = time.perf_counter()
        jax.profiler.stop_trace()
        first, self.tracing_from = self.tracing_from, None
        self.events.emit("profiled", first_step=(first or 0) + 1, last_step=info.step,
                         dir=str(self.trace_dir), write_s=round(time.perf_counter() - started, 3))

    def start(self, info: StepInfo) -> None:
        self.first_step = info.step + 1
        if self.start_step <= self.first_step <= self.stop_step:
            log.info("profiling updates %d-%d into %s (from the job's first update: the trace "
                     "includes compilation)", self.first_step, self.stop_step, self.trace_dir)
            self._start_trace(info.step)

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.first_step:
            self._memory_profile(info)
        if self.tracing_from is not None:
            if info.step >= self.stop_step or info.final:
                self._stop_trace(info)
        elif info.step == self.start_step - 1 and not info.final:
            self._start_trace(info.step)

    def close(self, info: StepInfo) -> None:
        if self.tracing_from is not None:   # the run ended (or stopped) inside the window
            self._stop_trace(info)

    def _memory_profile(self, info: StepInfo) -> None:
        path = self.run_dir / PROFILE_DIR / f"memory_rank{self.rank:05d}_step{info.step}.prof"
        path.parent.mkdir(parents=True, exist_ok=True)
        jax.block_until_ready(info.state)
        jax.profiler.save_device_memory_profile(str(path))
        log.info("device memory profile after step %d: %s", info.step, path)
