"""The sharding report: where every parameter lives and how much is replicated."""

from __future__ import annotations

from dataclasses import dataclass

from spmd.sharding.errors import ShardingError
from spmd.sharding.params import ParamSharding
from spmd.sharding.resolve import spec_is_replicated


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
                }
                for p in self.params
            ],
        }

    def as_text(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh_shape.items() if v > 1) or "1 device"
        rows = [("path", "shape", "logical axes", "spec", "bytes/device")]
        for p in self.params:
            rows.append((
                p.path, str(p.shape), str(tuple(p.logical_axes)), str(tuple(p.spec)),
                f"{p.bytes_per_device(self.mesh_shape):,}",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [f"mesh: {mesh}"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(
            f"total {self.total_bytes:,} B, per device {self.bytes_per_device:,} B, "
            f"replicated fraction {self.replicated_fraction:.3f}"
        )
        return "\n".join(lines)
