"""Hierarchical checkpointing: node-local tier with partner copies, persistent Orbax tier.

Owns: the `Checkpointer` the trainer talks to and its builder from the `checkpoint:`
section (`create_checkpointer`), both tiers (`local`, `persistent`), the snapshot a save
blocks for (`snapshot`), the `checkpoint:` section itself with when each tier is due and
where it lives (`policy`), restore planning (`restore`), the ranks' agreement on each commit
(`coordination`), partner transport over MPI (`transport`), the on-disk formats and their
listing and verification (`layout`, `files`, `listing`). May import `spmd.comm`,
`spmd.launch`, `spmd.sharding`, `spmd.rundir` (the event log) and `spmd.errors`; never the
engine, the loop or a task: what it saves follows from the state's own shardings.
"""

from __future__ import annotations

from pathlib import Path

from spmd.checkpoint.interface import Checkpointer, CheckpointError, NullCheckpointer, Restored
from spmd.checkpoint.policy import CheckpointConfig, SavePolicy
from spmd.launch import LaunchEnv
from spmd.rundir.metrics import EventLog


def create_checkpointer(section: CheckpointConfig, *, run_dir: Path, env: LaunchEnv,
                        events: EventLog) -> Checkpointer:
    """The checkpointer the `checkpoint:` section asks for (a no-op when it saves nothing).

    The section's own builder (the schema is a leaf and cannot import this layer, so the
    builder lives beside the checkpointer). `run_dir` is `run.dir`, under which the tiers
    live unless `checkpoint.local_dir` / `checkpoint.persistent_dir` say otherwise. No mesh
    is needed: what each process saves follows from the state's own shardings.
    """
    if not SavePolicy.of(section).saves_anything:
        return NullCheckpointer()
    from spmd.checkpoint.manager import HierarchicalCheckpointer

    world = None
    if env.size > 1:
        try:
            from spmd.launch import mpi

            world = mpi.world()
        except Exception:  # no usable MPI: no partner copies, agreement still works
            world = None
    return HierarchicalCheckpointer(section, run_dir=run_dir, env=env, events=events,
                                    mpi_world=world)


__all__ = ["Checkpointer", "CheckpointError", "NullCheckpointer", "Restored",
           "create_checkpointer"]
