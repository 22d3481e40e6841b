"""Logical axis names -> named device mesh: rule tables, one resolver, the sharding report.

Owns the logical-axis vocabulary, strategy presets, parameter and activation shardings and
the pipeline schedules over the `stage` axis. Pure functions over `jax.sharding`: imports
nothing of the rest of spmd but `spmd.errors`, and knows nothing of MPI.
"""

from spmd.sharding.annotate import (
    LOGICAL_AXES_KEY,
    activation_sharding,
    constrain,
    param,
    with_axes,
)
from spmd.sharding.axes import ACTIVATION_PREFIX, LOGICAL_AXES, MESH_AXES
from spmd.sharding.errors import ShardingError
from spmd.sharding.params import ParamSharding, path_str, resolve_params, state_shardings
from spmd.sharding.report import ShardingReport
from spmd.sharding.resolve import logical_to_spec, spec_is_replicated
from spmd.sharding.rules import PRESETS, Preset, RuleTable, preset, rules_for

__all__ = [
    "ACTIVATION_PREFIX", "LOGICAL_AXES", "LOGICAL_AXES_KEY", "MESH_AXES", "PRESETS",
    "ParamSharding", "Preset", "RuleTable", "ShardingError", "ShardingReport",
    "activation_sharding", "constrain", "logical_to_spec", "param", "path_str", "preset",
    "resolve_params", "rules_for", "spec_is_replicated", "state_shardings", "with_axes",
]
