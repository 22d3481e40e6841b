"""Ahead-of-time plan of one train step: per-device memory, FLOPs and collectives, and the fit.

`make_plan(cfg, mesh)` lowers and compiles the runtime's jitted train step on abstract
inputs (ShapeDtypeStructs carrying the runtime's shardings; nothing is allocated) and
reads what XLA decided. Every figure is per device: the compiled module is the SPMD
partition that each device runs.

Memory, from `compiled.memory_analysis()`:
  arguments  = the state and batch shards a device receives
  outputs    = the new state shards and the metrics
  aliased    = outputs written in place of donated arguments (the state, with donation)
  resident   = arguments + outputs - aliased   (what stays allocated across a step)
  temporary  = XLA's scratch: activations kept for the backward pass, gradients, ...
  peak       = resident + temporary (+ generated code), the figure checked against memory.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from spmd.errors import ExitCode, SpmdError

if TYPE_CHECKING:
    from spmd.config.schema import Config

GiB = 1 << 30
GENERIC_GPU = ("generic-80g", 80 * GiB)      # the default target: a generic 80 GB GPU
DEFAULT_MEM_FRACTION = 0.90                 # XLA_PYTHON_CLIENT_MEM_FRACTION of our GPU profiles
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<type>.*?) "
                          r"(?P<op>[a-z][\w\-]*)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[\d,]*)\]")


class PlanDoesNotFit(SpmdError):
    """The step needs more device memory than the target system has."""

    exit_code = ExitCode.DOES_NOT_FIT


@dataclass
class Collective:
    """All collectives of one kind in the compiled step (static count: loops count once)."""

    op: str
    count: int = 0
    bytes: int = 0             # result payload per device, summed
    traffic_bytes: int = 0     # per-device bytes sent, ring-algorithm estimate
    group_sizes: list[int] = field(default_factory=list)


@dataclass
class Plan:
    config: str
    strategy: str
    mesh: dict[str, int]
    num_devices: int
    system: str
    device_memory_bytes: int
    mem_fraction: float
    # per device, from the shardings
    param_bytes: int
    optimizer_bytes: int
    other_state_bytes: int
    batch_bytes: int
    # per device, from the compiled executable
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops_compiled: float | None
    flops_analytic: float | None         # per device, task.flops_per_example (LM: PaLM)
    tokens_per_step: int
    collectives: list[Collective]
    compile_seconds: float
    backend: str
    # Which compiler produced the compiled figures (memory, FLOPs, collectives): "gpu"
    # (the CUDA compiler, for the profile's GPU, through an abstract topology) or "cpu"
    # (CPU stand-in devices); the note says for what and, on a fallback, why.
    compiler: str = "cpu"
    compiler_note: str = ""
    # Parameters stacked along a leading `layers` logical axis (scanned layers):
    # path, shape, logical axes, mesh spec, as `spmd shardings` reports them.
    layer_stacks: list[dict] = field(default_factory=list)
    # Pipelined strategies (layers on stage): stages, schedule, bubble fraction
    # (S - 1) / (M + S - 1), per-stage bytes of the stacked layers, and the stage-to-stage
    # transfers (the collective-permutes of the compiled step). None without stages.
    pipeline: dict | None = None
    # train.grad_accum: microbatches per step run one after another (the temporary bytes,
    # activations of one microbatch, fall with it); ema: the state keeps an EMA of the params
    grad_accum: int = 1
    ema_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.optimizer_bytes + self.other_state_bytes

    @property
    def resident_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.temp_bytes + self.code_bytes

    @property
    def available_bytes(self) -> int:
        return int(self.device_memory_bytes * self.mem_fraction)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.available_bytes

    def check_fits(self) -> None:
        """Raise PlanDoesNotFit with needed vs available and the excess."""
        if self.fits:
            return
        over = self.peak_bytes - self.available_bytes
        raise PlanDoesNotFit(
            f"does not fit {self.system}: needs {gib(self.peak_bytes)} per device, "
            f"{gib(self.available_bytes)} available ({self.mem_fraction:.0%} of "
            f"{gib(self.device_memory_bytes)}); over by {gib(over)} "
            f"({over / self.available_bytes:.0%}). Shard more (mesh.strategy=fsdp, more "
            f"devices), shrink train.batch_size or the model, or pick another --system"
        )

    def as_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "collectives"}
        out.update(state_bytes=self.state_bytes, resident_bytes=self.resident_bytes,
                   peak_bytes=self.peak_bytes, available_bytes=self.available_bytes,
                   fits=self.fits, over_bytes=max(0, self.peak_bytes - self.available_bytes))
        out["collectives"] = [asdict(c) for c in self.collectives]
        return out

    def as_text(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
        lines = [
            f"plan: {self.config}, strategy {self.strategy}, mesh {mesh} "
            f"({self.num_devices} devices; compiled for {self.backend} in "
            f"{self.compile_seconds:.1f} s)",
            f"compiler: {self.compiler}" + (f" ({self.compiler_note})" if self.compiler_note
                                            else ""),
            "",
            "memory per device",
        ]
        by = f"{self.compiler} compiler"
        rows = [
            ("parameters", self.param_bytes, "from shardings"),
            ("optimizer state", self.optimizer_bytes, "from shardings"),
            ("other (step, rng, ema)" if self.ema_bytes else "other state (step, rng)",
             self.other_state_bytes, "from shardings"),
            ("batch", self.batch_bytes, "from shardings"),
            ("arguments", self.argument_bytes, f"{by}: state + batch"),
            ("outputs", self.output_bytes, f"{by}: new state + metrics"),
            ("aliased (donated)", self.alias_bytes, f"{by}: outputs reusing arguments"),
            ("resident", self.resident_bytes, "arguments + outputs - aliased"),
            ("temporary", self.temp_bytes, f"{by}: activations, gradients, scratch"
             + (f" (one of {self.grad_accum} accumulated microbatches)"
                if self.grad_accum > 1 else "")),
            ("peak", self.peak_bytes, "resident + temporary + code"),
        ]
        lines += [f"  {name:<25}{human(value):>12}{value:>17,}  {note}"
                  for name, value, note in rows]
        lines.append(
            f"  {'available':<25}{human(self.available_bytes):>12}{self.available_bytes:>17,}  "
            f"{self.system}: {self.mem_fraction:.0%} of {human(self.device_memory_bytes)}"
        )
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  -> {verdict}: peak is {self.peak_bytes / self.available_bytes:.1%} "
                     f"of available")
        if self.layer_stacks:
            lines += ["", f"scanned layers: {len(self.layer_stacks)} parameters stacked along "
                          f"'layers' ({self.layer_stacks[0]['shape'][0]} layers)"]
            lines += [f"  {p['path']:<28}{str(tuple(p['shape'])):<22}"
                      f"{str(tuple(p['logical_axes'])):<36}{tuple(p['spec'])}"
                      for p in self.layer_stacks]
        if self.pipeline:
            p = self.pipeline
            circular = p["repeats"] > 1
            lines += ["", f"pipeline: {p['stages']} stages over {'+'.join(p['stage_axes'])}, "
                          f"{p['layers_per_stage']} layers per stage, {p['microbatches']} "
                          f"microbatches, schedule {p['schedule']}"
                          + (f", {p['repeats']} repeats (circular)" if circular else ""),
                      f"  bubble fraction (S - 1) / ({'R M' if circular else 'M'} + S - 1) = "
                      f"{p['bubble_fraction']:.3f}",
                      f"  stacked layers per device {human(p['stacked_bytes_per_device'])} "
                      f"({human(p['stacked_bytes_unstaged_per_device'])} without stages)",
                      f"  stage-to-stage transfers: {p['stage_transfers']} collective-permutes "
                      f"(static count), {human(p['stage_transfer_bytes'])} payload"]
        lines += ["", "FLOPs per step"]
        if self.flops_compiled is not None:
            lines.append(f"  compiled (XLA cost analysis, {self.compiler} compiler)  "
                         f"{self.flops_compiled:.4g} per device")
            if self.flops_analytic and self.flops_compiled < 0.8 * self.flops_analytic:
                lines.append("    (XLA counts a loop body once: with scanned layers "
                             "(model.scan_layers) this covers about one layer)")
        if self.flops_analytic is not None:
            lines.append(f"  analytic (the task's formula) {self.flops_analytic:.4g} per device, "
                         f"{self.flops_analytic * self.num_devices:.4g} total, "
                         f"{self.tokens_per_step:,} tokens/samples")
        lines += ["", f"collectives per step (per device; static count; {self.compiler} "
                      f"compiler)"]
        if not self.collectives:
            lines.append("  none")
        else:
            lines.append(f"  {'op':<20}{'count':>6}{'payload':>14}{'traffic (ring)':>16}  groups")
            for c in self.collectives:
                groups = ",".join(str(g) for g in sorted(set(c.group_sizes))) or "-"
                lines.append(f"  {c.op:<20}{c.count:>6}{human(c.bytes):>14}"
                             f"{human(c.traffic_bytes):>16}  {groups}")
        lines.append("")
        if self.compiler == "gpu":
            lines.append("note: memory, FLOPs and collectives are the GPU compiler's figures "
                         "for the system's GPU (nothing ran on it)")
        else:
            lines.append("note: memory and temporaries are the CPU compiler's figures; a GPU "
                         "compile fuses differently (see docs/performance.md)")
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / GiB:.3f} GiB"


def human(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------ HLO parsing


def _type_bytes(type_text: str) -> int:
    total = 0.0
    for m in _ARRAY.finditer(type_text):
        size = _DTYPE_BYTES.get(m.group("dtype"))
        if size is None:
            continue
        dims = [int(d) for d in m.group("dims").split(",") if d]
        total += size * math.prod(dims)
    return int(total)


def _group_size(attrs: str, num_devices: int) -> int | None:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\([^)]*\))? \{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in axes) if axes else num_devices
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    if "replica_groups={}" in attrs:
        return num_devices
    return None


def _traffic(op: str, nbytes: int, n: int | None) -> int:
    """Bytes a device sends for one collective under a ring algorithm (an estimate)."""
    if op == "collective-permute":
        return nbytes
    if not n or n <= 1:
        return 0
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
              "reduce-scatter": n - 1, "all-to-all": (n - 1) / n}[op]
    return int(nbytes * factor)


def collectives_from_hlo(hlo_text: str, num_devices: int) -> list[Collective]:
    """Count the collectives of a compiled (partitioned) HLO module, with their bytes.

    Synchronous ops count as themselves; asynchronous pairs (`all-gather-start` /
    `all-gather-done`, as GPUs emit) count once, sized by the `-done` result.
    """
    found: dict[str, Collective] = {}
    starts: dict[str, str] = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op = m.group("op")
        base = op.removesuffix("-start").removesuffix("-done")
        if base not in COLLECTIVES:
            continue
        if op.endswith("-start"):
            starts[m.group("name")] = m.group("attrs")
            continue
        attrs = m.group("attrs")
        if op.endswith("-done"):
            operand = m.group("operands").strip().lstrip("%").split(",")[0].strip()
            attrs = starts.get(operand, "")
        nbytes = _type_bytes(m.group("type"))
        n = _group_size(attrs, num_devices)
        c = found.setdefault(base, Collective(base))
        c.count += 1
        c.bytes += nbytes
        c.traffic_bytes += _traffic(base, nbytes, n)
        if n is not None:
            c.group_sizes.append(n)
    return [found[op] for op in COLLECTIVES if op in found]


# ------------------------------------------------------------------ the plan


def per_device_bytes(tree) -> int:
    """Bytes of one device's shard of every ShapeDtypeStruct/array leaf (by its sharding)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def target_memory(system: str | None) -> tuple[str, int, float]:
    """(name, device memory bytes, usable fraction) of the system to check against."""
    if system is None:
        return GENERIC_GPU[0], GENERIC_GPU[1], DEFAULT_MEM_FRACTION
    from spmd.hpc.systems import system_profile

    profile = system_profile(system)
    if not profile.device_memory_bytes:
        raise SpmdError(f"system '{system}' (--system) has no known device memory; "
                        f"choose a GPU system or leave --system out (generic 80 GB GPU)")
    fraction = float(profile.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    return profile.name, profile.device_memory_bytes, fraction


def compiled_flops(compiled) -> float | None:
    """XLA's FLOP count of a compiled program (None where the backend has none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None and flops >= 0 else None


def compiler_of(mesh) -> str:
    """"gpu" or "cpu": the platform of the devices the mesh (and so the compile) is for."""
    platform = str(getattr(mesh.devices.flat[0], "platform", "cpu")).lower()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def plan_from_compiled(rt, compiled, seconds: float, system: str | None = None,
                       config_name: str = "<config>", compiler_note: str = "") -> Plan:
    """The per-device figures of an executable compiled by `Runtime.compile_train_step`."""
    import jax

    name, memory, fraction = target_memory(system)
    cfg, state, n = rt.sections, rt.state.abstract, rt.mesh.size
    mem = compiled.memory_analysis()
    per_example = rt.task.flops_per_example()
    analytic = per_example * cfg.train.batch_size / n if per_example else None
    collectives = collectives_from_hlo(compiled.as_text(), n)
    return Plan(
        config=config_name, strategy=cfg.mesh.strategy, mesh=dict(rt.mesh.shape),
        num_devices=n, system=name, device_memory_bytes=memory, mem_fraction=fraction,
        param_bytes=per_device_bytes(state.params),
        optimizer_bytes=per_device_bytes(state.opt_state),
        other_state_bytes=(per_device_bytes(state.step) + per_device_bytes(state.rng)
                           + per_device_bytes(state.ema)),
        batch_bytes=per_device_bytes(rt.abstract_batch()),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes),
        flops_compiled=compiled_flops(compiled), flops_analytic=analytic,
        tokens_per_step=cfg.train.batch_size * rt.task.tokens_per_example(),
        collectives=collectives,
        compile_seconds=seconds, backend=jax.default_backend(),
        compiler=compiler_of(rt.mesh), compiler_note=compiler_note,
        layer_stacks=[{"path": p.path, "shape": list(p.shape),
                       "logical_axes": list(p.logical_axes),
                       "spec": [list(e) if isinstance(e, tuple) else e for e in p.spec]}
                      for p in rt.model.report.params
                      if p.logical_axes[:1] == ("layers",)],
        pipeline=_pipeline_figures(rt, collectives),
        grad_accum=cfg.train.grad_accum, ema_bytes=per_device_bytes(state.ema),
    )


def _pipeline_figures(rt, collectives: list[Collective]) -> dict | None:
    from spmd.engine.pipeline_checks import stage_summary

    summary = stage_summary(rt.model.report, rt.rules, rt.mesh, rt.pipeline)
    if summary is None:
        return None
    permutes = [c for c in collectives if c.op == "collective-permute"]
    return {**summary, "stage_transfers": sum(c.count for c in permutes),
            "stage_transfer_bytes": sum(c.bytes for c in permutes)}


def make_plan(cfg: Config, mesh, system: str | None = None, config_name: str = "<config>",
              runtime=None, compiler_note: str = "", task=None) -> Plan:
    """Compile the train step for `mesh` ahead of time and collect the per-device figures.

    `cfg` is split here, at the tool's entry: the task is built from it (or `task`), the
    engine gets its own sections (`EngineSections`). `runtime`: one already built.

    The compiler is the one of the mesh's devices: CPU stand-ins, or abstract CUDA devices
    from `spmd.aot.topologies.plan_devices` (the GPU compiler, for the profile's GPU).
    """
    target_memory(system)  # fail on a bad --system before compiling
    rt = runtime or plan_runtime(cfg, mesh, task)
    compiled, seconds = rt.compile_train_step()
    return plan_from_compiled(rt, compiled, seconds, system, config_name, compiler_note)


def plan_runtime(cfg: Config, mesh, task=None):
    """The runtime `make_plan` compiles, built but not compiled: building it runs every
    sharding, batch, pipeline and accumulation check (`spmd jobscript`, spmd.aot.job_check;
    pass it to `make_plan(runtime=)` to compile it)."""
    from spmd.config.load import build_task
    from spmd.engine.runtime import build_runtime

    return build_runtime(cfg.engine_sections(), mesh, task or build_task(cfg))
