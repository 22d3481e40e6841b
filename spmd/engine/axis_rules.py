"""The rule table of one run: the strategy's preset, the task's own rules, the config's.

One place builds it for training, `spmd shardings`, `spmd plan` and `spmd.load`, so every
path resolves a parameter to the same placement. Precedence, lowest first:

1. the preset of `mesh.strategy` (`spmd.sharding.PRESETS`);
2. the task's Flax-style `Task.logical_axis_rules()` pairs, their mesh axis names mapped
   through `mesh.axis_aliases` (e.g. {model: tensor}); a logical name listed twice: the
   first pair wins, as in Flax;
3. the config's single-entry overrides `mesh.rules`;
4. under `mesh.axis_types: explicit`, each mesh axis name without a rule maps to itself (a
   model written for JAX's explicit sharding names mesh axes in its PartitionSpecs).

`mesh.fsdp_min_bytes` rides on the table: auto-FSDP of parameters no rule puts on `fsdp`
(`spmd.sharding.fsdp`).
"""

from __future__ import annotations

import logging

import jax

from spmd.engine.engine_config import MeshConfig
from spmd.engine.mesh import physical_axis_rules
from spmd.sharding import RuleTable, ShardingReport, rules_for
from spmd.sharding.report import replication_warning, unannotated_note
from spmd.sharding.rules import flax_rules
from spmd.tasks.base import Task

log = logging.getLogger("spmd.sharding")


def axis_rules(mesh_cfg: MeshConfig, task: Task) -> RuleTable:
    """The rule table for `mesh_cfg.strategy` with `task`'s rules and `mesh.rules` applied."""
    table = rules_for(mesh_cfg.strategy)
    own = getattr(task, "logical_axis_rules", None)
    pairs = own() if own is not None else None
    # validated even without task rules: a typo in mesh.axis_aliases is an error
    translated = flax_rules(pairs or (), mesh_cfg.axis_aliases,
                            source=f"{type(task).__name__}.logical_axis_rules()")
    table = (table.with_overrides(translated)
             .with_overrides(mesh_cfg.rules)
             .with_fsdp_min_bytes(mesh_cfg.fsdp_min_bytes)
             .with_require_annotations(mesh_cfg.require_annotations))
    return physical_axis_rules(table, mesh_cfg)   # mesh.axis_types=explicit: fsdp -> fsdp


def warn_replication(report: ShardingReport, mesh_cfg: MeshConfig) -> str | None:
    """Log (WARNING on process 0, INFO on the others: one copy on the console) what the
    layout replicates that `mesh.strategy` exists to shard; returns the message or None.
    Parameters without logical axes are counted in one INFO line (process 0)."""
    note = unannotated_note(report)
    if note is not None and jax.process_index() == 0:
        log.info(note)
    message = replication_warning(report, mesh_cfg.strategy, mesh_cfg.warn_replicated_bytes)
    if message is not None:
        log.log(logging.WARNING if jax.process_index() == 0 else logging.INFO, message)
    return message
