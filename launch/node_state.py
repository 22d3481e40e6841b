"""What each scheduler says about the allocation's nodes, and how its launcher leaves one out.

For the recovery supervisor (spmd.launch.supervisor): the hosts of the allocation, the hosts
the scheduler reports down or drained, and the launch line of a try on a given set of hosts.

    scheduler  hosts of the allocation            down hosts                 leave hosts out
    slurm      SLURM_JOB_NODELIST (hostlist)      sinfo -h -N -n H -o '%N %t'  srun --exclude=H
    flux       flux hostlist local                flux resource list -s down  flux run
                                                  -no {nodelist}              --requires=-host:H
    pbs        PBS_NODEFILE (unique, in order)    pbsnodes -l                 mpiexec --hosts H
    lsf        LSB_MCPU_HOSTS (less the launch    bhosts -w H                 (jsrun cannot:
               node)                                                          requeue instead)

A query that fails or times out reports nothing (the supervisor then goes by the ranks'
records alone) and says so in the log.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from spmd.launch.recovery import expand_hostlist

log = logging.getLogger("spmd.launch.node_state")
QUERY_TIMEOUT_S = 20.0
SCHEDULERS = ("slurm", "flux", "pbs", "lsf")
# sinfo's compact states (%t) of a node no try should use; a trailing '*' (not responding) too
SLURM_BAD = ("down", "drain", "drng", "fail", "failg", "maint", "unk", "npc", "futr", "inval")
LSF_BAD = ("unavail", "unreach", "closed_adm", "closed_lock", "closed_lim", "closed_excl")


def query(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str | None:
    """stdout of `argv`, or None (logged) when it is missing, fails or hangs."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=QUERY_TIMEOUT_S,
                           env=dict(environ) if environ is not None else None)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("recovery: %s did not answer (%s)", shlex.join(argv), e)
        return None
    if r.returncode != 0:
        log.warning("recovery: %s failed (exit %d): %s", shlex.join(argv), r.returncode,
                    (r.stderr or r.stdout).strip()[:300])
        return None
    return r.stdout


def allocation_hosts(scheduler: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The allocation's hosts in the scheduler's order ([] when unknown)."""
    env = os.environ if environ is None else environ
    if scheduler == "slurm":
        return expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    if scheduler == "flux":
        out = query(["flux", "hostlist", "local"], env)
        return expand_hostlist(out.strip()) if out else []
    if scheduler == "pbs":
        path = env.get("PBS_NODEFILE")
        if not path or not Path(path).is_file():
            return []
        return list(dict.fromkeys(h.strip() for h in Path(path).read_text().splitlines()
                                  if h.strip()))
    if scheduler == "lsf":
        words = env.get("LSB_MCPU_HOSTS", "").split()
        hosts = list(dict.fromkeys(words[0::2]))
        return hosts[1:] if len(hosts) > 1 else hosts   # the first is the launch node
    raise ValueError(f"unknown scheduler {scheduler!r}: one of {', '.join(SCHEDULERS)}")


def down_hosts(scheduler: str, hosts: Sequence[str],
               environ: Mapping[str, str] | None = None) -> list[str]:
    """Those of `hosts` the scheduler reports down, drained, failing or not responding."""
    env = os.environ if environ is None else environ
    if not hosts:
        return []
    wanted = set(hosts)
    if scheduler == "slurm":
        out = query(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %t"], env)
        bad = []
        for line in (out or "").splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in wanted:
                state = parts[1].lower()
                if state.endswith("*") or state.rstrip("*~#!%$@^-").startswith(SLURM_BAD):
                    bad.append(parts[0])
        return list(dict.fromkeys(bad))
    if scheduler == "flux":
        out = query(["flux", "resource", "list", "-s", "down", "-no", "{nodelist}"], env)
        return [h for h in expand_hostlist((out or "").strip()) if h in wanted]
    if scheduler == "pbs":
        out = query(["pbsnodes", "-l"], env)
        return [p[0] for p in (line.split() for line in (out or "").splitlines())
                if p and p[0].split(".")[0] in {w.split(".")[0] for w in wanted}]
    if scheduler == "lsf":
        out = query(["bhosts", "-w", *hosts], env)
        return [p[0] for p in (line.split() for line in (out or "").splitlines()[1:])
                if len(p) > 1 and p[0] in wanted and p[1].lower() in LSF_BAD]
    raise ValueError(f"unknown scheduler {scheduler!r}: one of {', '.join(SCHEDULERS)}")


def can_exclude(scheduler: str) -> bool:
    """Whether the launcher can start a try that leaves given hosts out (not jsrun)."""
    return scheduler != "lsf"


def launch_argv(scheduler: str, template: str, *, nodes: int, ranks_per_node: int,
                hosts: Sequence[str] = (), exclude: Sequence[str] = (),
                environ: Mapping[str, str] | None = None, relaunch: bool = False) -> list[str]:
    """The launch line of a try: `template` (the profile's launcher with {nodes} and {ranks}
    left open; $VARIABLES expanded from `environ`) on `nodes` nodes, leaving out `exclude`
    (slurm, flux) or on exactly `hosts` (pbs: mpiexec --hosts).

    `relaunch` (a try after the first), Slurm: `srun --overlap`. The step of a try that had
    a task on a node that died stays RUNNING in slurmctld (its CPUs on the surviving nodes
    held) although every task of it has ended, since the dead node's slurmstepd never
    reports the step complete; without --overlap the next step waits for those CPUs forever
    ("step creation temporarily disabled ... Requested nodes are busy"; seen with Slurm
    22.05 on the namespace cluster of tests/multinode)."""
    env = os.environ if environ is None else environ
    text = template.format(nodes=nodes, ranks=nodes * ranks_per_node)
    argv = [_expand(w, env) for w in shlex.split(text)]
    if not argv:
        raise ValueError("empty launcher template")
    if scheduler == "slurm" and relaunch and "--overlap" not in argv:
        argv.append("--overlap")
    extra: list[str] = []
    if scheduler == "slurm" and exclude:
        extra = [f"--exclude={','.join(exclude)}"]
    elif scheduler == "flux" and exclude:
        extra = [f"--requires=-host:{','.join(exclude)}"]
    elif scheduler == "pbs" and exclude and hosts:
        extra = ["--hosts", ",".join(hosts)]
    if not extra:
        return argv
    at = 2 if scheduler == "flux" and argv[1:2] == ["run"] else 1
    return argv[:at] + extra + argv[at:]


def _expand(word: str, env: Mapping[str, str]) -> str:
    if "$" not in word:
        return word
    import string

    return string.Template(word).safe_substitute(env)
