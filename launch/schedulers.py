"""What each launcher sets: one reader per launcher, in the order of the resolution chain.

A reader returns a `Found` (rank, size and whatever else that launcher tells) or None when
its variables are absent. Malformed values raise LaunchError naming the variable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from spmd.launch.errors import LaunchError
from spmd.launch.nodes import distribute, parse_tasks_per_node


@dataclass
class Found:
    launcher: str
    rank: int
    size: int
    sources: dict[str, str] = field(default_factory=dict)
    local_rank: int | None = None
    local_size: int | None = None
    node_id: int | None = None
    num_nodes: int | None = None
    node_of_rank: tuple[int, ...] | None = None


class Vars:
    """Typed access to an environment that records where each value came from."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def name(self, *names: str) -> str | None:
        """The first of `names` that is set (non-empty)."""
        return next((n for n in names if self.environ.get(n, "") != ""), None)

    def int(self, *names: str) -> tuple[int, str] | None:
        """(value, variable) of the first of `names` that is set, parsed as a non-negative int."""
        name = self.name(*names)
        if name is None:
            return None
        text = self.environ[name].strip()
        try:
            value = int(text)
        except ValueError:
            raise LaunchError(f"environment variable {name}={text!r} is not an integer") from None
        if value < 0:
            raise LaunchError(f"environment variable {name}={value} is negative")
        return value, name


def _found(v: Vars, launcher: str, rank: tuple[str, ...], size: tuple[str, ...],
           local_rank: tuple[str, ...] = (), local_size: tuple[str, ...] = (),
           node_id: tuple[str, ...] = (), num_nodes: tuple[str, ...] = ()) -> Found | None:
    r = v.int(*rank)
    if r is None:
        return None
    s = v.int(*size)
    if s is None:
        raise LaunchError(f"{r[1]}={r[0]} is set but none of {', '.join(size)} is: "
                          f"cannot tell the number of ranks of this {launcher} launch")
    if s[0] < 1 or r[0] >= s[0]:
        raise LaunchError(f"{r[1]}={r[0]} is not a rank of a job of {s[1]}={s[0]} ranks")
    f = Found(launcher, r[0], s[0], {"launcher": r[1], "rank": r[1], "size": s[1]})
    for attr, names in (("local_rank", local_rank), ("local_size", local_size),
                        ("node_id", node_id), ("num_nodes", num_nodes)):
        got = v.int(*names) if names else None
        if got is not None:
            setattr(f, attr, got[0])
            f.sources[attr] = got[1]
    return f


def explicit(v: Vars) -> Found | None:
    r = v.int("SPMD_RANK", "JAX_PROCESS_ID")
    s = v.int("SPMD_SIZE", "JAX_NUM_PROCESSES")
    if (r is None) != (s is None):
        have, missing = ((r, "SPMD_SIZE (or JAX_NUM_PROCESSES)") if r else
                         (s, "SPMD_RANK (or JAX_PROCESS_ID)"))
        raise LaunchError(f"{have[1]}={have[0]} is set but {missing} is not: "
                          "set both (or neither, to let the scheduler's variables decide)")
    if r is None:
        return None
    return _found(v, "explicit", (r[1],), (s[1],))


def slurm(v: Vars) -> Found | None:
    f = _found(v, "slurm", ("SLURM_PROCID",), ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                                                "SLURM_NPROCS"),
               local_rank=("SLURM_LOCALID",), node_id=("SLURM_NODEID",),
               num_nodes=("SLURM_STEP_NUM_NODES", "SLURM_NNODES"))
    if f is None:
        return None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = v.environ.get(name, "")
        if not text:
            continue
        try:
            counts = parse_tasks_per_node(text)
        except ValueError:
            raise LaunchError(f"cannot parse {name}={text!r} (expected e.g. '2(x3),1')") from None
        if sum(counts) != f.size:
            continue
        dist = v.environ.get("SLURM_DISTRIBUTION", "block").split(":")[0].split(",")[0]
        block = 1 if dist == "cyclic" else None
        if dist.startswith("plane="):
            block = int(dist.split("=", 1)[1] or 1)
        f.node_of_rank = distribute(counts, block)
        where = f"{name} ({dist} distribution)"
        f.sources["node_of_rank"] = where
        if f.node_id is not None and f.node_id < len(counts):
            f.local_size = counts[f.node_id]
            f.sources["local_size"] = f"{name}[SLURM_NODEID]"
        break
    return f


def flux(v: Vars) -> Found | None:
    return _found(v, "flux", ("FLUX_TASK_RANK",), ("FLUX_JOB_SIZE",),
                  local_rank=("FLUX_TASK_LOCAL_ID",), num_nodes=("FLUX_JOB_NNODES",))


def jsrun(v: Vars) -> Found | None:
    return _found(v, "jsrun", ("JSM_NAMESPACE_RANK",), ("JSM_NAMESPACE_SIZE",),
                  local_rank=("JSM_NAMESPACE_LOCAL_RANK",),
                  local_size=("JSM_NAMESPACE_LOCAL_SIZE",))


def pals(v: Vars) -> Found | None:
    return _found(v, "pals", ("PALS_RANKID",), ("PMI_SIZE", "PALS_SIZE"),
                  local_rank=("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
                  local_size=("PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE"), node_id=("PALS_NODEID",))


def openmpi(v: Vars) -> Found | None:
    f = _found(v, "openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",),
               local_rank=("OMPI_COMM_WORLD_LOCAL_RANK",),
               local_size=("OMPI_COMM_WORLD_LOCAL_SIZE",))
    if f is not None:
        version = ("Open MPI 4, OMPI_MCA_orte_hnp_uri" if v.name("OMPI_MCA_orte_hnp_uri")
                   else "Open MPI 5, PMIX_RANK" if v.name("PMIX_RANK") else "Open MPI")
        f.sources["launcher"] = f"OMPI_COMM_WORLD_RANK ({version})"
    return f


def hydra(v: Vars) -> Found | None:
    return _found(v, "hydra", ("PMI_RANK",), ("PMI_SIZE",),
                  local_rank=("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
                  local_size=("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"))


CHAIN: tuple[Callable[[Vars], Found | None], ...] = (
    explicit, slurm, flux, jsrun, pals, openmpi, hydra)


def find(v: Vars) -> Found | None:
    """What the first launcher of the chain whose variables are set tells (None: none is)."""
    return next((f for f in (reader(v) for reader in CHAIN) if f is not None), None)


def block_layout(f: Found) -> None:
    """Fill `f.node_of_rank` assuming ranks are numbered node by node (no MPI to ask hosts)."""
    if f.node_of_rank is not None:
        return
    per_node, why = f.local_size, f.sources.get("local_size")
    if per_node is None and f.num_nodes:
        per_node = math.ceil(f.size / f.num_nodes)
        why = f"{f.sources['size']}/{f.sources['num_nodes']}"
    if per_node is None:
        per_node, why = 1, "no local size known: one rank per node"
    per_node = max(1, per_node)
    f.node_of_rank = tuple(r // per_node for r in range(f.size))
    f.sources["node_of_rank"] = f"block layout, {per_node} ranks per node ({why})"


# Inside an allocation but not started by its launcher: (job variable, step variables, launcher)
ALLOCATIONS = (
    ("SLURM_JOB_ID", ("SLURM_PROCID",), "srun", "srun -n N spmd train CONFIG"),
    ("LSB_JOBID", ("JSM_NAMESPACE_RANK",), "jsrun", "jsrun -n N spmd train CONFIG"),
    ("PBS_JOBID", ("PALS_RANKID", "PMI_RANK"), "mpiexec", "mpiexec -n N spmd train CONFIG"),
    ("FLUX_JOB_ID", ("FLUX_TASK_RANK",), "flux run", "flux run -n N spmd train CONFIG"),
)


def check_not_bare_allocation(v: Vars, hostname: str) -> None:
    """Raise when this process runs inside a batch allocation but outside a launcher step."""
    for job_var, step_vars, launcher, example in ALLOCATIONS:
        if v.name(job_var) and not v.name(*step_vars):
            raise LaunchError(
                f"process on {hostname}: {job_var}={v.environ[job_var]} says this runs inside a "
                f"batch allocation, but {' / '.join(step_vars)} is not set, so it was not started "
                f"by {launcher}: run it under {launcher} (e.g. `{example}`), "
                "or set SPMD_RANK=0 SPMD_SIZE=1 to run a single process on purpose")
