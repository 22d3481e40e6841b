"""The rule table of one run: the strategy's preset, the task's own rules, the config's.

One place builds it for training, `spmd shardings`, `spmd plan` and `spmd.load`, so every
path resolves a parameter to the same placement.
"""

from __future__ import annotations

from spmd.config.schema import MeshConfig
from spmd.sharding import RuleTable, rules_for
from spmd.tasks.base import Task


def axis_rules(mesh_cfg: MeshConfig, task: Task) -> RuleTable:
    """The rule table for `mesh_cfg.strategy` with `task`'s rules and `mesh.rules` applied."""
    return rules_for(mesh_cfg.strategy, mesh_cfg.rules)
