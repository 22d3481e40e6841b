"""Fault injection for tests: the one place that makes a real run misbehave on purpose.

The multi-process tests need a checkpoint save that stays in flight long enough to kill or
signal the job in the middle of it, a rank whose host copy of a snapshot fails, and a rank
that is slower than the others at every step. spmd itself knows nothing of this: the faults
wrap ordinary methods of the checkpoint and data layers from outside, in the test's child
processes only.

Faults, and the variables that switch them on (the values are compared with the step and
rank of each save):

    SPMD_CKPT_TEST_STALL=STEP:SECONDS      every rank holds its local-tier save of STEP for
                                           SECONDS, after its data and index are written to
                                           `<local_dir>/STEP/rank<r>.tmp/` and before the
                                           partner exchange and the commit (wraps
                                           `spmd.checkpoint.local.LocalTier._write_own`)
    SPMD_CKPT_TEST_FAIL_HOST_COPY=STEP:RANK  RANK's host copy of the snapshot of STEP raises,
                                           as a failed device-to-host copy would (wraps
                                           `spmd.checkpoint.snapshot.Snapshot.pieces`)
    SPMD_CKPT_TEST_SLOW_LISTING=RANK:SECONDS  RANK sleeps SECONDS before each rescan of the
                                           persistent tier's directory, as on a slow
                                           parallel file system (wraps
                                           `spmd.checkpoint.persistent.PersistentTier.orbax_steps`
                                           with reload=True)
    SPMD_TEST_SLOW_RANK=RANK:SECONDS       the process whose jax.process_index() is RANK
                                           sleeps SECONDS in each batch it loads, as a rank
                                           with a slow host or file system would: a
                                           straggler (wraps
                                           `spmd.data.loader.feed.BatchFeed.global_batch`)
    SPMD_TEST_RAISE=prepare:RANK           RANK's `Task.prepare` raises (wraps the task that
                                           `spmd.loop.trainer` builds)
    SPMD_TEST_RAISE=hook:RANK:STEP         a hook of the user's raises on RANK after update
                                           STEP (appended to the trainer's `hook_chain`)

How they are switched on: `fault_env(stall="9:120")` returns the environment entries to add
to a child's environment: the variable, and `tests/helpers/inject/` in front of PYTHONPATH.
That folder's `sitecustomize.py` loads this file in every Python the child starts (the
`spmd run` launcher and each rank under mpiexec or srun alike, since they inherit the
environment), and `install()` wraps the methods when their modules are first imported, so
nothing is imported early and a process without the variables is left untouched. With a
Slurm job, pass the same entries as `spmd jobscript --env NAME=VALUE`.

This file is loaded by path from `sitecustomize`, before the checkout is on sys.path: it
imports only the standard library at module level.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

STALL = "SPMD_CKPT_TEST_STALL"
FAIL_HOST_COPY = "SPMD_CKPT_TEST_FAIL_HOST_COPY"
SLOW_LISTING = "SPMD_CKPT_TEST_SLOW_LISTING"
SLOW_RANK = "SPMD_TEST_SLOW_RANK"
RAISE = "SPMD_TEST_RAISE"
INJECT_DIR = Path(__file__).resolve().parent / "inject"

log = logging.getLogger("spmd.checkpoint")


def fault_env(*, stall: str | None = None, fail_host_copy: str | None = None,
              slow_listing: str | None = None, slow_rank: str | None = None,
              raise_in: str | None = None,
              environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment entries that switch the named faults on in a child process and its ranks.

    `stall="STEP:SECONDS"`, `fail_host_copy="STEP:RANK"`, `slow_listing="RANK:SECONDS"`,
    `slow_rank="RANK:SECONDS"`, `raise_in="prepare:RANK"` or `"hook:RANK:STEP"`.
    PYTHONPATH is this process's (`environ`, default os.environ) with the injecting folder in
    front.
    """
    env = {}
    if raise_in is not None:
        _raise_spec(raise_in)
        env[RAISE] = raise_in
    if slow_listing is not None:
        _slow_spec(slow_listing)
        env[SLOW_LISTING] = slow_listing
    if slow_rank is not None:
        _rank_seconds(SLOW_RANK, slow_rank)
        env[SLOW_RANK] = slow_rank
    if stall is not None:
        _stall_spec(stall)
        env[STALL] = stall
    if fail_host_copy is not None:
        _fail_spec(fail_host_copy)
        env[FAIL_HOST_COPY] = fail_host_copy
    if env:
        current = (os.environ if environ is None else environ).get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join([str(INJECT_DIR), *([current] if current else [])])
    return env


def _raise_spec(spec: str) -> tuple[str, int, int]:
    where, _, rest = spec.partition(":")
    rank, _, step = rest.partition(":")
    if where not in ("prepare", "hook") or not rank.isdigit() or (where == "hook"
                                                                 and not step.isdigit()):
        raise ValueError(f"{RAISE}={spec!r} is not prepare:RANK or hook:RANK:STEP")
    return where, int(rank), int(step or 0)


def _stall_spec(spec: str) -> tuple[int, float]:
    step, sep, seconds = spec.partition(":")
    if not sep:
        raise ValueError(f"{STALL}={spec!r} is not STEP:SECONDS")
    return int(step), float(seconds)


def _fail_spec(spec: str) -> tuple[int, int]:
    step, sep, rank = spec.partition(":")
    if not sep:
        raise ValueError(f"{FAIL_HOST_COPY}={spec!r} is not STEP:RANK")
    return int(step), int(rank)


def _slow_spec(spec: str) -> tuple[int, float]:
    return _rank_seconds(SLOW_LISTING, spec)


def _rank_seconds(name: str, spec: str) -> tuple[int, float]:
    rank, sep, seconds = spec.partition(":")
    if not sep:
        raise ValueError(f"{name}={spec!r} is not RANK:SECONDS")
    return int(rank), float(seconds)


# ------------------------------------------------------------------ the faults


def _patch_stall(module: ModuleType, at: int, seconds: float) -> None:
    """LocalTier._write_own, then a sleep when it wrote step `at` without error."""
    original = module.LocalTier._write_own

    @functools.wraps(original)
    def write_own(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        out = original(self, step, *args, **kwargs)
        if step == at and out[2] is None:
            log.warning("%s: holding the save of step %d for %g s", STALL, step, seconds)
            time.sleep(seconds)
        return out

    write_own.fault = STALL  # type: ignore[attr-defined]
    module.LocalTier._write_own = write_own


def _patch_fail_host_copy(module: ModuleType, at: int, rank: int) -> None:
    """Snapshot.pieces raises on rank `rank` for step `at`."""
    original = module.Snapshot.pieces

    @functools.wraps(original)
    def pieces(self: Any, pids: Sequence[Any]) -> Any:
        if (self.step, self.owner.rank) == (at, rank):
            raise RuntimeError(f"{FAIL_HOST_COPY}: injected failure")
        return original(self, pids)

    pieces.fault = FAIL_HOST_COPY  # type: ignore[attr-defined]
    module.Snapshot.pieces = pieces


def _patch_slow_listing(module: ModuleType, rank: int, seconds: float) -> None:
    """PersistentTier.orbax_steps(reload=True) sleeps first on rank `rank`."""
    original = module.PersistentTier.orbax_steps

    @functools.wraps(original)
    def orbax_steps(self: Any, reload: bool = False) -> Any:
        if reload and self.rank == rank:
            time.sleep(seconds)
        return original(self, reload)

    orbax_steps.fault = SLOW_LISTING  # type: ignore[attr-defined]
    module.PersistentTier.orbax_steps = orbax_steps


def _patch_slow_rank(module: ModuleType, rank: int, seconds: float) -> None:
    """BatchFeed.global_batch sleeps first in the process whose jax.process_index() is `rank`."""
    original = module.BatchFeed.global_batch

    @functools.wraps(original)
    def global_batch(self: Any, source: Any, step: int) -> Any:
        import jax  # imported by the feed's module already: nothing is imported early

        if jax.process_index() == rank:
            time.sleep(seconds)
        return original(self, source, step)

    global_batch.fault = SLOW_RANK  # type: ignore[attr-defined]
    module.BatchFeed.global_batch = global_batch


def _patch_raise(module: ModuleType, where: str, rank: int, step: int) -> None:
    """spmd.loop.trainer: its task's `prepare` raises on `rank` (where="prepare"), or a
    hook of the user's raises there after update `step` (where="hook")."""
    import jax  # imported by the trainer's module already: nothing is imported early

    def fail(what: str) -> None:
        raise RuntimeError(f"{RAISE}: injected in {what} on rank {rank}")

    if where == "prepare":
        build_task = module.build_task

        @functools.wraps(build_task)
        def build(cfg: Any) -> Any:
            task = build_task(cfg)
            prepare = task.prepare

            def failing_prepare(is_coordinator: bool) -> None:
                if jax.process_index() == rank:
                    fail("Task.prepare")
                prepare(is_coordinator)

            task.prepare = failing_prepare
            return task

        build.fault = RAISE  # type: ignore[attr-defined]
        module.build_task = build
        return
    chain_of = module.hook_chain

    @functools.wraps(chain_of)
    def chain(*args: Any) -> list:
        def user_hook(info: Any) -> None:
            if info.step == step and jax.process_index() == rank:
                fail(f"a hook of the user's at step {step}")

        return [*chain_of(*args), module.Hook(user_hook, 1, "user")]

    chain.fault = RAISE  # type: ignore[attr-defined]
    module.hook_chain = chain


# ------------------------------------------------------------------ installing


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after its first import (so nothing is imported early)."""

    def __init__(self, patches: dict[str, list[Callable[[ModuleType], None]]]):
        self.patches = patches

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patches = self.patches.pop(fullname, None)
        if patches is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install(environ: Mapping[str, str] | None = None) -> list[str]:
    """Switch on the faults whose variables are set; returns their names.

    A module already imported is patched at once; any other when it is first imported.
    """
    environ = os.environ if environ is None else environ
    patches: dict[str, list[Callable[[ModuleType], None]]] = {}
    if environ.get(STALL):
        at, seconds = _stall_spec(environ[STALL])
        patches.setdefault("spmd.checkpoint.local", []).append(
            lambda m: _patch_stall(m, at, seconds))
    if environ.get(FAIL_HOST_COPY):
        at_step, rank = _fail_spec(environ[FAIL_HOST_COPY])
        patches.setdefault("spmd.checkpoint.snapshot", []).append(
            lambda m: _patch_fail_host_copy(m, at_step, rank))
    if environ.get(SLOW_LISTING):
        slow_rank, seconds = _slow_spec(environ[SLOW_LISTING])
        patches.setdefault("spmd.checkpoint.persistent", []).append(
            lambda m: _patch_slow_listing(m, slow_rank, seconds))
    if environ.get(SLOW_RANK):
        late_rank, delay = _rank_seconds(SLOW_RANK, environ[SLOW_RANK])
        patches.setdefault("spmd.data.loader.feed", []).append(
            lambda m: _patch_slow_rank(m, late_rank, delay))
    if environ.get(RAISE):
        where, fail_rank, fail_step = _raise_spec(environ[RAISE])
        patches.setdefault("spmd.loop.trainer", []).append(
            lambda m: _patch_raise(m, where, fail_rank, fail_step))
    names = [n for n in (STALL, FAIL_HOST_COPY, SLOW_LISTING, SLOW_RANK, RAISE)
             if environ.get(n)]
    for name in [n for n in patches if n in sys.modules]:
        for patch in patches.pop(name):
            patch(sys.modules[name])
    if patches:
        sys.meta_path.insert(0, _AfterImport(patches))
    return names
