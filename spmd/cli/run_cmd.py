"""`spmd run -n N CONFIG [key=value ...] [--ppn P]`: a local multi-process job through MPI.

Starts N ranks of `spmd train CONFIG ...` with the installed MPI's mpiexec (the mpich wheel's
from `pip install 'spmd-hpc[local]'`, next to this Python or on PATH). Every P consecutive
ranks stand for one node (SPMD_PROCESSES_PER_NODE, default 1), so a single machine exercises
inter-node mesh factors and partner checkpoints. SIGTERM/SIGINT/SIGUSR1/SIGUSR2 are forwarded
to mpiexec, which forwards them to the ranks; the exit status is the ranks' (75 = preempted).

Ranks never outlive this process: it exports its pid and start time (SPMD_LAUNCHER_PID,
SPMD_LAUNCHER_START) and every rank's watchdog (spmd.launch.watchdog) ends the rank within
about a second once it is gone, even after a SIGKILL; on Linux mpiexec also gets SIGKILL then
(PR_SET_PDEATHSIG). Before starting anything, a run.dir whose lease a live run holds is
refused with one line naming the holder (status 2); rank 0 still takes the lease itself.

Each rank runs behind a shim (spmd.launch.rank_shim) that turns a death by signal into exit
status 128+S, so Hydra's proxy does not SIGKILL the other ranks and they can name the lost one.

The exit status of `spmd train`'s ranks is the table's (spmd.errors.ExitCode), decided
from the ranks' own statuses, which the shims leave in this process's temporary folder
(SPMD_RUN_TMPDIR, also where the ranks keep their exit marks), not from what the launcher
makes of them (Hydra ORs them: 69 | 137 = 205): see spmd.cli.job_status. Once every rank has left
its status, mpiexec is given OUTLIVE_S to end, then ended (Open MPI's mpirun, signalled
itself by a whole-job SIGTERM, would wait out its odls_base_sigkill_timeout). The folder is
removed on every way out that still runs Python. A preemption signal that reaches this
process before the ranks are started (from its first moment on: spmd.cli.early_signal) exits
75 at once, with a line: nothing was run.
When the ranks fail, the ERROR lines they wrote to run.dir/logs during this job are repeated
at the end, one per line, after Hydra's own report.

The console (spmd.rundir.console): the ranks' stdout and stderr pass through this process,
less Gloo's line per rank saying it connected to all its peers (spmd.cli.rank_output; `-v`
passes all).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from spmd.cli import early_signal
from spmd.cli.job_status import job_status, killed_starting, rank_statuses, received
from spmd.cli.rank_output import OutputFilter, console_env, copy_output
from spmd.cli.train_cmd import add_verbose, verbose_overrides
from spmd.comm.hang_watchdog import HUNG_FILE_NAME
from spmd.errors import ExitCode, SpmdError
from spmd.launch import rank_shim
from spmd.launch.huge_pages import with_huge_pages
from spmd.launch.watchdog import launcher_environ

MPIEXEC_VAR = "SPMD_MPIEXEC"   # the launcher to use instead of the embedded MPI's mpiexec
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
ENDING = (signal.SIGTERM, signal.SIGINT)   # the ranks save and stop, or are killed
KILL_WAIT_S = 30.0       # launch.kill_wait_s's default, for entries other than train
DEFAULT_SAVE_S = 600.0   # checkpoint.timeout_s's default, for entries other than train
DRAIN_S = 5.0            # how long the ranks' output may still come after mpiexec ended
# How long mpiexec may outlive the last rank's status: Open MPI's mpirun, itself signalled (a
# whole-job SIGTERM: scancel, a node's shutdown), waits out odls_base_sigkill_timeout (the
# save's time) after its ranks have saved and exited; it is then ended, and the ranks'
# statuses are the job's
OUTLIVE_S = 5.0
# Per-rank variables an outer launcher may have left; inherited, they would make every local
# rank claim the same identity.
_STALE_PREFIXES = ("SLURM_STEP_", "JSM_NAMESPACE_", "PALS_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_",
                   "FLUX_TASK_")
_STALE_NAMES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEPID", "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS", "SPMD_RANK", "SPMD_SIZE", "SPMD_LOCAL_RANK",
                "SPMD_LOCAL_SIZE", "SPMD_NODE_ID", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES",
                "JAX_COORDINATOR_ADDRESS", "JAX_LOCAL_DEVICE_IDS")
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run N local ranks of `spmd train` through the installed MPI")
    p.add_argument("-n", "--np", dest="n", type=int, required=True, metavar="N",
                   help="number of ranks")
    p.add_argument("--ppn", type=int, default=1, metavar="P",
                   help="ranks that stand for one node (default 1: every rank its own node)")
    p.add_argument("--entry", default="train", help=argparse.SUPPRESS)  # subcommand per rank
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    add_verbose(p)
    p.set_defaults(func=run)


def find_mpiexec() -> Path:
    """$SPMD_MPIEXEC (a path, or a name on PATH: another MPI's launcher, e.g. Open MPI's
    mpirun), else mpiexec next to this Python (a venv with the mpich wheel), else on PATH."""
    chosen = os.environ.get(MPIEXEC_VAR, "").strip()
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise SpmdError(f"{MPIEXEC_VAR}={chosen}: no such executable (give a path, or a "
                            "name on PATH, of your MPI's mpiexec or mpirun)")
        return Path(found)
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("mpiexec")
    if found:
        return Path(found)
    raise SpmdError(f"spmd run needs an mpiexec, and there is none next to {sys.executable} or "
                    "on PATH: install the embedded MPI with `pip install 'spmd-hpc[local]'` "
                    "(the mpich wheel), or load your site's MPI module")


@functools.lru_cache(maxsize=8)
def mpi_flavor(mpiexec: Path) -> str:
    """"hydra" (MPICH, Intel MPI), "openmpi", or "other", from `mpiexec --version`."""
    try:
        out = subprocess.run([str(mpiexec), "--version"], capture_output=True, text=True,
                             timeout=20)
        version = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError) as e:
        raise SpmdError(f"{mpiexec} --version failed ({e}); is this MPI installed correctly?"
                        ) from None
    if "HYDRA" in version:
        return "hydra"
    if "Open MPI" in version or "OpenRTE" in version or "PRRTE" in version:
        return "openmpi"
    return "other"


def flavor_args(mpiexec: Path, save_s: float = 0.0, kill_wait_s: float = KILL_WAIT_S
                ) -> list[str]:
    """Options that keep a local job on this machine for the MPI at hand.

    `save_s` (checkpoint.timeout_s): Open MPI's mpirun SIGKILLs the ranks 1 s after it
    forwards a SIGTERM (odls_base_sigkill_timeout), too soon for a preemption save; it is
    given the save's time plus `kill_wait_s`. Run as root, Open MPI wants --allow-run-as-root.
    """
    flavor = mpi_flavor(mpiexec)
    if flavor == "hydra":  # MPICH / Intel MPI: fork locally, never via srun or ssh
        # the ranks' watchdogs end the survivors of a lost rank themselves, naming it
        return ["-launcher", "fork", "-disable-auto-cleanup"]
    if flavor == "openmpi":
        grace = int(save_s + kill_wait_s) if save_s else None
        # as Hydra's -disable-auto-cleanup: a rank that exits non-zero (75 after a save)
        # does not make mpirun kill the others, which may still be finishing theirs
        return ["--oversubscribe", "--bind-to", "none",
                "--mca", "orte_abort_on_non_zero_status", "0",
                *(["--mca", "odls_base_sigkill_timeout", str(grace)] if grace else []),
                *(["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0
                  else [])]
    return []


def child_env(ppn: int, huge_pages: bool = True) -> dict[str, str]:
    """The ranks' environment: this one's without an outer launcher's rank variables, with
    the node grouping, this launcher's identity and malloc's huge pages
    (launch.malloc_huge_pages, spmd.launch.huge_pages)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_STALE_PREFIXES) and k not in _STALE_NAMES}
    env = with_huge_pages(env, huge_pages)
    env["SPMD_PROCESSES_PER_NODE"] = str(ppn)
    env.update(launcher_environ())
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_lease(config: str, overrides: list[str]) -> tuple[Path, float, float, bool]:
    """The config's run.dir, checkpoint.timeout_s, launch.kill_wait_s and
    launch.malloc_huge_pages; refused at once
    (LeaseHeld, status 2) when a live run holds the run.dir. The ranks validate the rest
    (`model:`, `task:`): reading the task here would cost this process a JAX import."""
    from spmd.config.load import load_run_sections
    from spmd.rundir.lease import LEASE_NAME, LeaseHeld, inspect_lease, refusal

    cfg = load_run_sections(config, overrides)
    state = inspect_lease(cfg.run.dir, cfg.run.lease_stale_s)
    if state is not None and not state.stale:
        raise LeaseHeld(refusal(cfg.run.dir / LEASE_NAME, state.holder,
                                time.time() - state.heartbeat_age_s, cfg.run.lease_stale_s))
    return (Path(cfg.run.dir), cfg.checkpoint.timeout_s, cfg.launch.kill_wait_s,
            cfg.launch.malloc_huge_pages)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL mpiexec and every process below it (the ranks run in sessions of their own,
    so a process group does not reach them; a stopped rank ends on nothing else)."""
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        below = []
    for p in [*reversed(below)]:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def preempted_ranks(run_dir: Path, offset: int) -> int:
    """How many ranks recorded a `preempted` stop in events.jsonl past byte `offset`."""
    try:
        with open(run_dir / "events.jsonl", "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return 0
    ranks = set()
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "preempted":
            ranks.add(event.get("rank"))
    return len(ranks)


def hang_line(run_dir: Path, since: float) -> str | None:
    """The hang report the ranks left in run.dir during this job (spmd.loop.trainer)."""
    path = run_dir / HUNG_FILE_NAME
    try:
        if path.stat().st_mtime < since:
            return None
        return str(json.loads(path.read_text())["line"])
    except (OSError, ValueError, KeyError):
        return None


def log_sizes(run_dir: Path) -> dict[Path, int]:
    """Byte size of every rank log now, so that only this job's lines are read later."""
    return {p: p.stat().st_size for p in (run_dir / "logs").glob("rank*.log")}


def error_lines(run_dir: Path, before: dict[Path, int], limit: int = 20) -> list[str]:
    """The ERROR lines the rank logs gained since `before` (the last `limit` of them)."""
    found: list[str] = []
    for path in sorted((run_dir / "logs").glob("rank*.log")):
        try:
            with open(path, "rb") as f:
                f.seek(before.get(path, 0))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        found += [line for line in text.splitlines() if " ERROR " in line]
    return found[-limit:]


def run(args: argparse.Namespace) -> int:
    """`spmd run`: start the ranks, forward signals, end with the table's status."""
    folder = Path(tempfile.mkdtemp(prefix=f"spmd-run-{os.getpid()}-"))
    try:
        return _run(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def preempted_before_start(received: int | None) -> int | None:
    """ExitCode.PREEMPTED, with a line, when a preemption signal came before the ranks ran."""
    if received is None:
        return None
    print(f"spmd run: {signal.Signals(received).name} received before the ranks were started: "
          f"nothing to save; exiting {int(ExitCode.PREEMPTED)} (preempted: requeue the job, "
          "the run resumes from its last checkpoint)", file=sys.stderr, flush=True)
    return ExitCode.PREEMPTED


def _run(args: argparse.Namespace, folder: Path) -> int:
    if (code := preempted_before_start(early_signal.HANDLER.received)) is not None:
        return code
    if args.n < 1:
        raise SpmdError(f"spmd run: -n {args.n}: need at least one rank")
    if args.ppn < 1 or args.n % args.ppn:
        raise SpmdError(f"spmd run: --ppn {args.ppn} does not divide -n {args.n} into equal nodes")
    mpiexec = find_mpiexec()
    overrides = verbose_overrides(args) if args.entry == "train" else args.overrides
    run_dir, save_s, kill_wait_s, huge_pages = (check_lease(args.config, overrides)
                                                if args.entry == "train"
                                                else (None, DEFAULT_SAVE_S, KILL_WAIT_S, True))
    before = log_sizes(run_dir) if run_dir is not None else {}
    events_before = file_size(run_dir / "events.jsonl") if run_dir is not None else 0
    started = time.time()
    # Open MPI's mpirun aborts the job on SIGTERM/SIGINT (the ranks are killed after
    # odls_base_sigkill_timeout and it exits 1); SIGUSR1 it forwards, and the ranks save and
    # stop on it just the same (spmd.launch.preemption)
    as_sent = ({signal.SIGTERM: signal.SIGUSR1, signal.SIGINT: signal.SIGUSR1}
               if mpi_flavor(mpiexec) == "openmpi" else {})
    # each rank behind a shim: Hydra then sees its exit code, not a death by signal, and
    # leaves the other ranks alive to name the lost one (see launch/rank_shim.py)
    rank_cmd = [sys.executable, rank_shim.__file__, sys.executable, "-m", "spmd.cli",
                *(["--debug"] if args.debug else []), *args.entry.split(), args.config,
                *overrides]
    cmd = [str(mpiexec), "-n", str(args.n), *flavor_args(mpiexec, save_s, kill_wait_s),
           *rank_cmd]
    if (code := preempted_before_start(early_signal.HANDLER.received)) is not None:
        return code
    print(f"spmd run: {args.n} ranks, {args.ppn} per node, via {mpiexec}", file=sys.stderr,
          flush=True)
    on_linux = sys.platform == "linux"
    env = console_env(child_env(args.ppn, huge_pages), sys.stderr)
    env[rank_shim.RUN_TMPDIR_VAR] = str(folder)
    proc = subprocess.Popen(cmd, env=env,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=rank_shim.die_with_parent if on_linux else None)
    copiers = [threading.Thread(target=copy_output, args=(pipe, target, OutputFilter(
                   quiet=not args.verbose)), daemon=True, name=f"spmd-run-{name}")
               for name, pipe, target in (("stdout", proc.stdout, sys.stdout.buffer),
                                          ("stderr", proc.stderr, sys.stderr.buffer))]
    for copier in copiers:
        copier.start()

    # SIGTERM/SIGINT: the ranks save and stop; those that have not ended after
    # checkpoint.timeout_s + launch.kill_wait_s (a stuck rank never reaches the step) are
    # killed. A second SIGINT (Ctrl-C twice) kills at once.
    ending: dict[str, float] = {}

    def forward(signum: int, frame: object) -> None:
        ending.setdefault("forwarded", float(as_sent.get(signum, signum)))  # what ranks got
        if signum in ENDING:
            if signum == signal.SIGINT and "SIGINT" in ending:
                ending["deadline"] = 0.0
            ending.setdefault(signal.Signals(signum).name, time.monotonic())
            ending.setdefault("signal", float(signum))
            ending.setdefault("deadline", time.monotonic() + save_s + kill_wait_s)
        try:
            os.killpg(proc.pid, as_sent.get(signum, signum))
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    if early_signal.HANDLER.received is not None:  # came while the ranks were being started
        forward(early_signal.HANDLER.received, None)
    all_ended: float | None = None   # when every rank had left its status
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if all_ended is None and len(rank_statuses(folder)) >= args.n:
                    all_ended = now
                if all_ended is not None and now - all_ended >= OUTLIVE_S:
                    # every rank has ended, and mpiexec lives on (Open MPI's mpirun, itself
                    # signalled, waits out odls_base_sigkill_timeout): end it (and only it:
                    # nothing of the job is left below it); the ranks' statuses decide
                    kill_job(proc)
                    proc.wait()
                    statuses = rank_statuses(folder)
                    code = next((c for c in statuses if c), 0)
                    break
                if "deadline" in ending and now >= ending["deadline"]:
                    stopped = len(rank_statuses(folder))
                    print(f"spmd run: {args.n - stopped} of {args.n} ranks did not stop within "
                          f"{save_s + kill_wait_s:.0f} s"
                          f" of {signal.Signals(int(ending['signal'])).name}"
                          f" (checkpoint.timeout_s={save_s:g} + launch.kill_wait_s="
                          f"{kill_wait_s:g}): killing "
                          "them; resume from the last committed checkpoint", file=sys.stderr,
                          flush=True)
                    kill_job(proc)
                    proc.wait()
                    # ranks that saved and stopped before the kill still name the status
                    decided = (job_status(rank_statuses(folder), args.n, received(ending))
                               if args.entry == "train" else None)
                    return decided if decided is not None else 128 + int(ending["signal"])
            except KeyboardInterrupt:  # a handler raced us; keep waiting for the ranks
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for copier in copiers:  # the ranks' last lines before this process's own
            copier.join(timeout=DRAIN_S)
    if code < 0 and all_ended is None:  # mpiexec was killed (kill -9): its ranks end with it
        print(f"spmd run: {mpiexec.name} (pid {proc.pid}) was killed by "
              f"{signal.Signals(-code).name}; its ranks end with it (their saves in flight "
              "stay uncommitted); resume from the last committed checkpoint", file=sys.stderr,
              flush=True)
    if code != 0 and run_dir is not None and (line := hang_line(run_dir, started)):
        print(f"spmd run: {line}", file=sys.stderr, flush=True)
        return ExitCode.HUNG
    # the table is `spmd train`'s (other entries keep the launcher's status); a rank of it
    # that died of the forwarded signal was still starting (it acts on the signal from its
    # CLI's first moment on)
    forwarded = int(ending["forwarded"]) if "forwarded" in ending else None
    statuses = rank_statuses(folder)
    decided = job_status(statuses, args.n, received(ending)) if args.entry == "train" else None
    if decided == ExitCode.PREEMPTED and forwarded is not None and (
            killed := sum(statuses.count(128 + s) for s in set(received(ending)))):
        names = "/".join(sorted({signal.Signals(c - 128).name for c in statuses
                                 if c - 128 in received(ending)}))
        print(f"spmd run: {killed} of {args.n} ranks ended by {names} "
              "while starting, before they could save anything: preempted, exiting "
              f"{int(ExitCode.PREEMPTED)} (requeue the job; the run resumes from its last "
              "checkpoint)", file=sys.stderr, flush=True)
    if (decided is None and args.entry == "train" and killed_starting(
            statuses, code, received(ending))):
        print(f"spmd run: {args.n - len(statuses)} of {args.n} ranks ended by "
              f"{signal.Signals(code - 128 if code > 128 else code).name} while starting "
              "(their shims "
              "too, before they could pass it on), before they could save anything: "
              f"preempted, exiting {int(ExitCode.PREEMPTED)} (requeue the job; the run "
              "resumes from its last checkpoint)", file=sys.stderr, flush=True)
        decided = ExitCode.PREEMPTED
    if decided is not None:  # the ranks' own statuses, not the launcher's (Hydra ORs them)
        code = decided
    elif (code != ExitCode.PREEMPTED and run_dir is not None
            and preempted_ranks(run_dir, events_before) >= args.n):
        # every rank saved and stopped; Open MPI's mpirun, which ORs nothing, says 0 or 1
        return ExitCode.PREEMPTED
    if code not in (0, ExitCode.PREEMPTED) and run_dir is not None and (
            errors := error_lines(run_dir, before)):
        print(f"spmd run: the ranks' errors (from {run_dir / 'logs'}):", file=sys.stderr)
        for line in errors:
            print(f"  {line}", file=sys.stderr)
        sys.stderr.flush()
    return code if code >= 0 else 128 - code
