"""Hierarchical checkpointing: node-local tier with partner copies, persistent Orbax tier."""

from __future__ import annotations

from spmd.checkpoint.interface import Checkpointer, CheckpointError, NullCheckpointer, Restored
from spmd.config.schema import Config
from spmd.launch import LaunchEnv
from spmd.rundir.metrics import EventLog


def make_checkpointer(cfg: Config, env: LaunchEnv, events: EventLog) -> Checkpointer:
    """The checkpointer for this run's config (a no-op when both tiers are off).

    No mesh is needed: what each process saves follows from the state's own shardings.
    """
    ck = cfg.checkpoint
    if ck.every == 0 and ck.persistent_every == 0:
        return NullCheckpointer()
    from spmd.checkpoint.manager import HierarchicalCheckpointer

    world = None
    if env.size > 1:
        try:
            from spmd.launch import mpi

            world = mpi.world()
        except Exception:  # no usable MPI: no partner copies, agreement still works
            world = None
    return HierarchicalCheckpointer(cfg, env, events, mpi_world=world)


__all__ = ["Checkpointer", "CheckpointError", "NullCheckpointer", "Restored",
           "make_checkpointer"]
