"""`LaunchEnv` and `resolve_launch_env`: who am I in this job, and where each answer came from.

Chain, first match wins: explicit SPMD_*/JAX_* -> Slurm step -> Flux -> LSF jsrun -> Cray PALS
-> Open MPI -> MPICH Hydra -> mpi4py -> single process. SPMD_LOCAL_RANK, SPMD_LOCAL_SIZE,
SPMD_NODE_ID and SPMD_COORDINATOR (or JAX_COORDINATOR_ADDRESS) override single values.

Nodes: with an MPI communicator, ranks are grouped by hostname (allgather); without one, by
the launcher's layout variables. `SPMD_PROCESSES_PER_NODE=P` (set by `spmd run`) instead makes
consecutive groups of P ranks stand for one node, so a single machine exercises multi-node
code paths. `local_rank`/`local_size` always describe the physical host (device binding).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from spmd.launch import schedulers
from spmd.launch.errors import LaunchError
from spmd.launch.nodes import group_by_key, local_position

LAUNCHERS = ("explicit", "slurm", "flux", "jsrun", "pals", "openmpi", "hydra", "mpi4py",
             "single")


@dataclass(frozen=True)
class LaunchEnv:
    """This rank's place in the job; `sources[field]` says where each value came from."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_id: int
    num_nodes: int
    hostname: str
    job_id: str | None
    restart_count: int
    launcher: str
    coordinator: str | None
    sources: dict[str, str] = field(default_factory=dict)
    node_of_rank: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["node_of_rank"] = list(self.node_of_rank)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @property
    def who(self) -> str:
        """"rank 3 on nid001" for messages."""
        return f"rank {self.rank} on {self.hostname}"


def _job_id(v: schedulers.Vars) -> tuple[str | None, str]:
    name = v.name("SPMD_JOB_ID", "SLURM_JOB_ID", "FLUX_JOB_ID", "LSB_JOBID", "PBS_JOBID",
                  "COBALT_JOBID")
    return (v.environ[name], name) if name else (None, "none of SPMD_JOB_ID/SLURM_JOB_ID/"
                                                 "FLUX_JOB_ID/LSB_JOBID/PBS_JOBID set")


def _restart_count(v: schedulers.Vars) -> tuple[int, str]:
    got = v.int("SPMD_RESTART_COUNT", "SLURM_RESTART_COUNT")
    return got if got else (0, "default (no SPMD_RESTART_COUNT/SLURM_RESTART_COUNT)")


def job_identity(environ: Mapping[str, str]) -> tuple[str | None, int]:
    """(job id, restart count) as `resolve_launch_env` reads them, for tools outside a rank."""
    v = schedulers.Vars(environ)
    return _job_id(v)[0], _restart_count(v)[0]


def _apply_overrides(f: schedulers.Found, v: schedulers.Vars) -> None:
    for attr, var in (("local_rank", "SPMD_LOCAL_RANK"), ("local_size", "SPMD_LOCAL_SIZE"),
                      ("node_id", "SPMD_NODE_ID")):
        got = v.int(var)
        if got is not None:
            setattr(f, attr, got[0])
            f.sources[attr] = var
            if attr == "node_id":
                f.node_of_rank = None  # the launcher's layout no longer applies


def _from_comm(f: schedulers.Found, v: schedulers.Vars, comm: Any, hostname: str,
               timeout_s: float) -> None:
    """Check the launcher against MPI, then group ranks into nodes by host (allgather)."""
    from spmd.launch import mpi

    csize, crank = comm.Get_size(), comm.Get_rank()
    where = f"MPI COMM_WORLD ({mpi.library_name()})"
    if f.launcher != "mpi4py" and (csize != f.size or crank != f.rank):
        hint = ("mpi4py's MPI library is not the one whose launcher started these ranks, or the "
                "launcher was not told to provide PMI (e.g. `srun --mpi=pmi2`); set SPMD_MPI=0 to "
                "launch without MPI" if csize == 1 else
                "the launcher variables do not describe this MPI job (inherited from an outer "
                "job step, or set by hand?); unset them or launch with the matching launcher")
        raise LaunchError(
            f"rank {f.rank} on {hostname}: the environment says rank {f.rank} of {f.size} "
            f"({f.sources['rank']}={f.rank}, {f.sources['size']}={f.size}) but {where} says rank "
            f"{crank} of {csize}: {hint}")
    node_key = v.environ.get("SPMD_NODE_ID") or hostname
    entries = mpi.allgather_str(comm, f"{hostname}\n{node_key}", timeout_s,
                                f"rank {crank} on {hostname}", "exchange host names")
    hosts = [e.split("\n", 1)[0] for e in entries]
    keys = [e.split("\n", 1)[1] for e in entries]
    f.node_of_rank = group_by_key(keys)
    f.sources["node_of_rank"] = ("SPMD_NODE_ID allgather over MPI" if v.name("SPMD_NODE_ID")
                                 else "hostname allgather over MPI")
    host_layout = group_by_key(hosts)
    lr, ls = local_position(host_layout, crank)
    if f.local_rank is None:
        f.local_rank, f.sources["local_rank"] = lr, "position among ranks on this host (MPI)"
    if f.local_size is None:
        f.local_size, f.sources["local_size"] = ls, "ranks on this host (MPI allgather)"


def _processes_per_node(f: schedulers.Found, v: schedulers.Vars) -> bool:
    got = v.int("SPMD_PROCESSES_PER_NODE")
    if got is None:
        return False
    per = got[0]
    if per < 1 or f.size % per:
        raise LaunchError(f"rank {f.rank}: SPMD_PROCESSES_PER_NODE={per} does not divide the "
                          f"{f.size} ranks of this job ({f.sources['size']}) into equal nodes")
    f.node_of_rank = tuple(r // per for r in range(f.size))
    f.sources["node_of_rank"] = f"SPMD_PROCESSES_PER_NODE={per}"
    return True


def resolve_launch_env(environ: Mapping[str, str] | None = None, mpi_comm: Any = None, *,
                       timeout_s: float = 300.0) -> LaunchEnv:
    """Resolve this rank's LaunchEnv from `environ` (and `mpi_comm` to group ranks by host)."""
    environ = os.environ if environ is None else environ
    v = schedulers.Vars(environ)
    hostname = socket.gethostname()
    found = schedulers.find(v)
    if found is None and mpi_comm is not None and mpi_comm.Get_size() > 1:
        found = schedulers.Found("mpi4py", mpi_comm.Get_rank(), mpi_comm.Get_size(),
                                 {"launcher": "mpi4py COMM_WORLD", "rank": "mpi4py COMM_WORLD",
                                  "size": "mpi4py COMM_WORLD"})
    if found is None:
        schedulers.check_not_bare_allocation(v, hostname)
        why = "single process (no launcher variables)"
        found = schedulers.Found("single", 0, 1, dict.fromkeys(
            ("launcher", "rank", "size", "local_rank", "local_size", "node_of_rank"), why),
            local_rank=0, local_size=1, node_of_rank=(0,))
    f = found
    _apply_overrides(f, v)
    env_node = f.node_id  # the launcher's (or SPMD_NODE_ID's) word, checked below
    if mpi_comm is not None and (f.size > 1 or mpi_comm.Get_size() > 1):
        _from_comm(f, v, mpi_comm, hostname, timeout_s)
        env_node = None
    if _processes_per_node(f, v):
        env_node = None
    schedulers.block_layout(f)
    node_of_rank = f.node_of_rank
    assert node_of_rank is not None
    if env_node is not None and node_of_rank[f.rank] != env_node:
        raise LaunchError(
            f"rank {f.rank} on {hostname}: {f.sources['node_id']}={env_node} but the node "
            f"layout ({f.sources['node_of_rank']}) puts this rank on node "
            f"{node_of_rank[f.rank]}; number ranks node by node, set SPMD_LOCAL_SIZE, or launch "
            "with MPI so that hosts can be compared")
    if env_node is None:
        f.sources["node_id"] = f.sources["node_of_rank"]
    f.sources["num_nodes"] = f.sources["node_of_rank"]
    if f.local_rank is None or f.local_size is None:
        lr, ls = local_position(node_of_rank, f.rank)
        if f.local_rank is None:
            f.local_rank, f.sources["local_rank"] = lr, "position in node layout"
        if f.local_size is None:
            f.local_size, f.sources["local_size"] = ls, "ranks in node layout"
    if f.local_rank >= f.local_size:
        raise LaunchError(f"rank {f.rank} on {hostname}: local rank {f.local_rank} "
                          f"({f.sources['local_rank']}) is not below the local size "
                          f"{f.local_size} ({f.sources['local_size']})")
    job_id, job_src = _job_id(v)
    restarts, restart_src = _restart_count(v)
    coord_var = v.name("SPMD_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
    sources = dict(f.sources)
    sources.update(hostname="socket.gethostname()", job_id=job_src, restart_count=restart_src,
                   coordinator=coord_var or "chosen at bootstrap")
    if f.size == 1 and not coord_var:
        sources["coordinator"] = "none needed (one process)"
    return LaunchEnv(
        rank=f.rank, size=f.size, local_rank=f.local_rank, local_size=f.local_size,
        node_id=node_of_rank[f.rank], num_nodes=max(node_of_rank) + 1, hostname=hostname,
        job_id=job_id, restart_count=restarts, launcher=f.launcher,
        coordinator=environ[coord_var] if coord_var else None, sources=sources,
        node_of_rank=tuple(node_of_rank))
