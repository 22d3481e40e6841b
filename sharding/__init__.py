"""Logical axis names -> named device mesh: rule tables, one resolver, the sharding report.

Owns the logical-axis vocabulary, strategy presets, parameter and activation shardings and
the pipeline schedules over the `stage` axis. Parameters may be annotated with spmd's
`with_axes` or Flax's `nnx.with_partitioning` (`annotate`); a task may bring Flax-style rules
(`rules.flax_rules`); parameters no rule puts on `fsdp` are split by auto-FSDP (`fsdp`); the
report warns about replication the strategy exists to avoid (`report`). docs/sharding.md.
Pure functions over `jax.sharding`: imports nothing of the rest of spmd but `spmd.errors`,
and knows nothing of MPI.
"""

from spmd.sharding.annotate import (
    FLAX_SHARDING_KEYS,
    LOGICAL_AXES_KEY,
    activation_sharding,
    annotated_axes,
    constrain,
    param,
    with_axes,
)
from spmd.sharding.axes import ACTIVATION_PREFIX, LOGICAL_AXES, MESH_AXES, PARAM_MESH_AXES
from spmd.sharding.errors import ShardingError
from spmd.sharding.fsdp import auto_fsdp_dim
from spmd.sharding.params import (
    ParamSharding,
    logical_axes_of,
    path_str,
    resolve_params,
    state_shardings,
)
from spmd.sharding.report import ShardingReport, replication_warning
from spmd.sharding.resolve import logical_to_spec, spec_is_replicated
from spmd.sharding.rules import PRESETS, Preset, RuleTable, flax_rules, preset, rules_for

__all__ = [
    "ACTIVATION_PREFIX", "FLAX_SHARDING_KEYS", "LOGICAL_AXES", "LOGICAL_AXES_KEY", "MESH_AXES",
    "PARAM_MESH_AXES", "PRESETS", "ParamSharding", "Preset", "RuleTable", "ShardingError",
    "ShardingReport", "activation_sharding", "annotated_axes", "auto_fsdp_dim", "constrain",
    "flax_rules", "logical_axes_of", "logical_to_spec", "param", "path_str", "preset",
    "replication_warning", "resolve_params", "rules_for", "spec_is_replicated",
    "state_shardings", "with_axes",
]
