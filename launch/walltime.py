"""`job_end_time`: when the allocation ends, in epoch seconds, if the scheduler can say.

Variables first (SPMD_JOB_END_TIME, SLURM_JOB_END_TIME), then the scheduler's own tool with
a short timeout: `squeue -h -j ID -o %e` (Slurm), `bjobs -noheader -hms -o time_left ID`
(LSF), `flux job info ID R` (Flux), `qstat -f ID` (PBS). Tools are asked on rank 0 only, so
that thousands of ranks do not flood the scheduler; the stop decision (`spmd.comm.StopVote`)
is collective, so a deadline known to rank 0 stops every rank. Never raises.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from datetime import datetime

from spmd.launch.env import LaunchEnv

TOOL_TIMEOUT_S = 5.0


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _epoch(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 else None


def _hms(text: str) -> float | None:
    """Seconds in "[D-]HH:MM[:SS]"."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+)(?::(\d+))?", text.strip())
    if not m:
        return None
    d, h, mi, s = (int(g or 0) for g in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def _slurm(job_id: str) -> float | None:
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%e"])
    if not out:
        return None
    try:
        return datetime.fromisoformat(out.splitlines()[0].strip()).timestamp()
    except ValueError:  # N/A, Unknown, NONE
        return None


def _lsf(job_id: str) -> float | None:
    out = _run(["bjobs", "-noheader", "-hms", "-o", "time_left", job_id])
    m = re.match(r"\s*([\d:-]+)\s*([LE])?\s*$", out or "")
    left = _hms(m.group(1)) if m else None
    return time.time() + left if left is not None else None


def _flux(job_id: str) -> float | None:
    out = _run(["flux", "job", "info", job_id, "R"])
    try:
        return _epoch(str(json.loads(out or "")["execution"]["expiration"]))
    except (ValueError, KeyError, TypeError):
        return None


def _pbs(job_id: str) -> float | None:
    out = _run(["qstat", "-f", job_id]) or ""
    fields = dict(re.findall(r"^\s*([\w.]+) = (.*)$", out, flags=re.M))
    limit = _hms(fields.get("Resource_List.walltime", ""))
    if limit is None:
        return None
    try:
        start = time.mktime(time.strptime(fields.get("stime", ""), "%a %b %d %H:%M:%S %Y"))
        return start + limit
    except ValueError:
        used = _hms(fields.get("resources_used.walltime", "")) or 0
        return time.time() + limit - used


def job_end_time(env: LaunchEnv, environ: Mapping[str, str] | None = None) -> float | None:
    """The allocation's end (epoch seconds), or None when unknown on this rank."""
    environ = os.environ if environ is None else environ
    for var in ("SPMD_JOB_END_TIME", "SLURM_JOB_END_TIME"):
        if environ.get(var):
            value = _epoch(environ[var])
            if value is not None:
                return value
    if env.rank != 0:
        return None
    for var, ask in (("SLURM_JOB_ID", _slurm), ("LSB_JOBID", _lsf), ("FLUX_JOB_ID", _flux),
                     ("PBS_JOBID", _pbs)):
        if environ.get(var):
            try:
                return ask(environ[var])
            except Exception:  # a tool's odd output must never stop training
                return None
    return None
