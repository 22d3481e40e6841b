"""System profiles: scheduler, GPUs and their memory, launcher line and environment per machine.

All machine-specific data lives here; `spmd jobscript` renders it into a batch script (and
checks the config for the world it gives: nodes x the devices each node's ranks drive) and
`spmd plan` reads `gpus_per_node` / `device_memory_bytes`. Add a system by adding a
`SystemProfile` to `SYSTEMS`; its `setup` lines are the site's environment set-up (module
loads) that every script of the system runs before the launch line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from spmd.errors import SpmdError

Scheduler = Literal["slurm", "lsf", "pbs", "flux"]
GiB = 1 << 30

# XLA flags of the fastest JAX codes on NVIDIA/AMD GPUs (NVIDIA JAX-Toolbox guide, MaxText gpu
# configs): overlap collectives with compute, combine collectives into few large ones (>= one
# layer's weights), double-buffer the layer scan. Every flag must parse in the installed jaxlib
# (XLA aborts on an unknown flag): tests/unit/hpc/test_jobscript.py checks them.
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
)

NVIDIA_GPU_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # one work queue: keeps compute/comm overlap in order
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90",
}
_AMD_ENV = {
    "GPU_MAX_HW_QUEUES": "2",  # ROCm's counterpart of CUDA_DEVICE_MAX_CONNECTIONS
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90",
}
# NCCL over HPE Slingshot 11 through the aws-ofi-nccl plugin (ALCF, NERSC, CSCS guidance).
_SLINGSHOT_NCCL_ENV = {
    "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_CROSS_NIC": "1",
    "NCCL_SOCKET_IFNAME": "hsn",
    "FI_CXI_DISABLE_HOST_REGISTER": "1",
    "FI_MR_CACHE_MONITOR": "userfaultfd",
    "FI_CXI_DEFAULT_CQ_SIZE": "131072",
}
# RCCL over Slingshot through aws-ofi-rccl (OLCF Frontier guidance).
_SLINGSHOT_RCCL_ENV = {
    "NCCL_NET_GDR_LEVEL": "3",
    "NCCL_CROSS_NIC": "1",
    "NCCL_SOCKET_IFNAME": "hsn0",
    "FI_CXI_ATS": "0",
    "FI_MR_CACHE_MONITOR": "userfaultfd",
}


def _env(*parts: Mapping[str, str]) -> Mapping[str, str]:
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    return MappingProxyType(merged)


@dataclass(frozen=True)
class SystemProfile:
    """One machine (or scheduler family): what a job script needs to know about it.

    `launcher` is a `str.format` template with {nodes}, {ranks}, {ranks_per_node},
    {cpus_per_task}, {gpus_per_node} and {bind} (the device-binding wrapper, or "").
    `directives` are extra scheduler options (same fields), one per line, rendered after the
    directive prefix (`#SBATCH`, `#BSUB`, `#PBS`, `#flux:`). `account_option` / `queue_option` are
    templates for the account (project, bank) and queue (partition, QOS) options.
    `gpus_per_rank` is 1 where the launcher binds one GPU to each rank (`--gpus-per-task=1`,
    `jsrun -g1`, a binding wrapper); None where every rank sees all the node's GPUs and takes
    an equal share of them (spmd.launch.devices). `setup` holds shell lines (e.g. `module load
    ...`) that the script runs before the environment exports and the launch line;
    `spmd jobscript --setup` appends the user's own.
    """

    name: str
    scheduler: Scheduler
    description: str
    gpus_per_node: int
    ranks_per_node: int
    device_kind: str
    device_memory_bytes: int | None  # per device (GPU or GCD); None = unknown
    cpus_per_task: int | None         # None = the scheduler's default
    launcher: str
    account_option: str
    queue_option: str
    default_queue: str | None = None
    requires_account: bool = False
    directives: tuple[str, ...] = ()
    xla_flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    bind_wrapper: str | None = None  # shell body of a per-rank device-binding wrapper
    mpi: str | None = None            # srun --mpi=...; None = the site default
    gpus_per_rank: int | None = None  # 1: the launcher binds one GPU per rank; None: shared
    setup: tuple[str, ...] = ()       # site set-up lines, run before the launch line


# Polaris: ALCF's set_affinity_gpu_polaris.sh, reversed because of the CPU-GPU affinity.
_POLARIS_BIND = """\
local_rank=${PALS_LOCAL_RANKID:-${PMI_LOCAL_RANK:-}}
if [ -z "$local_rank" ]; then
  echo "spmd bind: neither PALS_LOCAL_RANKID nor PMI_LOCAL_RANK is set; run under mpiexec" >&2
  exit 70
fi
export CUDA_VISIBLE_DEVICES=$(( {gpus_per_node} - 1 - local_rank % {gpus_per_node} ))
exec "$@"
"""

_PERLMUTTER = SystemProfile(
    name="perlmutter",
    scheduler="slurm",
    description="NERSC Perlmutter GPU: 4 NVIDIA A100 40 GB per node",
    gpus_per_node=4,
    ranks_per_node=4,
    device_kind="NVIDIA A100-SXM4-40GB",
    device_memory_bytes=40 * GiB,
    cpus_per_task=32,
    launcher=("srun -N{nodes} -n{ranks} --ntasks-per-node={ranks_per_node} "
              "-c{cpus_per_task} --cpu-bind=cores --gpus-per-node={gpus_per_node}"),
    account_option="--account={}",
    queue_option="--qos={}",
    default_queue="regular",
    requires_account=True,
    directives=("-C gpu", "--gpus-per-node={gpus_per_node}"),
    xla_flags=GPU_XLA_FLAGS,
    env=_env(NVIDIA_GPU_ENV, _SLINGSHOT_NCCL_ENV),
)


SYSTEMS: dict[str, SystemProfile] = {
    p.name: p
    for p in (
        SystemProfile(
            name="slurm",
            scheduler="slurm",
            description="any Slurm cluster; ranks per node and GPUs per node from the options",
            gpus_per_node=0,
            ranks_per_node=1,
            device_kind="cpu (set --gpus-per-node for GPUs)",
            device_memory_bytes=None,
            cpus_per_task=1,
            launcher=("srun --mpi={mpi} --nodes={nodes} --ntasks={ranks} "
                      "--ntasks-per-node={ranks_per_node} --cpus-per-task={cpus_per_task}"),
            account_option="--account={}",
            queue_option="--partition={}",
            mpi="pmi2",
        ),
        SystemProfile(
            name="frontier",
            scheduler="slurm",
            description="OLCF Frontier: 8 GCDs (4 AMD MI250X) per node, one rank per GCD",
            gpus_per_node=8,
            ranks_per_node=8,
            device_kind="AMD MI250X GCD",
            device_memory_bytes=64 * GiB,
            cpus_per_task=7,
            launcher=("srun -N{nodes} -n{ranks} --ntasks-per-node={ranks_per_node} "
                      "-c{cpus_per_task} --gpus-per-task=1 --gpu-bind=closest"),
            account_option="--account={}",
            queue_option="--partition={}",
            requires_account=True,
            xla_flags=GPU_XLA_FLAGS,
            env=_env(_AMD_ENV, _SLINGSHOT_RCCL_ENV),
            gpus_per_rank=1,
            # OLCF's JAX guidance (olcf-user-docs software/analytics/jax.rst): the GNU
            # programming environment and ROCm 7 (the jax-rocm7 plugin loads the site's ROCm
            # libraries; docs/install.md)
            setup=("module load PrgEnv-gnu", "module load rocm/7.2.0",
                   "module load craype-accel-amd-gfx90a"),
        ),
        _PERLMUTTER,
        dataclasses.replace(
            _PERLMUTTER, name="perlmutter-80g",
            description="NERSC Perlmutter GPU, 80 GB nodes: 4 NVIDIA A100 80 GB per node",
            device_kind="NVIDIA A100-SXM4-80GB", device_memory_bytes=80 * GiB,
            directives=("-C gpu&hbm80g", "--gpus-per-node={gpus_per_node}"),
        ),
        SystemProfile(
            name="summit",
            scheduler="lsf",
            description="OLCF Summit-class LSF + jsrun: 6 NVIDIA V100 16 GB per node",
            gpus_per_node=6,
            ranks_per_node=6,
            device_kind="NVIDIA V100-SXM2-16GB",
            device_memory_bytes=16 * GiB,
            cpus_per_task=7,
            launcher="jsrun -n{ranks} -r{ranks_per_node} -a1 -c{cpus_per_task} -g1",
            account_option="-P {}",
            queue_option="-q {}",
            requires_account=True,
            directives=('-alloc_flags "gpumps smt1"',),
            xla_flags=GPU_XLA_FLAGS,
            env=_env(NVIDIA_GPU_ENV),
            gpus_per_rank=1,
        ),
        SystemProfile(
            name="polaris",
            scheduler="pbs",
            description="ALCF Polaris: PBS Pro + Cray PALS mpiexec, 4 NVIDIA A100 40 GB per node",
            gpus_per_node=4,
            ranks_per_node=4,
            device_kind="NVIDIA A100-SXM4-40GB",
            device_memory_bytes=40 * GiB,
            cpus_per_task=8,
            launcher=("mpiexec -n {ranks} -ppn {ranks_per_node} --depth={cpus_per_task} "
                      "--cpu-bind depth {bind}"),
            account_option="-A {}",
            queue_option="-q {}",
            default_queue="prod",
            requires_account=True,
            directives=("-l select={nodes}:system=polaris", "-l place=scatter",
                        "-l filesystems=home:eagle"),
            xla_flags=GPU_XLA_FLAGS,
            env=_env(NVIDIA_GPU_ENV, _SLINGSHOT_NCCL_ENV),
            bind_wrapper=_POLARIS_BIND,
            gpus_per_rank=1,
        ),
        SystemProfile(
            name="flux",
            scheduler="flux",
            description="Flux (El Capitan-class): 4 AMD MI300A APUs per node, one rank each",
            gpus_per_node=4,
            ranks_per_node=4,
            device_kind="AMD MI300A",
            device_memory_bytes=128 * GiB,
            cpus_per_task=None,
            launcher="flux run -N{nodes} -n{ranks} -g1",
            account_option="--bank={}",
            queue_option="--queue={}",
            xla_flags=GPU_XLA_FLAGS,
            env=_env(_AMD_ENV, _SLINGSHOT_RCCL_ENV),
            gpus_per_rank=1,
        ),
    )
}


def system_profile(name: str) -> SystemProfile:
    """The profile called `name`; SpmdError naming the valid names otherwise."""
    try:
        return SYSTEMS[name]
    except KeyError:
        raise SpmdError(f"unknown system '{name}' (--system); valid systems: "
                        f"{', '.join(SYSTEMS)}") from None
