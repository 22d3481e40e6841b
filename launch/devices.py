"""Which devices this rank drives, decided from what it can see, without starting a backend.

GPUs are counted from CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES, else
the /dev/nvidia* or /sys/class/kfd nodes. With L ranks on this host and n GPUs visible:
one rank per host -> all n; n == 1 -> [0] (the scheduler bound one GPU per rank);
n == L -> [local_rank]; n a multiple of L -> a block of n/L; anything else is a LaunchError.
CPU mode (JAX_PLATFORMS=cpu, or no GPU usable) takes JAX_NUM_CPU_DEVICES devices per process
and gloo collectives.
"""

from __future__ import annotations

import glob
import os
import pkgutil
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from spmd.launch.env import LaunchEnv
from spmd.launch.errors import LaunchError

GPU_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@dataclass(frozen=True)
class DevicePlan:
    platform: str                           # "cpu" or "gpu"
    reason: str                             # why that platform
    visible_gpus: int
    visible_from: str                       # where the GPU count came from
    local_device_ids: tuple[int, ...] | None  # GPUs this rank drives (None on CPU)
    cpu_devices: int | None                 # JAX_NUM_CPU_DEVICES, CPU mode only

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.local_device_ids is not None:
            d["local_device_ids"] = list(self.local_device_ids)
        return d


def _count_list(text: str) -> int:
    """Devices named by a *_VISIBLE_DEVICES value (the runtime stops at the first invalid)."""
    n = 0
    for item in text.split(","):
        item = item.strip()
        if not item or item == "NoDevFiles" or item.startswith("-"):
            break
        n += 1
    return n


def count_visible_gpus(environ: Mapping[str, str]) -> tuple[int, str]:
    """(number of GPUs this process can see, where that was read)."""
    for var in GPU_VARS:  # HIP indexes into what ROCR leaves visible, so it counts first
        if var in environ:
            return _count_list(environ[var]), f"{var}={environ[var]!r}"
    nvidia = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    if nvidia:
        return len(nvidia), f"{len(nvidia)} /dev/nvidiaN device files"
    kfd = 0
    for path in glob.glob("/sys/class/kfd/kfd/topology/nodes/*/gpu_id"):
        try:
            with open(path) as fh:
                kfd += fh.read().strip() not in ("", "0")
        except OSError:
            pass
    if kfd:
        return kfd, f"{kfd} GPU nodes under /sys/class/kfd"
    return 0, "no *_VISIBLE_DEVICES variable, /dev/nvidiaN or /sys/class/kfd GPU"


def gpu_plugin() -> str | None:
    """Name of an installed JAX CUDA/ROCm plugin module, if any."""
    for mod in pkgutil.iter_modules():
        if re.fullmatch(r"jax_(cuda|rocm)\d*_plugin", mod.name):
            return mod.name
    return None


def _platform(environ: Mapping[str, str], visible: int, where: str) -> tuple[str, str]:
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        if platforms[0] == "cpu":
            return "cpu", f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}"
        if platforms[0] in ("cuda", "gpu", "rocm"):
            return "gpu", f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}"
    if visible == 0:
        return "cpu", f"no GPU visible ({where})"
    plugin = gpu_plugin()
    if plugin is None:
        return "cpu", f"{visible} GPU(s) visible but no jax CUDA/ROCm plugin is installed"
    return "gpu", f"{visible} GPU(s) visible ({where}), {plugin} installed"


def plan(env: LaunchEnv, environ: Mapping[str, str] | None = None) -> DevicePlan:
    """Decide platform and device ids for this rank; LaunchError when they cannot fit."""
    environ = os.environ if environ is None else environ
    visible, where = count_visible_gpus(environ)
    platform, reason = _platform(environ, visible, where)
    if platform == "cpu":
        n = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
        if n and not (n.isdigit() and int(n) > 0):
            raise LaunchError(f"{env.who}: JAX_NUM_CPU_DEVICES={n!r} is not a positive integer")
        return DevicePlan("cpu", reason, visible, where, None, int(n) if n else None)
    per_host = env.local_size
    if visible == 0:
        raise LaunchError(f"{env.who}: {reason} but this rank sees no GPU ({where})")
    if per_host == 1:
        ids = tuple(range(visible))
    elif visible == 1:
        ids = (0,)
    elif visible % per_host == 0:
        k = visible // per_host
        ids = tuple(range(env.local_rank * k, (env.local_rank + 1) * k))
    else:
        raise LaunchError(
            f"{env.who}: sees {visible} GPUs ({where}) but {per_host} ranks share this host "
            f"({env.sources['local_size']}); expected every rank to see all GPUs (a multiple "
            f"of {per_host}), or exactly one (e.g. srun --gpus-per-task=1, jsrun -g1). Fix the "
            "launcher's GPU binding or the number of ranks per node")
    return DevicePlan("gpu", reason, visible, where, ids, None)


def apply(device_plan: DevicePlan, environ: Mapping[str, str] | None = None) -> None:
    """Configure JAX for the plan; call before anything initializes a JAX backend."""
    import jax

    environ = os.environ if environ is None else environ
    if device_plan.platform != "cpu" or _backend_started():
        return  # GPU ids go to jax.distributed.initialize; a started backend cannot change
    settings = {"jax_cpu_collectives_implementation": "gloo"}
    if not environ.get("JAX_PLATFORMS"):
        settings["jax_platforms"] = "cpu"
    if device_plan.cpu_devices:
        settings["jax_num_cpu_devices"] = device_plan.cpu_devices
    for name, value in settings.items():
        try:
            if getattr(jax.config, name) != value:
                jax.config.update(name, value)
        except (AttributeError, KeyError, ValueError):  # an option renamed in some future jax
            pass


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False
