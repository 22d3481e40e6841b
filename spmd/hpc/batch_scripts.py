"""Batch scripts for a system profile: render (Jinja2 templates in jobscripts/); submitting
and chaining them is spmd.hpc.job_submit.

A rendered script asks for nodes and wall time, runs the site's set-up lines (the profile's
`setup` and `--setup`), exports the profile's environment, runs
`spmd train CONFIG overrides...` on every rank under the system's launcher, forwards the
scheduler's warning signal to the ranks and requeues the job when they exit with status 75
(preempted, checkpoint saved). See the header of any rendered script for the protocol.
With spares or a restart budget (`--spare-nodes`, launch.spare_nodes / launch.max_restarts /
launch.elastic) the job holds nodes + spares and runs the ranks under the recovery supervisor
(spmd.launch.supervisor), which starts them again inside the allocation after a lost node
(docs/recovery.md). Every script turns JAX's compilation cache on (run.dir/xla_cache) unless
run.compilation_cache or JAX_COMPILATION_CACHE_DIR says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spmd import jobscripts
from spmd.comm.hang_watchdog import HUNG_FILE_NAME
from spmd.errors import ExitCode, SpmdError
from spmd.hpc.systems import Scheduler, SystemProfile, system_profile
from spmd.launch.preemption import HALT_FILE_NAME

FORWARD_SIGNAL = "USR2"    # what the batch shell sends the ranks (NCCL may own SIGUSR1)
TEMPLATE_DIR = Path(jobscripts.__file__).resolve().parent

DIRECTIVE_PREFIX: dict[str, str] = {"slurm": "#SBATCH", "lsf": "#BSUB", "pbs": "#PBS",
                                    "flux": "#flux:"}
# Signals the batch shell traps. "requeue": out of time or preempted -> save, then requeue.
# "stop": cancelled by the user (scancel, bkill, flux cancel) -> save, do not requeue. PBS sends
# SIGTERM for both qdel and preemption and no warning before the walltime: it counts as requeue.
TRAPPED_SIGNALS: dict[str, dict[str, str]] = {
    "slurm": {"USR1": "requeue", "USR2": "requeue", "TERM": "stop", "INT": "stop"},
    "lsf": {"USR1": "requeue", "USR2": "requeue", "TERM": "stop", "INT": "stop"},
    "pbs": {"USR1": "requeue", "USR2": "requeue", "TERM": "requeue", "INT": "stop"},
    "flux": {"USR1": "requeue", "USR2": "requeue", "TERM": "stop", "INT": "stop"},
}
_TIME_RE = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


# ---------------------------------------------------------------- wall time


def parse_walltime(text: str) -> int:
    """Seconds in `MM`, `H:MM`, `H:MM:SS` or `D-H:MM:SS` (the --time option)."""
    m = _TIME_RE.match(str(text).strip())
    bad = SpmdError(f"--time '{text}' is not a wall time: use MM (minutes), H:MM, H:MM:SS or "
                    "D-H:MM:SS, e.g. --time 30 or --time 2:00 or --time 01:30:00")
    if not m:
        raise bad
    d, a, b, c = (int(g) if g is not None else None for g in m.group("d", "a", "b", "c"))
    if b is None:          # MM (or D-H)
        seconds = a * 3600 if d is not None else a * 60
    elif c is None:        # H:MM
        if b >= 60:
            raise bad
        seconds = a * 3600 + b * 60
    else:                  # H:MM:SS
        if b >= 60 or c >= 60:
            raise bad
        seconds = a * 3600 + b * 60 + c
    seconds += (d or 0) * 86400
    if seconds <= 0:
        raise SpmdError(f"--time '{text}' must be longer than zero")
    return seconds


def format_walltime(seconds: int, scheduler: Scheduler) -> str:
    """The wall time as the scheduler wants it (LSF: H:MM, rounded up to a minute)."""
    if scheduler == "lsf":
        minutes = math.ceil(seconds / 60)
        return f"{minutes // 60}:{minutes % 60:02d}"
    if scheduler == "flux":
        return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"
    h, rest = divmod(seconds, 3600)
    if scheduler == "slurm" and h >= 24:
        return f"{h // 24}-{h % 24:02d}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{h:02d}:{rest // 60:02d}:{rest % 60:02d}"


def default_signal_lead(walltime_s: int) -> int:
    """Seconds of warning before the time limit: 10% of it, 30 s .. 5 min, at most half."""
    return max(1, min(300, max(30, walltime_s // 10), walltime_s // 2))


# ---------------------------------------------------------------- the request


@dataclass(frozen=True)
class JobRequest:
    """Everything a batch script is rendered from; build it with `make_request`."""

    system: SystemProfile
    config: Path
    overrides: tuple[str, ...]
    run_dir: Path
    nodes: int
    walltime_s: int
    ranks_per_node: int
    gpus_per_node: int
    job_name: str
    signal_lead_s: int
    workdir: Path
    python: str = sys.executable
    account: str | None = None
    queue: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    script_path: Path | None = None
    command: tuple[str, ...] = ()  # each rank's command; () = `python -m spmd.cli train ...`
    setup: tuple[str, ...] = ()       # --setup shell lines, after the profile's own
    setup_args: tuple[str, ...] = ()  # the --setup values as given (files or lines)
    notes: tuple[str, ...] = field(default=(), compare=False)
    spare_nodes: int = 0              # nodes held beyond `nodes` for recovery
    max_restarts: int = 0             # relaunches inside the allocation (0: no supervisor)
    elastic: str = "requeue"          # launch.elastic
    retry_errors: bool = False        # launch.retry_errors
    node_timeout_s: float = 2.0       # launch.node_timeout_s

    @property
    def recovery(self) -> bool:
        """Whether the ranks run under the recovery supervisor."""
        return self.max_restarts > 0

    @property
    def alloc_nodes(self) -> int:
        """Nodes the job asks the scheduler for: the training nodes and the spares."""
        return self.nodes + self.spare_nodes

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def devices_per_rank(self) -> int:
        """Devices each rank drives: its bound GPU, its share of the node's GPUs, or (no
        GPUs) JAX_NUM_CPU_DEVICES from --env or the profile (default 1), as spmd.launch
        decides at start-up."""
        if not self.gpus_per_node:
            value = dict(self.env).get("JAX_NUM_CPU_DEVICES",
                                       self.system.env.get("JAX_NUM_CPU_DEVICES", "1"))
            return int(value) if str(value).isdigit() and int(value) > 0 else 1
        return self.system.gpus_per_rank or self.gpus_per_node // self.ranks_per_node

    @property
    def devices(self) -> int:
        """The job's device count: the size of the mesh every rank builds."""
        return self.ranks * self.devices_per_rank

    def describe_world(self) -> str:
        """E.g. 'frontier, 8 nodes x 8 GPUs = 64 devices'."""
        per_node = self.ranks_per_node * self.devices_per_rank
        unit = "GPU" if self.gpus_per_node else "CPU device"
        return (f"{self.system.name}, {self.nodes} node{'s' * (self.nodes != 1)} x {per_node} "
                f"{unit}{'s' * (per_node != 1)} = {self.devices} device"
                f"{'s' * (self.devices != 1)}")

    @property
    def scheduler(self) -> Scheduler:
        return self.system.scheduler

    def default_script_path(self) -> Path:
        return self.run_dir / f"job.{self.system.name}.sh"


def _positive(value: int | None, option: str) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise SpmdError(f"{option} must be a positive integer, got {value!r}")


def _check_directive_text(value: str, what: str) -> None:
    if not value or any(ch.isspace() for ch in value) or any(ch in value for ch in "\"'`$\\"):
        raise SpmdError(f"{what} '{value}' cannot go into a batch directive: use no whitespace, "
                        "quotes, '$' or backslashes")


def make_request(config: str | Path, *, system: str, nodes: int, time: str,
                 overrides: Sequence[str] = (), account: str | None = None,
                 queue: str | None = None, ranks_per_node: int | None = None,
                 gpus_per_node: int | None = None, job_name: str | None = None,
                 env: Sequence[str] | Mapping[str, str] = (), signal_lead_s: int | None = None,
                 script_path: str | Path | None = None,
                 workdir: str | Path | None = None, setup: Sequence[str] = (),
                 spare_nodes: int | None = None) -> JobRequest:
    """Validate the options and load the config (schema and overrides).

    `spare_nodes` (--spare-nodes) overrides launch.spare_nodes, and is passed on to the ranks
    as that override.

    The checks against the world the job will have (mesh, batch, pipeline, memory) need
    JAX and stand-in devices: `spmd.aot.job_check.check_job` runs them.
    """
    from spmd.config.load import load_config

    profile = system_profile(system)
    _positive(nodes, "--nodes")
    _positive(ranks_per_node, "--ranks-per-node")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 0):
        raise SpmdError(f"--gpus-per-node must be 0 or more, got {gpus_per_node!r}")
    if spare_nodes is not None and (not isinstance(spare_nodes, int) or spare_nodes < 0):
        raise SpmdError(f"--spare-nodes must be 0 or more, got {spare_nodes!r}")
    walltime_s = parse_walltime(time)
    workdir = Path(workdir or Path.cwd()).resolve()
    if spare_nodes is not None:
        overrides = [*overrides, f"launch.spare_nodes={spare_nodes}"]
    config_path = Path(config)
    config_path = (config_path if config_path.is_absolute() else workdir / config_path).resolve()
    cfg = load_config(config_path, list(overrides))
    run_dir = Path(cfg.run.dir)
    run_dir = run_dir if run_dir.is_absolute() else workdir / run_dir
    _check_directive_text(str(run_dir), "run.dir")

    gpus = profile.gpus_per_node if gpus_per_node is None else gpus_per_node
    rpn = ranks_per_node or (gpus if gpus_per_node is not None and gpus else
                             profile.ranks_per_node)
    if profile.gpus_per_node and rpn > profile.gpus_per_node and profile.name != "slurm":
        raise SpmdError(f"--ranks-per-node {rpn} is more than the {profile.gpus_per_node} GPUs "
                        f"per node of '{profile.name}' (one rank per GPU)")
    if gpus and not profile.gpus_per_rank and gpus % rpn:
        fits = ", ".join(str(k) for k in range(1, gpus + 1) if gpus % k == 0)
        raise SpmdError(f"--ranks-per-node {rpn} does not divide the {gpus} GPUs per node of "
                        f"'{profile.name}' (each rank takes an equal share): use {fits}")
    if signal_lead_s is None:
        lead = default_signal_lead(walltime_s)
    else:
        lead = signal_lead_s
        if not isinstance(lead, int) or not 0 < lead < walltime_s:
            raise SpmdError(f"--signal-before must be between 1 and the wall time "
                            f"({walltime_s} s) in seconds, got {signal_lead_s!r}")

    overrides = tuple(overrides)
    notes: list[str] = []
    launch = cfg.launch
    restarts = launch.restarts()
    if restarts and profile.scheduler == "lsf":
        notes.append("LSF's jsrun cannot leave a failed node out: the job restarts in place "
                     "after a lost rank or a hang, and requeues after a lost node "
                     "(docs/recovery.md)")
    margin = getattr(getattr(cfg, "launch", None), "walltime_margin_s", None)
    if margin is not None and margin >= walltime_s / 2 and not any(
            o.startswith("launch.walltime_margin_s=") for o in overrides):
        # The trainer stops `margin` seconds before the allocation ends; with a short job
        # that would be at once. Stop when the scheduler's warning would come instead.
        overrides += (f"launch.walltime_margin_s={lead}",)
        notes.append(f"launch.walltime_margin_s={margin:g} s is at least half of --time; "
                     f"the script passes launch.walltime_margin_s={lead}")

    account = account or None
    queue = queue or profile.default_queue
    for value, what in ((account, "--account"), (queue, "--queue")):
        if value is not None:
            _check_directive_text(value, what)
    if profile.requires_account and not account:
        notes.append(f"'{profile.name}' charges jobs to a project: pass --account "
                     "(the scheduler will likely reject the job without it)")
    name = job_name or f"spmd-{run_dir.name}"
    _check_directive_text(name, "--job-name")

    pairs = env.items() if isinstance(env, Mapping) else [_split_env(e) for e in env]
    env_pairs = tuple((str(k), str(v)) for k, v in pairs)
    return JobRequest(
        system=profile, config=config_path, overrides=overrides, run_dir=run_dir, nodes=nodes,
        walltime_s=walltime_s, ranks_per_node=rpn, gpus_per_node=gpus, job_name=name,
        signal_lead_s=lead, workdir=workdir, account=account, queue=queue, env=env_pairs,
        script_path=Path(script_path).resolve() if script_path else None,
        setup=setup_lines(setup, workdir), setup_args=tuple(setup), notes=tuple(notes),
        spare_nodes=launch.spare_nodes, max_restarts=restarts, elastic=launch.elastic,
        retry_errors=launch.retry_errors, node_timeout_s=launch.node_timeout_s)


def setup_lines(items: Sequence[str], workdir: Path | None = None) -> tuple[str, ...]:
    """The shell lines of the --setup values: a file's lines (relative to `workdir`; without
    its #! line), or the value itself (one line or several)."""
    lines: list[str] = []
    for item in items:
        text = str(item)
        word = text.strip()
        single = bool(word) and not any(c.isspace() for c in word)   # a file name?
        path = Path(word).expanduser()
        if workdir is not None and not path.is_absolute():
            path = workdir / path
        if single and path.is_file():
            try:
                got = path.read_text().splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise SpmdError(f"--setup {text}: cannot read it ({e})") from None
            if got and got[0].startswith("#!"):
                got = got[1:]
        elif single and ("/" in text or text.endswith(".sh")):
            raise SpmdError(f"--setup {text}: no such file; give a file of shell lines or the "
                            f"lines themselves, e.g. --setup 'module load rocm'")
        else:
            got = text.splitlines()
        lines += [line.rstrip() for line in got]
    while lines and not lines[-1]:
        lines.pop()
    return tuple(lines)


def _split_env(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise SpmdError(f"--env '{item}' is not of the form NAME=value")
    return key, value


# ---------------------------------------------------------------- rendering


def _environment():
    import jinja2

    if not TEMPLATE_DIR.is_dir():
        raise SpmdError(f"job-script templates not found at {TEMPLATE_DIR} (the jobscripts/ "
                        "folder of the spmd source tree); reinstall spmd from its source tree")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env


def _fields(req: JobRequest) -> dict[str, object]:
    return {"nodes": req.alloc_nodes, "ranks": req.alloc_nodes * req.ranks_per_node,
            "ranks_per_node": req.ranks_per_node,
            "cpus_per_task": req.system.cpus_per_task or 1, "gpus_per_node": req.gpus_per_node,
            "mpi": req.system.mpi or "", "bind": '"$SPMD_BIND"' if req.system.bind_wrapper else ""}


def command_line(req: JobRequest) -> str:
    """The `spmd jobscript` command that renders this script again."""
    parts = ["spmd", "jobscript", str(req.config), "--system", req.system.name, "--nodes",
             str(req.nodes), "--time", format_walltime(req.walltime_s, "pbs"),
             "--ranks-per-node", str(req.ranks_per_node)]
    if req.gpus_per_node != req.system.gpus_per_node:
        parts += ["--gpus-per-node", str(req.gpus_per_node)]
    for opt, value in (("--account", req.account), ("--queue", req.queue)):
        if value:
            parts += [opt, value]
    for k, v in req.env:
        parts += ["--env", f"{k}={v}"]
    for item in req.setup_args:  # one option per line: the command stays on one line
        parts += [x for line in (item.splitlines() or [item]) for x in ("--setup", line)]
    return shlex.join(parts + list(req.overrides))


def render(req: JobRequest) -> str:
    """The batch script for `req` as text."""
    p = req.system
    fields = _fields(req)
    directives = [d.format(**fields) for d in p.directives]
    if p.name == "slurm" and req.gpus_per_node:
        directives.append(f"--gpus-per-node={req.gpus_per_node}")
    launcher = p.launcher.format(**{**fields, "nodes": req.nodes, "ranks": req.ranks}).strip()
    train = list(req.command) or [req.python, "-m", "spmd.cli", "train", str(req.config),
                                  *req.overrides]
    supervisor = supervisor_command(req) if req.recovery else ""
    ctx = {
        "req": req, "system": p, "scheduler": p.scheduler,
        "prefix": DIRECTIVE_PREFIX[p.scheduler],
        "nodes": req.nodes, "ranks": req.ranks, "ranks_per_node": req.ranks_per_node,
        "alloc_nodes": req.alloc_nodes, "spare_nodes": req.spare_nodes,
        "recovery": req.recovery, "supervisor": supervisor, "max_restarts": req.max_restarts,
        "elastic": req.elastic,
        "cpus_per_task": p.cpus_per_task, "gpus_per_node": req.gpus_per_node,
        "walltime": format_walltime(req.walltime_s, p.scheduler),
        "walltime_hms": format_walltime(req.walltime_s, "pbs"), "walltime_s": req.walltime_s,
        "lead_s": req.signal_lead_s, "lead_min": max(1, math.ceil(req.signal_lead_s / 60)),
        "account": p.account_option.format(req.account) if req.account else None,
        "queue": p.queue_option.format(req.queue) if req.queue else None,
        "job_name": req.job_name, "run_dir": str(req.run_dir), "workdir": str(req.workdir),
        "directives": directives,
        "xla_flags": " ".join(p.xla_flags),
        "env": list(p.env.items()) + list(req.env),
        "setup": list(p.setup) + list(req.setup),
        "launcher": launcher, "train_command": " ".join(shlex.quote(a) for a in train),
        "bind_wrapper": (p.bind_wrapper.replace("{gpus_per_node}", str(req.gpus_per_node))
                         if p.bind_wrapper else None),
        "halt_file": HALT_FILE_NAME, "preempted_exit": int(ExitCode.PREEMPTED),
        "hung_file": HUNG_FILE_NAME, "hung_exit": int(ExitCode.HUNG),
        "forward_signal": FORWARD_SIGNAL, "traps": TRAPPED_SIGNALS[p.scheduler],
        "script_path": str(req.script_path) if req.script_path else "",
        "command_line": command_line(req),
    }
    text = _environment().get_template(f"{p.scheduler}.sh.j2").render(**ctx)
    return text if text.endswith("\n") else text + "\n"


def supervisor_command(req: JobRequest) -> str:
    """The line that runs the ranks under spmd.launch.supervisor (one shell line, its
    continuation `\\` left to the template): the profile's launcher with {nodes} and {ranks}
    open, and "$SPMD_BIND" for the supervisor to expand."""
    p = req.system
    fields = {**_fields(req), "nodes": "{nodes}", "ranks": "{ranks}",
              "bind": "$SPMD_BIND" if p.bind_wrapper else ""}
    template = " ".join(p.launcher.format(**fields).split())
    argv = [req.python, "-m", "spmd.launch.supervisor", "--scheduler", p.scheduler,
            "--run-dir", str(req.run_dir), "--nodes", str(req.nodes), "--ranks-per-node",
            str(req.ranks_per_node), "--elastic", req.elastic, "--max-restarts",
            str(req.max_restarts), "--node-timeout", f"{req.node_timeout_s:g}"]
    if req.retry_errors:
        argv.append("--retry-errors")
    return " ".join(shlex.quote(a) for a in argv) + " --launcher " + shlex.quote(template)


def write_script(req: JobRequest, path: Path | None = None) -> Path:
    """Render into `path` (default `<run.dir>/job.<system>.sh`), executable; makes run.dir."""
    path = Path(path or req.script_path or req.default_script_path()).resolve()
    if req.script_path != path:
        req = dataclasses.replace(req, script_path=path)
    text = render(req)
    req.run_dir.mkdir(parents=True, exist_ok=True)  # the scheduler writes its output file here
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
