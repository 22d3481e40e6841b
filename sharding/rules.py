"""Rule tables: ordered maps from logical axis names to mesh axes, and presets.

A rule maps one logical name to a tuple of mesh axes (sharded over their product)
or to an empty tuple (replicated). Presets are named tables plus the mesh sizes
they assume; a config may override single entries.

A task may bring Flax-style rules, `[(logical, mesh axis | (mesh axes) | None), ...]` as in
`nnx.logical_axis_rules`, naming its own mesh axes (e.g. 'model'); `flax_rules` maps them
onto spmd's mesh axes through the config's `mesh.axis_aliases` (a name repeated in the list:
the first rule wins, as in Flax's priority order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from spmd.sharding.axes import LOGICAL_AXES, MESH_AXES
from spmd.sharding.errors import ShardingError

MeshAxes = tuple[str, ...]
RuleValue = str | list[str] | tuple[str, ...] | None


def normalize_rule(logical: str, value: RuleValue) -> MeshAxes:
    """`None` -> (), `"fsdp"` -> ("fsdp",), lists -> tuples; unknown mesh axes are errors."""
    axes: MeshAxes = _mesh_axes_of(value)
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
    """An ordered, validated logical -> mesh-axes table.

    `fsdp_min_bytes` (parameters only, see `spmd.sharding.fsdp`): when the mesh's `fsdp` axis
    is larger than 1, a parameter of at least this many bytes that no rule puts on `fsdp` is
    split over it along its largest dimension that divides; None: only the rules decide.

    `require_annotations` (config `mesh.require_annotations`): a parameter with no logical
    axes at all is an error; False (the default) gives it one unnamed (None) name per
    dimension, so it is replicated, or placed by auto-FSDP under an `fsdp` axis.
    """

    rules: Mapping[str, MeshAxes] = field(default_factory=dict)
    fsdp_min_bytes: int | None = None
    require_annotations: bool = False

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, RuleValue]) -> RuleTable:
        return cls(MappingProxyType({k: normalize_rule(k, v) for k, v in mapping.items()}))

    def with_overrides(self, overrides: Mapping[str, RuleValue]) -> RuleTable:
        merged = dict(self.rules)
        merged.update({k: normalize_rule(k, v) for k, v in overrides.items()})
        return dataclasses.replace(self, rules=MappingProxyType(merged))

    def with_fsdp_min_bytes(self, min_bytes: int | None) -> RuleTable:
        return dataclasses.replace(self, fsdp_min_bytes=min_bytes)

    def with_require_annotations(self, required: bool) -> RuleTable:
        return dataclasses.replace(self, require_annotations=required)

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
    # The mesh axes this strategy exists to shard parameters over: a run where none of them
    # shards any parameter is warned about (`spmd.sharding.report.replication_warning`).
    param_axes: tuple[str, ...] = ()


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
            ("fsdp",),
        ),
        Preset(
            "tp", "tensor parallel (Megatron): mlp, heads and vocab split across tensor",
            _table(batch="data", mlp="tensor", heads="tensor", vocab="tensor",
                   activation_batch="data"),
            {"tensor": -1},
            ("tensor",),
        ),
        Preset(
            "fsdp_tp", "FSDP across fsdp, tensor parallel within tensor",
            _table(batch=["data", "fsdp"], embed="fsdp", mlp="tensor", heads="tensor",
                   vocab="tensor", activation_batch=["data", "fsdp"], activation_embed=None),
            {"fsdp": -1, "tensor": 2},
            ("fsdp", "tensor"),
        ),
        Preset(
            "sp", "sequence (context) parallel: activations split along length",
            _table(batch=["data", "fsdp"], embed="fsdp",
                   activation_batch=["data", "fsdp"], activation_embed=None,
                   activation_length="context"),
            {"context": -1},
            ("fsdp",),
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
            ("fsdp",),
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


def _mesh_axes_of(value: RuleValue) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def flax_rules(
    pairs: Sequence[tuple[str, RuleValue]] | Mapping[str, RuleValue],
    aliases: Mapping[str, RuleValue] | None = None,
    *,
    source: str = "the task's logical_axis_rules()",
) -> dict[str, MeshAxes]:
    """Flax-style `(logical, mesh axis | (mesh axes) | None)` pairs -> spmd rule entries.

    A mesh axis name in `aliases` is replaced by its value (spmd mesh axes; None drops it);
    otherwise it must be one of spmd's mesh axes. A logical name listed twice: the first
    rule wins (Flax's priority order).
    """
    aliases = dict(aliases or {})
    alias_axes: dict[str, MeshAxes] = {}
    for name, target in aliases.items():
        for axis in _mesh_axes_of(target):
            if axis not in MESH_AXES:
                raise ShardingError(
                    f"mesh.axis_aliases.{name}={target!r} names '{axis}', which is not a "
                    f"mesh axis; mesh axes are {', '.join(MESH_AXES)}"
                )
        alias_axes[name] = _mesh_axes_of(target)
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    out: dict[str, MeshAxes] = {}
    for rule in items:
        if (not isinstance(rule, (tuple, list)) or len(rule) != 2
                or not isinstance(rule[0], str)):
            raise ShardingError(
                f"{source}: rule {rule!r} is not a (logical name, mesh axis | (mesh axes) | "
                f"None) pair"
            )
        logical, target = rule
        if logical in out:
            continue
        axes: list[str] = []
        for name in _mesh_axes_of(target):
            if name in alias_axes:
                axes.extend(alias_axes[name])
            elif name in MESH_AXES:
                axes.append(name)
            else:
                raise ShardingError(
                    f"{source}: rule ({logical!r}, {target!r}) names mesh axis '{name}', which "
                    f"spmd's mesh does not have (mesh axes are {', '.join(MESH_AXES)}); map it "
                    f"with mesh.axis_aliases, e.g. mesh.axis_aliases.{name}=tensor (or null to "
                    f"replicate what the task puts on '{name}')"
                )
        out[logical] = normalize_rule(logical, tuple(dict.fromkeys(axes)))
    return out


def rules_for(strategy: str, overrides: Mapping[str, RuleValue] | None = None) -> RuleTable:
    """The preset's table with a config's single-entry overrides applied."""
    table = RuleTable.from_mapping(preset(strategy).rules)
    return table.with_overrides(overrides or {})
