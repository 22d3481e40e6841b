"""A real multi-node Slurm on this one machine: every node its own network, UTS and mount namespace.

Why: a "node-local" directory, a partner copy "on another node", a coordinator "on rank 0's
node" all mean nothing while every rank shares one hostname, one address and one disk. Here
each node is separate in exactly those three ways, with real Debian `slurm-wlm` daemons:

    head   netns  <prefix>-head: bridge br0 10.231.0.1/24; slurmctld (hostname "head")
    nodeI  netns  <prefix>-nodeI: eth0 10.231.0.(10+I)/24, a veth whose peer sits on br0;
           `slurmd -D -N nodeI` in its own mount + UTS namespace (unshare), where
           hostname = nodeI, /local = <root>/nodes/nodeI/local (bind mount), /dev/shm = a tmpfs
           of its own (MPI's shared-memory segments stay on their node), /etc/hosts = the
           cluster's host table (head, node1..nodeN). The rest of the file system is shared,
           like a parallel file system (run directories, the checkout, the Python install).

Everything srun starts on a node is a child of that node's slurmd, so it inherits the node's
namespaces: it sees the node's hostname, address and /local. The root namespace gets no address
and no route: the bridge lives inside the head namespace, and a node's only route is
10.231.0.0/24, so no process of the cluster can reach any address outside the namespaces the
cluster made (a connect elsewhere fails with ENETUNREACH). munged is the machine's (its socket
is a file, reachable from every mount namespace); `ensure_munge` starts it when needed.

API (`NetnsCluster`, what `start_netns_cluster()` and the `netns_cluster` fixture return):
    cluster.nodes                 ["node1", ..., "node5"]; cluster.addr["node2"] = "10.231.0.12"
    cluster.run(*cmd)             any command on the login side (head netns): sbatch, srun,
                                  scontrol, squeue, `python -m spmd.cli ...`; `cluster.env`
                                  is its environment (SLURM_CONF set)
    cluster.sbatch(script, *args) submit a script (text or path) -> job id; then
    cluster.wait_finished(job)    / wait_for / job_info / state / describe (SlurmCluster's)
    cluster.exec_on(node, *cmd)   run a command inside a node's namespaces (its /local, hostname)
    cluster.local(node)           the host path of a node's /local (read it from the test)
    cluster.node_pids(node)       pids of every process in the node's network namespace
    cluster.kill_node(node)       SIGKILL all of them (slurmd, slurmstepd, ranks), by pid, and
                                  delete its /local; Slurm is not told (it notices after
                                  SlurmdTimeout, 10 s) unless mark_down=True
    cluster.revive_node(node)     an empty /local and a fresh slurmd; back to idle in Slurm
    cluster.idle_nodes()          node names Slurm reports idle
    cluster.stop()                cancel jobs, kill every process in the cluster's namespaces
                                  (by pid), delete the namespaces (their links and mounts go
                                  with them) and the temp root. Idempotent; also runs at exit,
                                  and at the next start for clusters whose creator died.

Prerequisites: root, `ip` (iproute2) with netns/bridge/veth, `nsenter` and `unshare`
(util-linux), slurm-wlm + munge (installed by apt like the one-node cluster). When one is
missing the fixture skips, or fails when CI=true. Start-up takes a few seconds.
Standalone: `python -m tests.helpers.netns_cluster [N]` starts N nodes (default 5) and prints
how to reach them, until Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from spmd.launch.watchdog import process_alive
from tests.helpers.slurm_cluster import (
    SlurmCluster,
    SlurmUnavailable,
    ensure_installed,
    ensure_munge,
    unique_first_job_id,
)

SUBNET = "10.231.0"          # head .1, nodeI .(10 + I); the root namespace never sees it
HEAD_ADDR = f"{SUBNET}.1"
CTLD_PORT, SLURMD_PORT = 6817, 6818   # free in namespaces of our own
PREFIX = "spmdnc"                     # namespace names: spmdnc<creator pid>x<k>-head / -nodeI
NETNS_DIR = Path("/run/netns")
MOUNT_POINT = Path("/local")          # created (empty) in the root fs if missing; never removed
STARTUP_TIMEOUT_S = 60.0
SLURMD_TIMEOUT_S = 10                 # slurmctld marks a silent node DOWN after this
# What a rank of a job on this cluster needs in its environment: CPU JAX with one device
# per rank, and MPICH over libfabric's tcp provider, a setting of this test machine, not of
# spmd (docs/multinode_tests.md: UCX's address exchange through Slurm 22.05's pmi2 arrived
# garbled, and libfabric's default provider choice hung in MPI_Init).
JOB_ENV = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", "PYTHONUNBUFFERED": "1",
           "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
_counter = [0]


def _run(cmd: list[str], timeout: float = 60.0, check: bool = False,
         **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise SlurmUnavailable(f"{shlex.join(cmd)} exited {r.returncode}: "
                               f"{(r.stderr or r.stdout).strip()[-1500:]}")
    return r


def check_prerequisites() -> None:
    """Root, the namespace tools and a kernel that makes netns, bridges and veths."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("the namespace cluster needs root (network namespaces, mounts)")
    missing = [t for t in ("ip", "nsenter", "unshare", "mount")
               if shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        raise SlurmUnavailable(f"missing {', '.join(missing)} (apt-get install iproute2 "
                               "util-linux)")
    ensure_installed()
    ensure_munge()


def netns_inode(name: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a named network namespace, the key to find its processes."""
    try:
        st = os.stat(NETNS_DIR / name)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in_netns(name: str) -> list[int]:
    """Every process whose network namespace is the named one (read from /proc)."""
    key = netns_inode(name)
    if key is None:
        return []
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == key and int(entry.name) != os.getpid():
            out.append(int(entry.name))
    return out


def kill_pids(pids: list[int], timeout: float = 10.0) -> None:
    """SIGKILL each pid and wait until /proc no longer lists it (zombies count as gone)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                break
            if state in ("Z", "X"):
                break
            time.sleep(0.05)


def delete_netns(name: str) -> None:
    kill_pids(pids_in_netns(name))
    _run(["ip", "netns", "delete", name], timeout=30)


def remove_orphans() -> list[str]:
    """Delete the namespaces of clusters whose creating process is gone (a killed pytest)."""
    r = _run(["ip", "netns", "list"], timeout=30)
    removed = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{PREFIX}(\d+)x\d+-", name)
        if m and not process_alive(int(m.group(1))):
            delete_netns(name)
            removed.append(name)
    return removed


def _hardware_fields() -> str:
    """CPUs/sockets/cores/memory of this machine as `slurmd -C` says (each node claims them)."""
    r = _run(["slurmd", "-C"], timeout=30)
    line = r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout else ""
    fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    fields.pop("NodeName", None)
    fields.pop("UpTime", None)
    if "CPUs" not in fields:
        fields = {"CPUs": str(os.cpu_count() or 1), "RealMemory": "1000"}
    fields["RealMemory"] = str(max(1, int(int(fields.get("RealMemory", "1000")) * 0.9)))
    return " ".join(f"{k}={v}" for k, v in fields.items())


def write_conf(root: Path, nodes: list[str], addr: dict[str, str], first_job_id: int) -> Path:
    """slurm.conf of the namespace cluster; per-node spool, pid and log files via %n."""
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    hw = _hardware_fields()
    node_lines = "\n".join(f"NodeName={n} NodeAddr={addr[n]} NodeHostname={n} {hw} "
                           "State=UNKNOWN" for n in nodes)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
# Written by tests/helpers/netns_cluster.py: {len(nodes)} namespace nodes on a bridge.
ClusterName=spmdns
SlurmctldHost=head({HEAD_ADDR})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
JobRequeue=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout=10
InactiveLimit=0
KillWait=5
Waittime=0
MinJobAge=600
MaxJobCount=10000
FirstJobId={first_job_id}
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    return conf


@dataclass
class NetnsCluster(SlurmCluster):
    """A running namespace cluster (module doc: the API)."""

    prefix: str = ""
    nodes: list[str] = field(default_factory=list)
    addr: dict[str, str] = field(default_factory=dict)
    slurmd: dict[str, subprocess.Popen] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)

    # ------------------------------------------------------------ names
    def netns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def local(self, node: str) -> Path:
        """Host path of the node's /local (readable after the node died, until revived)."""
        return self.root / "nodes" / node / "local"

    # ------------------------------------------------------------ commands
    def run(self, *cmd: str, timeout: float = 60.0, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        """A command on the login side: in the head's network namespace, with `self.env`."""
        wrapped = ("nsenter", f"--net={NETNS_DIR / self.netns('head')}", "--", *cmd)
        return super().run(*wrapped, timeout=timeout, check=check, **kw)

    def sbatch(self, script: str | Path, *args: str, timeout: float = 60.0) -> str:
        """Submit `script` (its text, or a path) with extra sbatch `args`; the job id."""
        if isinstance(script, str) and ("\n" in script or not Path(script).is_file()):
            path = self.root / f"job-{time.time_ns()}.sh"
            path.write_text(script)
            script = path
        r = self.run("sbatch", "--parsable", *args, str(script), timeout=timeout)
        return r.stdout.strip().split(";")[0]

    def exec_on(self, node: str, *cmd: str, timeout: float = 60.0, check: bool = True,
                **kw) -> subprocess.CompletedProcess:
        """Run `cmd` inside the node's network, mount and UTS namespaces (via its slurmd)."""
        proc = self.slurmd.get(node)
        if proc is None or proc.poll() is not None:
            raise AssertionError(f"{node} is not running (killed? revive_node first)")
        args = ["nsenter", "-t", str(proc.pid), "-n", "-m", "-u", "--", *cmd]
        r = _run(args, timeout=timeout, env=kw.pop("env", self.env), **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"on {node}: {shlex.join(cmd)} exited {r.returncode}: "
                                 f"{r.stderr}{r.stdout}")
        return r

    def node_pids(self, node: str) -> list[int]:
        return pids_in_netns(self.netns(node))

    def idle_nodes(self) -> list[str]:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=20)
        return sorted(n for n, s in (ln.split()[:2] for ln in r.stdout.splitlines()
                                     if len(ln.split()) >= 2) if s.startswith("idle"))

    def node_states(self) -> dict[str, str]:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=20)
        return dict(ln.split()[:2] for ln in r.stdout.splitlines() if len(ln.split()) >= 2)

    def describe(self, job_id: str, info: dict[str, str] | None = None) -> str:
        text = super().describe(job_id, info)
        for log in sorted((self.root / "log").glob("slurmd.node*.log")):
            text += f"\n--- {log} (tail):\n{log.read_text(errors='replace')[-1500:]}"
        return text

    # ------------------------------------------------------------ nodes
    def _start_slurmd(self, node: str) -> None:
        local = self.local(node)
        local.mkdir(parents=True, exist_ok=True)
        script = (f"set -e; hostname {node}; mount --bind {self.root / 'hosts'} /etc/hosts; "
                  f"mount --bind {local} {MOUNT_POINT}; "
                  "mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm; "
                  f"exec slurmd -D -N {node} -f {self.conf}")
        log = open(self.root / "log" / f"slurmd.{node}.stdout", "ab")  # noqa: SIM115
        self.slurmd[node] = subprocess.Popen(
            ["nsenter", f"--net={NETNS_DIR / self.netns(node)}", "--", "unshare", "--mount",
             "--uts", "--propagation", "private", "--", "/bin/sh", "-c", script],
            env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()

    def kill_node(self, node: str, *, mark_down: bool = False) -> list[int]:
        """The node dies with its disk: SIGKILL every process in its namespaces (by pid: its
        slurmd, slurmstepds and ranks), then delete its /local. Returns the pids killed."""
        pids = self.node_pids(node)
        kill_pids(pids)
        proc = self.slurmd.get(node)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        shutil.rmtree(self.local(node), ignore_errors=True)
        if mark_down:
            self.run("scontrol", "update", f"NodeName={node}", "State=DOWN",
                     "Reason=killed by test", check=False)
        return pids

    def revive_node(self, node: str, timeout: float = 60.0) -> None:
        """A replacement node under the same name: empty /local, fresh slurmd, idle."""
        proc = self.slurmd.get(node)
        if proc is not None and proc.poll() is None:
            self.kill_node(node)
        self._start_slurmd(node)
        deadline = time.monotonic() + timeout
        while node not in self.idle_nodes():
            if time.monotonic() > deadline:
                raise AssertionError(f"{node} not idle {timeout:.0f}s after revive "
                                     f"({self.node_states()})\n{self.describe('none', {})}")
            state = self.node_states().get(node, "")
            if state.startswith(("down", "drain")):
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
            time.sleep(0.5)

    # ------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Cancel jobs, kill every process in our namespaces, delete them and the root dir."""
        if not self.namespaces:
            return
        with contextlib.suppress(Exception):
            if self.procs and self.procs[0].poll() is None:
                self.cancel_all(timeout=15)
        for name in reversed(self.namespaces):
            with contextlib.suppress(Exception):
                delete_netns(name)
        for p in [*self.procs, *self.slurmd.values()]:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        self.namespaces.clear()
        self.procs.clear()
        self.slurmd.clear()
        if self.owns_root and not os.environ.get("SPMD_KEEP_SLURM"):
            shutil.rmtree(self.root, ignore_errors=True)


def _make_network(cluster: NetnsCluster) -> None:
    head = cluster.netns("head")
    for name in (head, *(cluster.netns(n) for n in cluster.nodes)):
        _run(["ip", "netns", "add", name], check=True)
        cluster.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    _run(["ip", "-n", head, "link", "add", "br0", "type", "bridge"], check=True)
    _run(["ip", "-n", head, "addr", "add", f"{HEAD_ADDR}/24", "dev", "br0"], check=True)
    _run(["ip", "-n", head, "link", "set", "br0", "up"], check=True)
    for node in cluster.nodes:
        ns, peer = cluster.netns(node), f"v{node}"
        _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer,
              "netns", head], check=True)
        _run(["ip", "-n", head, "link", "set", peer, "master", "br0"], check=True)
        _run(["ip", "-n", head, "link", "set", peer, "up"], check=True)
        _run(["ip", "-n", ns, "addr", "add", f"{cluster.addr[node]}/24", "dev", "eth0"],
             check=True)
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)


def _wait_idle(cluster: NetnsCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        for p in [*cluster.procs, *cluster.slurmd.values()]:
            if p.poll() is not None:
                raise SlurmUnavailable(f"{shlex.join(p.args[-3:])} exited with {p.returncode}"
                                       f" during startup\n{cluster.describe('none', {})}")
        states = cluster.node_states()
        if sorted(n for n, s in states.items() if s.startswith("idle")) == sorted(cluster.nodes):
            return
        for n, s in states.items():
            if s.startswith(("down", "drain")):
                cluster.run("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)
        time.sleep(0.3)
    raise SlurmUnavailable(f"nodes not idle after {timeout:.0f}s ({states})\n"
                           f"{cluster.describe('none', {})}")


def start_netns_cluster(num_nodes: int = 5, root: Path | None = None,
                        timeout: float = STARTUP_TIMEOUT_S) -> NetnsCluster:
    """Make the namespaces and bridge, start slurmctld and one slurmd per node; wait idle."""
    check_prerequisites()
    remove_orphans()
    MOUNT_POINT.mkdir(exist_ok=True)
    owns_root = root is None
    root = Path(root or tempfile.mkdtemp(prefix="spmd-netns-"))
    _counter[0] += 1
    prefix = f"{PREFIX}{os.getpid()}x{_counter[0]}"
    nodes = [f"node{i}" for i in range(1, num_nodes + 1)]
    addr = {n: f"{SUBNET}.{10 + i}" for i, n in enumerate(nodes, 1)}
    first_job_id = unique_first_job_id()
    conf = write_conf(root, nodes, addr, first_job_id)
    (root / "hosts").write_text("127.0.0.1 localhost\n" + f"{HEAD_ADDR} head\n" +
                                "".join(f"{addr[n]} {n}\n" for n in nodes))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    cluster = NetnsCluster(root=root, conf=conf, hostname="head", env=env,
                           first_job_id=first_job_id, owns_root=owns_root, prefix=prefix,
                           nodes=nodes, addr=addr)
    atexit.register(cluster.stop)   # also when pytest dies before the fixture's teardown
    try:
        _make_network(cluster)
        log = open(root / "log" / "slurmctld.stdout", "ab")  # noqa: SIM115
        script = (f"set -e; hostname head; mount --bind {root / 'hosts'} /etc/hosts; "
                  f"exec slurmctld -D -c -f {conf}")
        cluster.procs.append(subprocess.Popen(
            ["nsenter", f"--net={NETNS_DIR / cluster.netns('head')}", "--", "unshare",
             "--mount", "--uts", "--propagation", "private", "--", "/bin/sh", "-c", script],
            env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True))
        log.close()
        for node in nodes:
            cluster._start_slurmd(node)
        _wait_idle(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


_CLUSTER: NetnsCluster | None = None


@pytest.fixture(scope="session")
def netns_cluster() -> Iterator[NetnsCluster]:
    """A running 5-node namespace cluster; skip (or fail when CI=true) if it cannot start.

    Shared by every module that imports it; modules that kill nodes revive them afterwards.
    """
    global _CLUSTER
    if _CLUSTER is None or not _CLUSTER.namespaces:
        try:
            _CLUSTER = start_netns_cluster()
        except (SlurmUnavailable, OSError, subprocess.SubprocessError) as e:
            msg = f"namespace Slurm cluster unavailable: {e}"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(msg)
            pytest.skip(msg)
    yield _CLUSTER
    _CLUSTER.stop()


if __name__ == "__main__":
    import sys

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt   # SIGTERM too (a background job ignores SIGINT): clean up

    signal.signal(signal.SIGTERM, _interrupt)
    c = start_netns_cluster(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
    print(f"nodes {c.addr}; login: nsenter --net={NETNS_DIR / c.netns('head')} env "
          f"SLURM_CONF={c.conf} sinfo   (logs in {c.root / 'log'}); Ctrl-C stops the cluster")
    try:
        while c.procs and c.procs[0].poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        c.stop()
