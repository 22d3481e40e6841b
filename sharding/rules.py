"""Rule tables: ordered maps from logical axis names to mesh axes, and presets.

A rule maps one logical name to a tuple of mesh axes (sharded over their product)
or to an empty tuple (replicated). Presets are named tables plus the mesh sizes
they assume; a config may override single entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from spmd.sharding.axes import LOGICAL_AXES, MESH_AXES
from spmd.sharding.errors import ShardingError

MeshAxes = tuple[str, ...]
RuleValue = str | list[str] | tuple[str, ...] | None


def normalize_rule(logical: str, value: RuleValue) -> MeshAxes:
    """`None` -> (), `"fsdp"` -> ("fsdp",), lists -> tuples; unknown mesh axes are errors."""
    if value is None:
        axes: MeshAxes = ()
    elif isinstance(value, str):
        axes = (value,)
    else:
        axes = tuple(value)
    for axis in axes:
        if axis not in MESH_AXES:
            raise ShardingError(
                f"rule '{logical}' -> '{axis}' names a mesh axis that does not exist; "
                f"mesh axes are {', '.join(MESH_AXES)} (set mesh.rules.{logical})"
            )
    if len(set(axes)) != len(axes):
        raise ShardingError(f"rule '{logical}' -> {list(axes)} repeats a mesh axis")
    return axes


@dataclass(frozen=True)
class RuleTable:
    """An ordered, validated logical -> mesh-axes table."""

    rules: Mapping[str, MeshAxes] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, RuleValue]) -> RuleTable:
        return cls(MappingProxyType({k: normalize_rule(k, v) for k, v in mapping.items()}))

    def with_overrides(self, overrides: Mapping[str, RuleValue]) -> RuleTable:
        merged = dict(self.rules)
        merged.update({k: normalize_rule(k, v) for k, v in overrides.items()})
        return RuleTable(MappingProxyType(merged))

    def lookup(self, name: str) -> MeshAxes | None:
        """The mesh axes for `name`, or None when the table has no rule for it."""
        return self.rules.get(name)

    def as_dict(self) -> dict[str, list[str] | None]:
        return {k: (list(v) if v else None) for k, v in self.rules.items()}


# Every logical name replicated: the base that presets override.
_REPLICATED: dict[str, RuleValue] = {
    name: None
    for name in LOGICAL_AXES
}


def _table(**rules: RuleValue) -> dict[str, RuleValue]:
    table = dict(_REPLICATED)
    table.update(rules)
    return table


@dataclass(frozen=True)
class Preset:
    """A named strategy: its rule table and the mesh sizes it assumes by default."""

    name: str
    description: str
    rules: dict[str, RuleValue]
    mesh_axes: dict[str, int]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "dp", "data parallel: parameters replicated, batch split",
            _table(batch="data", activation_batch="data"),
            {"data": -1},
        ),
        Preset(
            "fsdp", "fully sharded data parallel: parameters split along embed, batch split",
            _table(batch=["data", "fsdp"], embed="fsdp",
                   activation_batch=["data", "fsdp"], activation_embed=None),
            {"fsdp": -1},
        ),
        Preset(
            "tp", "tensor parallel (Megatron): mlp, heads and vocab split across tensor",
            _table(batch="data", mlp="tensor", heads="tensor", vocab="tensor",
                   activation_batch="data"),
            {"tensor": -1},
        ),
        Preset(
            "fsdp_tp", "FSDP across fsdp, tensor parallel within tensor",
            _table(batch=["data", "fsdp"], embed="fsdp", mlp="tensor", heads="tensor",
                   vocab="tensor", activation_batch=["data", "fsdp"], activation_embed=None),
            {"fsdp": -1, "tensor": 2},
        ),
        Preset(
            "sp", "sequence (context) parallel: activations split along length",
            _table(batch=["data", "fsdp"], embed="fsdp",
                   activation_batch=["data", "fsdp"], activation_embed=None,
                   activation_length="context"),
            {"context": -1},
        ),
        Preset(
            "pp", "pipeline parallel: stacked layers split into stages over stage, batch split",
            _table(batch="data", layers="stage", activation_batch="data"),
            {"stage": -1},
        ),
        Preset(
            "pp_fsdp", "pipeline stages over stage, FSDP (embed) within each stage",
            _table(batch=["data", "fsdp"], embed="fsdp", layers="stage",
                   activation_batch=["data", "fsdp"], activation_embed=None),
            {"stage": 2, "fsdp": -1},
        ),
        Preset(
            "spatial", "domain decomposition: field grids split along x (context) and y (tensor)",
            _table(batch="data", x="context", y="tensor", activation_batch="data"),
            {"context": -1},
        ),
    )
}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ShardingError(
            f"unknown mesh.strategy '{name}'; choose one of {', '.join(PRESETS)}"
        ) from None


def rules_for(strategy: str, overrides: Mapping[str, RuleValue] | None = None) -> RuleTable:
    """The preset's table with a config's single-entry overrides applied."""
    table = RuleTable.from_mapping(preset(strategy).rules)
    return table.with_overrides(overrides or {})
