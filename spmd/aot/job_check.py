"""Check a config against the world a batch job will have, before the job is queued.

`spmd jobscript` knows that world (nodes x the devices each node's ranks drive, from the
system profile) but runs on a login node without those devices. `check_world` runs the
checks every rank runs at start-up, on stand-in devices, as `spmd plan --devices N` does:
- the mesh axes: their product, the one -1 axis, the node count factoring into them
  (spmd.engine.mesh);
- every sharding, the batch dividing over the data-parallel ways (the error names
  `train.batch_size` and the sizes that work), pipeline microbatches and gradient
  accumulation: building the runtime (`spmd.aot.plan.plan_runtime`);
- with `compile=True`, the memory of the compiled step against the profile's device memory
  (`spmd.aot.plan.make_plan`, the GPU compiler where `spmd plan` would use it).

What needs the data set (its shapes against the config, a loss that reads its statistics)
is skipped with a note when the data is not on this host: rank 0 of the job makes it.
Stand-in devices are set before JAX starts its backends: call this in a fresh process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spmd.errors import SpmdError

if TYPE_CHECKING:
    from spmd.aot.plan import Plan
    from spmd.config.schema import Config


@dataclass(frozen=True)
class WorldCheck:
    """What `check_world` found: the mesh, the memory plan (None: not compiled) and notes."""

    devices: int
    mesh: dict[str, int]
    plan: Plan | None = None
    notes: tuple[str, ...] = field(default=())

    def summary(self) -> str:
        """One line, e.g. 'mesh data=64; peak 59.9 MiB of 57.6 GiB per device (cpu compiler)'."""
        from spmd.aot.plan import human

        mesh = " x ".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "1 device"
        text = f"mesh {mesh}"
        if self.plan is not None:
            p = self.plan
            text += (f"; peak {human(p.peak_bytes)} of {human(p.available_bytes)} per device "
                     f"({p.peak_bytes / p.available_bytes:.0%}, {p.compiler} compiler)")
        return text


def _data_errors() -> tuple[type[Exception], ...]:
    from spmd.data.formats.field_files import DatasetError
    from spmd.data.formats.stores import ArrayDataError

    return DatasetError, ArrayDataError


def check_world(cfg: Config, devices: int, *, nodes: int = 1, system: str | None = None,
                compile: bool = True, config_name: str = "<config>") -> WorldCheck:
    """Run the start-up checks of `cfg` for `devices` devices on `nodes` nodes; raise the
    SpmdError a rank would (one line, naming the key to change), or PlanDoesNotFit when the
    compiled step needs more memory than a device of `system` has."""
    from spmd.engine.mesh import hybrid_layout, mesh_axis_sizes
    from spmd.hpc.systems import system_profile

    if devices < 1 or nodes < 1 or devices % nodes:
        raise SpmdError(f"{devices} devices cannot be spread evenly over {nodes} nodes")
    sizes = mesh_axis_sizes(cfg.mesh, devices)   # before JAX starts: the cheap checks first
    hybrid_layout(sizes, nodes)
    notes: list[str] = []
    if compile and system is not None and not system_profile(system).device_memory_bytes:
        notes.append(f"memory not checked: the '{system}' profile does not know its device "
                     f"memory")
        compile = False

    from spmd.aot.plan import make_plan, plan_runtime
    from spmd.aot.stand_ins import cpu_stand_in_devices
    from spmd.aot.topologies import plan_devices
    from spmd.engine.mesh import build_mesh

    if compile:
        chosen = plan_devices(devices, system)
        stand_ins, compiler_note = chosen.devices, chosen.note
    else:
        stand_ins, compiler_note = cpu_stand_in_devices(devices), ""
    mesh = build_mesh(cfg.mesh, stand_ins)
    shape = dict(mesh.shape)
    try:
        runtime = plan_runtime(cfg, mesh)
        if not compile:
            return WorldCheck(devices, shape, None, tuple(notes))
        plan = make_plan(cfg, mesh, system, config_name=config_name, runtime=runtime,
                         compiler_note=compiler_note)
    except _data_errors() as e:
        notes.append(f"the data set and the memory are not checked: {e}")
        return WorldCheck(devices, shape, None, tuple(notes))
    plan.check_fits()
    return WorldCheck(devices, shape, plan, tuple(notes))
