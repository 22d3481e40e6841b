"""Hierarchical checkpointing: node-local tier with partner copies, persistent Orbax tier."""

from __future__ import annotations

from typing import Any

from spmd.checkpoint.api import Checkpointer, CheckpointError, NullCheckpointer, Restored


def make_checkpointer(cfg: Any, env: Any, mesh: Any, events: Any) -> Checkpointer:
    """The checkpointer for this run's config (a no-op when both tiers are off).

    `mesh` is not needed: what each process saves follows from the state's own shardings.
    """
    ck = cfg.checkpoint
    if ck.every == 0 and ck.persistent_every == 0:
        return NullCheckpointer()
    from spmd.checkpoint.manager import HierarchicalCheckpointer

    world = None
    if env.size > 1:
        try:
            from launch import mpi

            world = mpi.world()
        except Exception:  # no usable MPI: no partner copies, agreement still works
            world = None
    return HierarchicalCheckpointer(cfg, env, events, mpi_world=world)


__all__ = ["Checkpointer", "CheckpointError", "NullCheckpointer", "Restored",
           "make_checkpointer"]
