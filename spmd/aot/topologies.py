"""Which devices (and so which compiler) `spmd plan` compiles for.

On a machine with one NVIDIA GPU and an NVIDIA `--system` profile, the plan compiles with
the GPU compiler for the profile's device, for all N devices, through an abstract CUDA
topology: `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=<gpu_target_config text proto>, topology="1x1xN")` (measured to work with
jax 0.11.2 and one H100 visible; jax#23971 says it does not without a GPU). Everywhere else
the plan compiles for N CPU stand-in devices, and says so: every Plan carries `compiler`.

Invariant: `plan_devices` decides before JAX starts its backends when it can (it must set
`JAX_NUM_CPU_DEVICES` first); a GPU path that fails falls back to the CPU devices of the
same process and records why in the compiler note.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from spmd.errors import SpmdError

# Minimal gpu_target_config protos (fields present in XLA's GPU target config since 2024;
# values from openxla/xla's h100_sxm / a100 specs). device_memory_size is filled per profile.
_SM90 = dict(core_count=132, clock_rate_ghz=1.98, memory_bandwidth=3352320000000,
             l2_cache_size=52428800, shared_memory_per_block_optin=232448,
             shared_memory_per_core=233472, major=9, minor=0)
_SM80 = dict(core_count=108, clock_rate_ghz=1.41, memory_bandwidth=2039000000000,
             l2_cache_size=41943040, shared_memory_per_block_optin=166912,
             shared_memory_per_core=167936, major=8, minor=0)
ARCHITECTURES = (("H200", _SM90), ("GH200", _SM90), ("H100", _SM90), ("A100", _SM80))

_TEMPLATE = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {memory_bandwidth}
  l2_cache_size: {l2_cache_size}
  clock_rate_ghz: {clock_rate_ghz}
  device_memory_size: {device_memory_size}
  shared_memory_per_block_optin: {shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 1
}}
device_description_str: "{device_kind}"
"""


@dataclass(frozen=True)
class PlanDevices:
    """The devices to build the mesh over, and which compiler produces the plan's figures."""

    devices: list
    compiler: str          # "gpu" or "cpu"
    note: str              # e.g. "cuda topology 1x1x8, NVIDIA H100 80GB HBM3 target config"


def gpu_target_config(device_kind: str, device_memory_bytes: int) -> str | None:
    """A gpu_target_config text proto for a profile's NVIDIA device, or None if unknown.

    `SPMD_GPU_TARGET_CONFIG=FILE` overrides it (e.g. one dumped by XLA for the exact GPU).
    """
    override = os.environ.get("SPMD_GPU_TARGET_CONFIG")
    if override:
        return Path(override).read_text()
    for name, spec in ARCHITECTURES:
        if name.lower() in device_kind.lower():
            return _TEMPLATE.format(device_memory_size=device_memory_bytes,
                                    device_kind=device_kind, **spec)
    return None


def gpu_topology_devices(device_kind: str, device_memory_bytes: int, n: int) -> list:
    """N abstract CUDA devices of `device_kind`, compiled for by the GPU compiler.

    Needs a visible NVIDIA GPU (the CUDA plugin compiles; nothing runs on it). Not run in
    CI (no GPU there); raises on any failure so the caller can fall back.
    """
    from jax.experimental import topologies

    config = gpu_target_config(device_kind, device_memory_bytes)
    if config is None:
        raise SpmdError(f"no GPU target config for '{device_kind}'")
    topology = topologies.get_topology_desc(platform="cuda", target_config=config,
                                            topology=f"1x1x{n}")
    devices = list(topology.devices)
    if len(devices) != n:
        raise SpmdError(f"cuda topology 1x1x{n} has {len(devices)} devices")
    return devices


def _nvidia_profile(system: str | None):
    if system is None:
        return None
    from spmd.hpc.systems import system_profile

    profile = system_profile(system)
    kind = (profile.device_kind or "")
    return profile if "nvidia" in kind.lower() and profile.device_memory_bytes else None


def _cpu_devices(n: int) -> list:
    import jax

    devices = jax.devices("cpu")
    if len(devices) < n:
        raise SpmdError(f"--devices {n}: this process already runs JAX with {len(devices)} "
                        f"CPU devices; run the command in a fresh process")
    return devices[:n]


def plan_devices(n: int, system: str | None) -> PlanDevices:
    """GPU-compiler devices for an NVIDIA profile when a GPU is visible, else CPU stand-ins."""
    from spmd.aot.stand_ins import cpu_stand_in_devices

    profile = _nvidia_profile(system)
    forced_cpu = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if profile is None or forced_cpu:
        why = "no NVIDIA --system profile" if profile is None else "JAX_PLATFORMS=cpu"
        return PlanDevices(cpu_stand_in_devices(n), "cpu", f"{n} CPU stand-in devices ({why})")
    if n < 1:
        raise SpmdError(f"--devices {n}: must be at least 1")
    # Keep the GPU backend possible, and give the CPU backend N devices for the fallback.
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    if "jax" in sys.modules:
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass
    import jax

    try:
        gpus = [d for d in jax.devices("gpu") if "nvidia" in d.device_kind.lower()]
    except RuntimeError:
        gpus = []
    if not gpus:
        return PlanDevices(_cpu_devices(n), "cpu",
                           f"{n} CPU stand-in devices (no NVIDIA GPU visible here)")
    try:
        devices = gpu_topology_devices(profile.device_kind, profile.device_memory_bytes, n)
    except Exception as e:  # noqa: BLE001 - any failure: the CPU compiler, with the reason
        return PlanDevices(_cpu_devices(n), "cpu",
                           f"{n} CPU stand-in devices (GPU topology failed: {e})")
    return PlanDevices(devices, "gpu",
                       f"cuda topology 1x1x{n}, {profile.device_kind} target config")
