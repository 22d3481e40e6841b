"""The sharding report: where every parameter lives and how much is replicated.

`replication_warning` decides (purely) whether a layout replicates what its strategy exists to
shard; the runtime and `spmd shardings` log what it returns. Two cases:
(a) the strategy's parameter axes (`Preset.param_axes`: fsdp for the fsdp family, tensor for
    tp) are larger than 1 but no parameter is split over one of them;
(b) a parameter of at least `warn_bytes` bytes is whole on every device while a mesh axis
    that can split parameters (stage, fsdp, tensor, expert) is larger than 1.
The message names the parameters (largest first), their bytes and the rule to change.
`unannotated_note` counts the parameters the model gave no logical axes (replicated, or
placed by auto-FSDP) and says how to name them for tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.sharding.axes import PARAM_MESH_AXES
from spmd.sharding.errors import ShardingError
from spmd.sharding.params import ParamSharding
from spmd.sharding.resolve import spec_is_replicated
from spmd.sharding.rules import preset

# How many parameters a warning names.
_NAMED = 3


@dataclass(frozen=True)
class ShardingReport:
    mesh_shape: dict[str, int]
    params: list[ParamSharding]

    @property
    def num_devices(self) -> int:
        n = 1
        for size in self.mesh_shape.values():
            n *= size
        return n

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes_total() for p in self.params)

    @property
    def bytes_per_device(self) -> int:
        return sum(p.bytes_per_device(self.mesh_shape) for p in self.params)

    @property
    def replicated_fraction(self) -> float:
        """Redundancy of parameter storage: 0 = each byte on one device, 1 = on every device."""
        n = self.num_devices
        if n == 1 or self.total_bytes == 0:
            return 0.0
        copies = self.bytes_per_device * n / self.total_bytes
        return max(0.0, min(1.0, (copies - 1) / (n - 1)))

    def check_replicated_fraction(self, limit: float | None) -> None:
        if limit is not None and self.replicated_fraction > limit:
            worst = sorted(
                (p for p in self.params if spec_is_replicated(p.spec)),
                key=lambda p: -p.bytes_total(),
            )[:3]
            names = ", ".join(f"{p.path} ({p.bytes_total()} B)" for p in worst)
            raise ShardingError(
                f"replicated fraction {self.replicated_fraction:.3f} exceeds "
                f"mesh.max_replicated_fraction={limit}; largest replicated parameters: {names}"
            )

    def as_json(self) -> dict:
        return {
            "mesh": self.mesh_shape,
            "num_devices": self.num_devices,
            "total_bytes": self.total_bytes,
            "bytes_per_device": self.bytes_per_device,
            "replicated_fraction": self.replicated_fraction,
            "params": [
                {
                    "path": p.path,
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "logical_axes": list(p.logical_axes),
                    "spec": [list(e) if isinstance(e, tuple) else e for e in p.spec],
                    "bytes_per_device": p.bytes_per_device(self.mesh_shape),
                    "padded_dims": p.padded,
                    "auto_fsdp_dim": p.auto_fsdp_dim,
                    "unannotated": p.unannotated,
                }
                for p in self.params
            ],
        }

    def as_text(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh_shape.items() if v > 1) or "1 device"
        rows = [("path", "shape", "logical axes", "spec", "bytes/device", "notes")]
        for p in self.params:
            rows.append((
                p.path, str(p.shape), str(tuple(p.logical_axes)), str(tuple(p.spec)),
                f"{p.bytes_per_device(self.mesh_shape):,}", _notes(p),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = [f"mesh: {mesh}"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if any(p.padded for p in self.params):
            lines.append("padded+N: a short Flax spec; its last N dimensions are replicated")
        if any(p.auto_fsdp_dim is not None for p in self.params):
            lines.append("auto-fsdp dim D: no rule put it on fsdp; mesh.fsdp_min_bytes split "
                         "dimension D")
        if any(p.unannotated for p in self.params):
            lines.append("unannotated: the model gave it no logical axes; replicated unless "
                         "auto-fsdp split it (mesh.require_annotations=true refuses it)")
        lines.append(
            f"total {self.total_bytes:,} B, per device {self.bytes_per_device:,} B, "
            f"replicated fraction {self.replicated_fraction:.3f}"
        )
        return "\n".join(lines)


def _notes(p: ParamSharding) -> str:
    notes = ["unannotated"] if p.unannotated else []
    if p.padded:
        notes.append(f"padded+{p.padded}")
    if p.auto_fsdp_dim is not None:
        notes.append(f"auto-fsdp dim {p.auto_fsdp_dim}")
    return ", ".join(notes)


def _rule_hint(p: ParamSharding, axis: str, size: int) -> str:
    """`mesh.rules.<name>=<axis>` for the parameter's largest named dimension `size` divides."""
    dims = sorted(range(len(p.shape)), key=lambda d: (-p.shape[d], -d))
    for d in dims:
        name = p.logical_axes[d] if d < len(p.logical_axes) else None
        if name is not None and p.shape[d] % size == 0:
            return f"mesh.rules.{name}={axis}"
    named = [n for n in p.logical_axes if n is not None]
    if named:
        return (f"no named dimension of it divides by {axis}={size}; change its logical axes "
                f"{tuple(p.logical_axes)} or the model size")
    return f"give its dimensions logical names (they are {tuple(p.logical_axes)})"


def _describe(params: list[ParamSharding], axis: str, size: int) -> str:
    shown = ", ".join(
        f"{p.path} {p.shape} {tuple(p.logical_axes)} {p.bytes_total():,} B "
        f"(e.g. {_rule_hint(p, axis, size)})" for p in params[:_NAMED])
    more = len(params) - _NAMED
    return shown + (f", and {more} more" if more > 0 else "")


def replication_warning(report: ShardingReport, strategy: str,
                        warn_bytes: int | None) -> str | None:
    """The warning to log when the layout replicates what the strategy exists to shard, or
    None. Pure: depends only on the report, the strategy's preset and `warn_bytes`."""
    mesh = report.mesh_shape
    by_size = sorted(report.params, key=lambda p: (-p.bytes_total(), p.path))
    messages = []

    def uses(p: ParamSharding, axis: str) -> bool:
        return any(axis == e or (isinstance(e, tuple) and axis in e) for e in p.spec)

    for axis in preset(strategy).param_axes:
        size = mesh.get(axis, 1)
        if size > 1 and by_size and not any(uses(p, axis) for p in report.params):
            hint = " or set mesh.fsdp_min_bytes to split big ones automatically" if (
                axis == "fsdp") else ""
            messages.append(
                f"mesh.strategy={strategy} shards parameters over mesh axis {axis} "
                f"({size} devices), but no parameter is split over it: every device holds "
                f"them whole. Largest: {_describe(by_size, axis, size)}. Put a logical axis of "
                f"theirs on {axis} with mesh.rules.<name>={axis}{hint}."
            )
    active = [(a, mesh[a]) for a in PARAM_MESH_AXES if mesh.get(a, 1) > 1]
    if warn_bytes is not None and active and not messages:
        big = [p for p in by_size if p.shape and spec_is_replicated(p.spec)
               and p.bytes_total() >= warn_bytes]
        if big:
            own = [a for a in preset(strategy).param_axes if mesh.get(a, 1) > 1]
            axis = own[0] if own else active[0][0]
            axes = ", ".join(f"{a}={n}" for a, n in active)
            messages.append(
                f"{len(big)} parameter(s) of at least mesh.warn_replicated_bytes={warn_bytes:,} B "
                f"are replicated on every device although mesh axes {axes} can split "
                f"parameters: {_describe(big, axis, mesh[axis])}. Shard one of their "
                f"dimensions with a rule (mesh.rules.<logical name>=<mesh axis>) or change "
                f"their logical axes; mesh.warn_replicated_bytes=null silences this."
            )
    return " ".join(messages) or None


def unannotated_note(report: ShardingReport) -> str | None:
    """One line counting the parameters without logical axes, or None when there are none."""
    bare = [p for p in report.params if p.unannotated]
    if not bare:
        return None
    split = sum(p.auto_fsdp_dim is not None for p in bare)
    nbytes = sum(p.bytes_total() for p in bare)
    first = ", ".join(p.path for p in bare[:_NAMED]) + (", ..." if len(bare) > _NAMED else "")
    placed = (f"{split} split over fsdp by auto-FSDP, the rest replicated" if split
              else "replicated on every device")
    return (f"{len(bare)} of {len(report.params)} parameters ({nbytes:,} B) have no logical "
            f"axes ({first}): {placed}. To shard them with tensor parallelism (mesh.strategy="
            f"tp or fsdp_tp), name their dimensions in the model with spmd's with_axes(init, "
            f"('embed', 'mlp')) or Flax's nnx.with_partitioning(init, ('embed', 'mlp')); "
            f"`spmd shardings` marks them 'unannotated'.")
