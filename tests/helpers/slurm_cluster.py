"""A real one-node Slurm (slurmctld + slurmd on 127.0.0.1) for tests, as a pytest fixture.

`slurm_cluster` (session scope) installs Debian `slurm-wlm` + `munge` when they are missing and
we are root, starts munged, writes a slurm.conf into a temp dir (free ports, state/spool/logs
there), starts both daemons with SLURM_CONF exported and waits until the node is idle. It yields
a `SlurmCluster` with `.env` (use it for every sbatch/srun/scontrol call) and helpers to wait on
jobs. If it cannot start: `pytest.fail` when CI=true, else `pytest.skip` with the reason.

Use it from a test module with `from tests.helpers.slurm_cluster import slurm_cluster  # noqa:
F401`. One cluster is shared per process however many modules import the fixture.
Standalone: `python tests/helpers/slurm_cluster.py` starts one and keeps it up until Ctrl-C
(prints the `export SLURM_CONF=...` line to use).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 90.0
TOOLS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd",
         "munged", "munge", "unmunge")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class SlurmUnavailable(RuntimeError):
    """The local Slurm could not be installed or started; the message says why."""


def _which_all(paths: str | None = None) -> list[str]:
    extra = os.pathsep.join(["/usr/sbin", "/sbin", "/usr/bin"])
    path = (paths or os.environ.get("PATH", "")) + os.pathsep + extra
    return [t for t in TOOLS if shutil.which(t, path=path) is None]


def _run(cmd: list[str], timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def ensure_installed() -> None:
    """Install slurm-wlm and munge with apt when a tool is missing (root only)."""
    missing = _which_all()
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"missing {', '.join(missing)} and not root: cannot apt-get install "
                               "slurm-wlm munge")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"missing {', '.join(missing)} and no apt-get on this machine")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm",
                 "munge"]):
        r = _run(cmd, timeout=900, env=env)
        if r.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed (exit {r.returncode}): "
                                   f"{(r.stderr or r.stdout)[-2000:]}")
    missing = _which_all()
    if missing:
        raise SlurmUnavailable(f"still missing after apt-get install: {', '.join(missing)}")


def _munge_works() -> bool:
    try:
        enc = _run(["munge", "-n"], timeout=10)
        if enc.returncode != 0:
            return False
        dec = _run(["unmunge"], timeout=10, input=enc.stdout)
        return dec.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_munge() -> None:
    """A munge key (created if absent) and a running munged (`munged --force` as root)."""
    if _munge_works():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("munged is not running (munge -n | unmunge fails) and we are not "
                               "root to start it")
    import pwd

    try:
        pw = pwd.getpwnam("munge")
        uid, gid = pw.pw_uid, pw.pw_gid
    except KeyError:
        uid, gid = 0, 0
    dirs = (MUNGE_KEY.parent, MUNGE_SOCKET.parent, Path("/var/log/munge"), Path("/var/lib/munge"))
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, uid, gid)
    if not MUNGE_KEY.exists():
        MUNGE_KEY.write_bytes(os.urandom(1024))
        os.chown(MUNGE_KEY, uid, gid)
        MUNGE_KEY.chmod(0o400)
    # --force: run as root and take over a stale socket / pid file left by a dead munged.
    r = _run(["munged", "--force"], timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if _munge_works():
            return
        time.sleep(0.2)
    log = Path("/var/log/munge/munged.log")
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    raise SlurmUnavailable(f"munged did not start (exit {r.returncode}): {r.stderr.strip()} {tail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line(hostname: str) -> str:
    """This machine's NodeName line from `slurmd -C` (so slurmd never finds a mismatch)."""
    try:
        r = _run(["slurmd", "-C"], timeout=30)
        line = r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout else ""
    except (OSError, subprocess.TimeoutExpired, IndexError):
        line = ""
    fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    if "CPUs" not in fields:
        mem_kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        fields = {"CPUs": str(os.cpu_count() or 1), "RealMemory": str(mem_kb // 1024)}
    fields.pop("NodeName", None)
    fields.pop("UpTime", None)
    # Leave headroom so slurmd never reports less memory than configured (node would drain).
    fields["RealMemory"] = str(max(1, int(int(fields.get("RealMemory", "1000")) * 0.9)))
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    return f"NodeName={hostname} NodeAddr=127.0.0.1 {extra} State=UNKNOWN"


def fnv1a32(text: str) -> str:
    """MPICH's HASH_FNV of a PMI KVS name, as in its /dev/shm segment names."""
    h = 2166136261
    for byte in text.encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return format(h, "x")


def unique_first_job_id() -> int:
    """A FirstJobId no earlier test cluster used (ids of a fresh cluster restart otherwise).

    MPICH names its shared-memory segment after the PMI KVS name, which under srun is
    "<jobid>.<stepid>": a segment left in /dev/shm by a killed step makes the next step with
    the same name hang or fail in MPI_Init. Job ids that never repeat avoid that.
    """
    return 1000 + (int(time.time()) % 6_000_000) * 10


def write_conf(root: Path, hostname: str, ctld_port: int, slurmd_port: int,
               first_job_id: int = 1) -> Path:
    """slurm.conf for one node, every path inside `root`."""
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
# Written by tests/helpers/slurm_cluster.py: a one-node test cluster on 127.0.0.1.
ClusterName=spmdtest
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s,
# here Slurm's minimum, 5 s: every requeue test waits it out once).
AuthInfo=cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a requeued job becomes eligible cred_expire + 1 s later, and only a scheduling pass
# starts it then: the backfill pass, every 30 s by default; every 1 s here
SchedulerParameters=bf_interval=1
JobRequeue=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=5
Waittime=0
MinJobAge=600
MaxJobCount=10000
FirstJobId={first_job_id}
{_node_line(hostname)}
PartitionName=debug Nodes={hostname} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    return conf


@dataclass
class SlurmCluster:
    """A running test cluster: its conf, the env to call Slurm with, and job helpers."""

    root: Path
    conf: Path
    hostname: str
    env: dict[str, str]
    first_job_id: int = 1
    owns_root: bool = False  # a temp dir we made: removed on stop unless SPMD_KEEP_SLURM=1
    procs: list[subprocess.Popen] = field(default_factory=list)

    # ------------------------------------------------------------ commands
    def run(self, *cmd: str, timeout: float = 60.0, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        r = _run(list(cmd), timeout=timeout, env=kw.pop("env", self.env), **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr}{r.stdout}")
        return r

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict ({} when Slurm no longer knows the job)."""
        r = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if r.returncode != 0 or not r.stdout.strip():
            return {}
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", r.stdout.splitlines()[0]))

    def state(self, job_id: str) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_for(self, job_id: str, predicate, timeout: float, what: str,
                 poll: float = 0.5) -> dict[str, str]:
        """Poll `scontrol show job` until predicate(info) holds; fail with the job's output."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info and predicate(info):
                return info
            time.sleep(poll)
        raise AssertionError(f"job {job_id}: timed out after {timeout:.0f}s waiting for {what}; "
                             f"last state {info.get('JobState')}\n{self.describe(job_id, info)}")

    def wait_finished(self, job_id: str, timeout: float = 120.0) -> dict[str, str]:
        return self.wait_for(job_id, lambda i: i.get("JobState") in FINISHED_STATES, timeout,
                             "the job to finish")

    def describe(self, job_id: str, info: dict[str, str] | None = None) -> str:
        """Job record, output file and daemon log tails: what a failing test should print."""
        info = info if info is not None else self.job_info(job_id)
        parts = [f"--- scontrol show job {job_id}: {info}"]
        out = info.get("StdOut")
        if out and Path(out).exists():
            parts.append(f"--- {out}:\n{Path(out).read_text(errors='replace')[-6000:]}")
        for log in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / log
            if p.exists():
                parts.append(f"--- {p} (tail):\n{p.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def cancel_all(self, timeout: float = 30.0) -> None:
        self.run("scancel", "--full", "--partition=debug", check=False, timeout=20)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run("squeue", "-h", "-o", "%i", check=False, timeout=20)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.5)

    # ------------------------------------------------------------ lifecycle
    def next_job_id(self) -> int:
        r = self.run("scontrol", "show", "config", check=False, timeout=20)
        m = re.search(r"^NEXT_JOB_ID\s*=\s*(\d+)", r.stdout, re.M)
        return int(m.group(1)) if m else self.first_job_id

    def remove_stale_mpich_shm(self, last_job_id: int) -> list[Path]:
        """Delete /dev/shm segments MPICH left for this cluster's job steps (killed ranks)."""
        removed = []
        for job in range(self.first_job_id, last_job_id + 1):
            for step in range(16):
                h = fnv1a32(f"{job}.{step}")
                for prefix in ("mpich_shm_", "mpich_vci_"):
                    for path in Path("/dev/shm").glob(f"{prefix}{h}_*"):
                        with contextlib.suppress(OSError):
                            path.unlink()
                            removed.append(path)
        return removed

    def stop(self) -> None:
        """Cancel jobs, stop the daemons this object started (by pid), clean /dev/shm."""
        if not self.procs:
            return
        last_job_id = self.first_job_id
        with contextlib.suppress(Exception):
            last_job_id = self.next_job_id() - 1
            self.cancel_all()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()
        self.remove_stale_mpich_shm(last_job_id)
        if self.owns_root and not os.environ.get("SPMD_KEEP_SLURM"):
            shutil.rmtree(self.root, ignore_errors=True)


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for p in cluster.procs:
            if p.poll() is not None:
                raise SlurmUnavailable(f"{p.args[0]} exited with {p.returncode} during startup\n"
                                       f"{cluster.describe('none', {})}")
        r = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=15)
        last = (r.stdout + r.stderr).strip()
        if r.returncode == 0 and last.split() and all(s.startswith("idle") for s in last.split()):
            return
        if r.returncode == 0 and any(s.startswith(("drain", "down")) for s in last.split()):
            cluster.run("scontrol", "update", f"NodeName={cluster.hostname}", "State=RESUME",
                        check=False)
        time.sleep(0.5)
    raise SlurmUnavailable(f"node not idle after {timeout:.0f}s (sinfo: {last!r})\n"
                           f"{cluster.describe('none', {})}")


def start_cluster(root: Path | None = None, timeout: float = STARTUP_TIMEOUT_S) -> SlurmCluster:
    """Install if needed, start munged, slurmctld, slurmd; return once the node is idle."""
    ensure_installed()
    ensure_munge()
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster runs slurmd as root (SlurmdUser=root); not root")
    owns_root = root is None
    root = Path(root or tempfile.mkdtemp(prefix="spmd-slurm-"))
    hostname = socket.gethostname().split(".")[0]
    last_error: Exception | None = None
    first_job_id = unique_first_job_id()
    for _attempt in range(3):  # a port taken between free_port() and bind: retry with new ports
        ctld_port, slurmd_port = free_port(), free_port()
        while slurmd_port == ctld_port:
            slurmd_port = free_port()
        conf = write_conf(root, hostname, ctld_port, slurmd_port, first_job_id)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_",
                                                                          "SRUN_", "SALLOC_"))}
        env["SLURM_CONF"] = str(conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        cluster = SlurmCluster(root=root, conf=conf, hostname=hostname, env=env,
                               first_job_id=first_job_id, owns_root=owns_root)
        for name in ("slurmctld", "slurmd"):
            log = open(root / "log" / f"{name}.stdout", "ab")  # noqa: SIM115
            args = [name, "-D", "-f", str(conf)]
            if name == "slurmctld":
                args.append("-c")  # fresh state: no jobs from an older run of this dir
            cluster.procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=log,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
            log.close()
            time.sleep(0.5 if name == "slurmctld" else 0)
        try:
            _wait_idle(cluster, timeout)
            atexit.register(cluster.stop)  # also when pytest dies before fixture teardown
            return cluster
        except SlurmUnavailable as e:
            last_error = e
            ctld_log = root / "log" / "slurmctld.log"
            logs = ctld_log.read_text(errors="replace") if ctld_log.exists() else ""
            cluster.stop()
            if "Address already in use" not in logs:
                break
    raise SlurmUnavailable(str(last_error))


_CLUSTER: SlurmCluster | None = None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running one-node Slurm; skip (or fail when CI=true) if it cannot start."""
    global _CLUSTER
    if _CLUSTER is None or not _CLUSTER.procs:
        try:
            _CLUSTER = start_cluster()
        except (SlurmUnavailable, OSError, subprocess.SubprocessError) as e:
            msg = f"local Slurm unavailable: {e}"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(msg)
            pytest.skip(msg)
    yield _CLUSTER
    _CLUSTER.stop()  # idempotent: several modules may hold this fixture


if __name__ == "__main__":
    c = start_cluster()
    print(f"export SLURM_CONF={c.conf}   # logs in {c.root / 'log'}; Ctrl-C stops the cluster")
    try:
        while all(p.poll() is None for p in c.procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        c.stop()
