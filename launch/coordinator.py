"""Choosing the coordinator address (`host:port` of rank 0) and waiting until it answers.

Chosen, not derived: with MPI, rank 0 binds a free port on its own address and broadcasts
`host:port`. Without MPI the port is derived from the job id, the Slurm step id and the
restart count, `61440 + crc32("JOB.STEP.RESTARTS") % 4096`, so that a requeued job (same id,
restart count + 1) does not meet its predecessor's port; the host is rank 0's node from the
scheduler (SPMD_COORDINATOR_HOST, the first node of SLURM_STEP_NODELIST, LSB_HOSTS or
PBS_NODEFILE), or 127.0.0.1 when every rank runs on this host.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from collections.abc import Mapping
from typing import Any

from spmd.launch import mpi
from spmd.launch.env import LaunchEnv
from spmd.launch.errors import LaunchError
from spmd.launch.nodes import first_host

PORT_BASE, PORT_SPAN = 61440, 4096


def own_address(hostname: str, environ: Mapping[str, str] | None = None) -> str:
    """An address of this host other ranks can reach: a non-loopback IPv4 of `hostname`;
    when the name resolves to loopback only (Debian's "127.0.1.1 HOST" line in /etc/hosts),
    the address this host sends from towards the launch node (`routed_address`); else the
    name. Never a loopback address: the other nodes would reach themselves."""
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    addrs = [i[4][0] for i in infos if not str(i[4][0]).startswith("127.")]
    if addrs:
        return str(addrs[0])
    return routed_address(os.environ if environ is None else environ) or hostname


def routed_address(environ: Mapping[str, str]) -> str | None:
    """This host's source address on the route to SLURM_LAUNCH_NODE_IPADDR (the node srun
    ran on; connecting a UDP socket sends nothing), if that is set and not loopback."""
    target = environ.get("SLURM_LAUNCH_NODE_IPADDR", "")
    if not target:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def derived_port(job_id: str, step_id: str, restart_count: int) -> int:
    """Port for a job without MPI: differs between steps and between restarts of one job."""
    return PORT_BASE + zlib.crc32(f"{job_id}.{step_id}.{restart_count}".encode()) % PORT_SPAN


def rank0_host(env: LaunchEnv, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(host of rank 0, where it came from) from the scheduler's variables, if knowable."""
    if environ.get("SPMD_COORDINATOR_HOST"):
        return environ["SPMD_COORDINATOR_HOST"], "SPMD_COORDINATOR_HOST"
    if env.local_size == env.size:
        return "127.0.0.1", f"all {env.size} ranks on this host ({env.sources['local_size']})"
    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(var):
            return first_host(environ[var]), f"first node of {var}"
    hosts = environ.get("LSB_HOSTS", "").split()
    if hosts:  # the first entry is the launch ("batch") node when it appears only once
        host = hosts[1] if len(hosts) > 1 and hosts.count(hosts[0]) == 1 else hosts[0]
        return host, "first compute node of LSB_HOSTS"
    nodefile = environ.get("PBS_NODEFILE")
    if nodefile:
        try:
            with open(nodefile) as fh:
                first = fh.readline().strip()
            if first:
                return first, "first line of PBS_NODEFILE"
        except OSError:
            pass
    return None


def choose(env: LaunchEnv, comm: Any, environ: Mapping[str, str],
           timeout_s: float) -> tuple[str | None, str]:
    """(coordinator "host:port" or None for one process, where it came from)."""
    if env.coordinator:
        return env.coordinator, env.sources["coordinator"]
    if env.size == 1:
        return None, "none needed (one process)"
    if comm is not None and comm.Get_size() == env.size:
        text = ""
        if env.rank == 0:
            host = ("127.0.0.1" if env.local_size == env.size
                    else own_address(env.hostname, environ))
            text = f"{host}:{free_port()}"
        addr = mpi.bcast_str(comm, text, 0, timeout_s, env.who, "receive the coordinator address")
        return addr, "rank 0 bound a free port on its address, broadcast over MPI"
    host = rank0_host(env, environ)
    if host is None or env.job_id is None:
        missing = "rank 0's host" if host is None else "a job id"
        raise LaunchError(
            f"{env.who}: cannot choose a coordinator for {env.size} ranks without MPI "
            f"({mpi.why()}): {missing} is unknown. Set SPMD_COORDINATOR=host:port (rank 0's "
            "host and a free port, the same on every rank), or launch through MPI")
    step = environ.get("SLURM_STEP_ID", "0")
    port = derived_port(env.job_id, step, env.restart_count)
    return (f"{host[0]}:{port}",
            f"host: {host[1]}; port derived from {env.sources['job_id']}, step {step} and "
            f"restart count {env.restart_count}")


def split(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise LaunchError(f"coordinator address {addr!r} is not of the form host:port")
    return host.strip("[]"), int(port)


def wait_reachable(addr: str, timeout_s: float, who: str) -> None:
    """Block until a TCP connect to `addr` succeeds; LaunchError after `timeout_s`."""
    host, port = split(addr)
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchError(
                f"{who}: the coordinator {addr} did not answer within {timeout_s:.0f} s "
                f"(last error: {last}). Check that rank 0 started and is running (its log), "
                f"that {host} is reachable from this host on TCP port {port} (network interface, "
                "firewall, SPMD_COORDINATOR), or raise launch.init_timeout_s")
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return
        except OSError as e:
            last = f"{type(e).__name__}: {e.strerror or e}"
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
