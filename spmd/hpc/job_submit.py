"""Submitting a rendered batch script (spmd.hpc.batch_scripts) to its scheduler, alone or
as a chain of jobs that each wait for the previous one (`spmd jobscript --submit --chain N`).

Invariants:
- One command per scheduler: `sbatch --parsable` (Slurm), `bsub` with the script on stdin
  (LSF reads #BSUB lines only from there), `qsub` (PBS), `flux batch`; each job of a chain
  depends on the previous one's end, whatever its status (afterany / ended()), so that a
  failed job's successor still runs and resumes from the last checkpoint.
- Every job of a chain but the last has SPMD_CHAIN_NEXT=1, and every job SPMD_CHAIN=<first
  job id> (`spmd report` counts the gap before a chained job as queue time), passed the way
  each scheduler passes variables; a submitting shell's own SPMD_CHAIN is never inherited.
- A missing submit command, one that fails or does not answer, or output without a job id
  raises SpmdError naming the command and what to do.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from spmd.errors import SpmdError
from spmd.hpc.systems import Scheduler

SUBMIT_TOOLS: dict[str, str] = {"slurm": "sbatch", "lsf": "bsub", "pbs": "qsub", "flux": "flux"}


def submit_argv(scheduler: Scheduler, script: Path, depends_on: str | None = None,
                chain_next: bool = False, chain: str | None = None
                ) -> tuple[list[str], Path | None]:
    """(argv, stdin file) that submits `script`, after `depends_on` ended (any status).
    `chain`: the first job id of its chain, SPMD_CHAIN in the job (`spmd report` counts the
    gap before it as queue): passed here where the job does not inherit the environment of
    the submission (PBS) or already takes variables this way (Flux); `submit` sets it in the
    environment for the others."""
    script = Path(script)
    if scheduler == "slurm":
        argv = ["sbatch", "--parsable"]
        if depends_on:
            argv.append(f"--dependency=afterany:{depends_on}")
        return argv + [str(script)], None
    if scheduler == "lsf":  # bsub reads #BSUB lines only from a script on stdin
        argv = ["bsub"]
        if depends_on:
            argv += ["-w", f"ended({depends_on})"]
        return argv, script
    if scheduler == "pbs":
        argv = ["qsub"]
        if depends_on:
            argv += ["-W", f"depend=afterany:{depends_on}"]
        variables = (["SPMD_CHAIN_NEXT=1"] if chain_next else []) + (
            [f"SPMD_CHAIN={chain}"] if chain else [])
        if variables:
            argv += ["-v", ",".join(variables)]
        return argv + [str(script)], None
    if scheduler == "flux":
        argv = ["flux", "batch"]
        if depends_on:
            argv.append(f"--dependency=afterany:{depends_on}")
        if chain_next:
            argv.append("--env=SPMD_CHAIN_NEXT=1")
        if chain:
            argv.append(f"--env=SPMD_CHAIN={chain}")
        return argv + [str(script)], None
    raise SpmdError(f"unknown scheduler '{scheduler}'")


def parse_job_id(scheduler: Scheduler, out: str) -> str:
    """The job id in a submit command's stdout."""
    text = out.strip()
    if scheduler == "lsf":
        m = re.search(r"Job <([^>]+)>", text)
        job_id = m.group(1) if m else ""
    elif scheduler == "slurm":
        job_id = text.splitlines()[-1].split(";")[0].strip() if text else ""
    else:
        job_id = text.splitlines()[-1].strip() if text else ""
    if not job_id or any(ch.isspace() for ch in job_id):
        raise SpmdError(f"could not find a job id in the output of {SUBMIT_TOOLS[scheduler]}: "
                        f"{text!r}")
    return job_id


def submit(scheduler: Scheduler, script: Path, depends_on: str | None = None,
           chain_next: bool = False, env: Mapping[str, str] | None = None,
           timeout_s: float = 120.0, chain: str | None = None) -> str:
    """Submit `script`; return the job id. SpmdError names a missing or failing command.
    `chain`: see `submit_argv`; without it the job gets no SPMD_CHAIN of the submitting
    shell's."""
    argv, stdin_path = submit_argv(scheduler, script, depends_on, chain_next, chain)
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "SPMD_CHAIN"}
    if chain:
        env["SPMD_CHAIN"] = chain
    if shutil.which(argv[0], path=env.get("PATH")) is None:
        raise SpmdError(f"--submit needs `{argv[0]}` ({scheduler}) on PATH and it is not there; "
                        f"run on a login node of the system, or render without --submit and "
                        f"submit {script} yourself")
    stdin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        r = subprocess.run(argv, stdin=stdin, capture_output=True, text=True, env=env,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SpmdError(f"`{shlex.join(argv)}` did not answer within {timeout_s:.0f} s; is the "
                        f"{scheduler} controller reachable?") from None
    finally:
        if stdin_path:
            stdin.close()
    if r.returncode != 0:
        raise SpmdError(f"`{shlex.join(argv)}` failed (exit {r.returncode}): "
                        f"{(r.stderr or r.stdout).strip()}")
    return parse_job_id(scheduler, r.stdout)


def submit_chain(scheduler: Scheduler, script: Path, count: int,
                 env: Mapping[str, str] | None = None) -> list[str]:
    """Submit `script` `count` times, each job waiting for the previous one to end."""
    if not isinstance(count, int) or count < 1:
        raise SpmdError(f"--chain must be a positive integer, got {count!r}")
    ids: list[str] = []
    for i in range(count):
        ids.append(submit(scheduler, script, ids[-1] if ids else None,
                          chain_next=i < count - 1, env=env, chain=ids[0] if ids else None))
    return ids
