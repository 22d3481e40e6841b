"""Recovery inside the allocation: what failed, and what the job script's supervisor does next.

Pure decisions, no processes: `spmd.launch.supervisor` gathers the evidence of one try of the
ranks (an `Outcome`: the launcher's exit status, the ranks it reports killed, the records the
ranks wrote to run.dir/events.jsonl during the try, and the hosts the scheduler reports down)
and `decide` turns it into a `Decision`:

    kind            evidence                                           what follows
    done            status 0                                           exit 0
    preempted       status 75, or the supervisor was signalled          exit with it: the
                                                                        job script requeues
                                                                        or stops, as always
    node_lost       a host of the try is down/drained for the scheduler, relaunch without it
                    or none of its ranks beats while the others do
                    (spmd.launch.liveness)
    error           a rank announced a Python exception (`failed`       stop, with its error
                    record) and its host is up                          (launch.retry_errors:
                                                                        relaunch, unless it
                                                                        repeats)
    user_error      an announced status of the table that no restart    stop (a shrunk try:
                    can change (2 config/model, 3, 65 non-finite,      requeue at full size)
                    73 lease, 130)
    hung            status 76 or a `hung` record                        relaunch in place
    process_lost    a rank died without a word (killed, OOM, crash),   relaunch in place
                    its host is up

A relaunch after `node_lost` leaves the failed hosts out and takes a spare; with none left,
launch.elastic=shrink goes on with fewer nodes, else the job is requeued (status 76, which the
job script requeues as after a failed node). Every relaunch counts against
launch.max_restarts; past it the job ends with the try's status.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from spmd.errors import ExitCode

RECORDS_NAME = "recovery.jsonl"   # what the supervisor writes to run.dir (spmd report reads it)
Elastic = Literal["requeue", "shrink"]
Action = Literal["exit", "relaunch", "shrink", "requeue", "stop"]
# statuses no relaunch can change: the same config, code and data fail the same way anywhere
NO_RETRY = {int(ExitCode.USER_ERROR), int(ExitCode.DOES_NOT_FIT), int(ExitCode.NONFINITE),
            int(ExitCode.LEASE_LOST), int(ExitCode.INTERRUPTED)}
ENDS = ("finished", "preempted", "stopped", "failed")
REQUEUE_STATUS = int(ExitCode.HUNG)   # the job script requeues on it "as after a failed node"
# what a survivor's collective or coordination client raises when a peer process or host is
# gone: not an error in the code (gloo/NCCL transport errors, JAX's coordination service)
COMM_ERROR = re.compile(
    r"connection (reset|refused|closed)|broken pipe|socket closed|gloo|nccl|rccl|"
    r"heartbeat|unhealthy|DEADLINE_EXCEEDED|UNAVAILABLE|coordination service|"
    r"failed to connect|peer .*(gone|closed|lost)|task .* (died|is dead)", re.I)


# ---------------------------------------------------------------- host lists


def expand_hostlist(text: str) -> list[str]:
    """Slurm/Flux hostlist syntax to names: 'n[01-03,7],login1' -> n01 n02 n03 n7 login1."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", part)
        if not m:
            if part:
                hosts.append(part)
            continue
        prefix, ranges, rest = m.groups()
        for tail in expand_hostlist(rest) if rest else [""]:
            for r in ranges.split(","):
                a, _, b = r.partition("-")
                if not b:
                    hosts.append(f"{prefix}{a}{tail}")
                    continue
                width = len(a) if a.startswith("0") else 0
                hosts += [f"{prefix}{i:0{width}d}{tail}" for i in range(int(a), int(b) + 1)]
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    out.append(cur)
    return [p.strip() for p in out if p.strip()]


# ---------------------------------------------------------------- evidence


@dataclass
class Outcome:
    """What one try of the ranks left behind."""

    status: int                                   # the launcher's exit status (signal: 128+N)
    records: list[dict] = field(default_factory=list)   # events.jsonl records of this try
    killed_ranks: dict[int, str] = field(default_factory=dict)  # rank -> how (the launcher's)
    exited_ranks: set[int] = field(default_factory=set)   # ranks the launcher saw exit
    reported_ranks: set[int] = field(default_factory=set)  # any other rank it said ended
    down_hosts: list[str] = field(default_factory=list)   # hosts the scheduler reports down
    failed_nodes: list[str] = field(default_factory=list)  # nodes the launcher reports failed
    silent_hosts: list[str] = field(default_factory=list)  # hosts that stopped beating
    signalled: bool = False                       # the supervisor got a stop/warning signal
    started_at: float = 0.0
    ended_at: float = 0.0

    def hosts_of_ranks(self) -> dict[int, str]:
        return {int(e["rank"]): str(e["host"]) for e in self.records
                if e.get("event") == "started" and "host" in e}

    def announced(self) -> dict | None:
        """The `failed` record every rank followed (`first`), else the earliest one."""
        failed = sorted((e for e in self.records if e.get("event") == "failed"),
                        key=lambda e: (not e.get("first", False), float(e.get("time", 0))))
        return failed[0] if failed else None

    def vanished_hosts(self) -> list[str]:
        """Hosts none of whose ranks is accounted for (an exit the launcher saw, a death by a
        signal it reported, an end record), when the launcher reports exits at all: a node,
        or its network, that went away with every rank on it."""
        if not self.exited_ranks:
            return []
        ended = ended_ranks(self.records)
        seen = ended | self.exited_ranks | set(self.killed_ranks) | self.reported_ranks
        by_host: dict[str, list[int]] = {}
        for rank, host in self.hosts_of_ranks().items():
            by_host.setdefault(host, []).append(rank)
        return [h for h, ranks in by_host.items() if not seen.intersection(ranks)]

    def dead_hosts(self) -> list[str]:
        """Hosts every rank of which the launcher reports dead by a signal, or (when it
        reports exits) unaccounted for: the node itself is suspect."""
        ended = ended_ranks(self.records)
        alive = ended | self.exited_ranks | (self.reported_ranks - set(self.killed_ranks))
        by_host: dict[str, list[int]] = {}
        for rank, host in self.hosts_of_ranks().items():
            by_host.setdefault(host, []).append(rank)
        return [h for h, ranks in by_host.items() if not alive.intersection(ranks)
                and (self.exited_ranks or set(ranks) <= set(self.killed_ranks))]

    def silent_ranks(self) -> list[int]:
        """Ranks that started but wrote no end record (killed, or ended by a watchdog)."""
        ended = ended_ranks(self.records)
        return sorted(set(self.hosts_of_ranks()) - ended)

    def last_record_time(self, ranks: Iterable[int]) -> float | None:
        wanted = set(ranks)
        times = [float(e["time"]) for e in self.records
                 if int(e.get("rank", -1)) in wanted and "time" in e]
        return max(times) if times else None


def ended_ranks(records: Iterable[dict]) -> set[int]:
    """The ranks whose own end record (finished, preempted, stopped, failed) is in
    `records`."""
    return {int(e["rank"]) for e in records if e.get("event") in ENDS and "rank" in e}


def only_silent_hosts_left(records: list[dict], exited: set[int],
                           killed: dict[int, str]) -> list[str]:
    """The hosts a launcher still waits for when every rank elsewhere is accounted for (an
    exit it reported, a death by a signal, an end record) and none of theirs is: srun waits
    for a dead node's tasks until the scheduler gives up on the node (SlurmdTimeout, 300 s by
    default), while the survivors have long ended. Empty when the launcher reported no exit
    (a healthy try ends with status 0 and no such lines)."""
    out = Outcome(status=0, records=records, killed_ranks=killed, exited_ranks=exited)
    silent = out.vanished_hosts()
    if not silent:
        return []
    ended = ended_ranks(records)
    accounted = ended | exited | set(killed)
    others = [r for r, h in out.hosts_of_ranks().items() if h not in silent]
    return silent if others and all(r in accounted for r in others) else []


def of_try(record: object, since: float, attempt: int | None) -> bool:
    """Whether an events.jsonl record belongs to the try that started at `since`: written at
    or after it and, where the rank named its try (`attempt`, from SPMD_RECOVERY_ATTEMPT),
    by a rank of that try. A rank of the try before that ends late (a task the launcher had
    not killed yet when the next try started) writes after `since` too, and its failure is
    not the new try's."""
    if not isinstance(record, dict) or float(record.get("time", 0)) < since:
        return False
    return attempt is None or record.get("attempt", attempt) == attempt


def read_records(run_dir: Path, since: float, attempt: int | None = None) -> list[dict]:
    """events.jsonl records of the try that started at `since` (`of_try`; a cut-short line
    is skipped)."""
    path = Path(run_dir) / "events.jsonl"
    out: list[dict] = []
    if not path.is_file():
        return out
    with open(path, errors="replace") as fh:
        for line in fh:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if of_try(e, since, attempt):
                out.append(e)
    return out


_TASK_LINE = re.compile(r"tasks? (\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*): (Killed|Terminated|"
                        r"Segmentation fault|Aborted|Bus error|Out Of Memory|[A-Z][a-z ]+)")


def _task_lines(text: str) -> list[tuple[int, str]]:
    out = []
    for m in _TASK_LINE.finditer(text):
        for part in m.group(1).split(","):
            a, _, b = part.partition("-")
            out += [(r, m.group(2).strip()) for r in range(int(a), int(b or a) + 1)]
    return out


def killed_from_launcher(text: str) -> dict[int, str]:
    """Ranks srun reports dead by a signal ('srun: error: n1: task 1: Killed'), rank -> how."""
    return {r: how for r, how in _task_lines(text) if not how.startswith("Exited")}


def exited_from_launcher(text: str) -> set[int]:
    """Ranks srun saw exit with a status ('task 0: Exited with exit code 69'): their host was
    there to report it."""
    return {r for r, how in _task_lines(text) if how.startswith("Exited")}


def failed_nodes_from_launcher(text: str) -> list[str]:
    """Nodes srun reports failed ('srun: error: Node failure on n3')."""
    return list(dict.fromkeys(re.findall(r"Node failure on (\S+)", text)))


# ---------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Plan:
    """The job's shape and the `launch:` keys of recovery."""

    nodes: int                  # nodes the ranks train on
    ranks_per_node: int
    hosts: tuple[str, ...] = ()  # the allocation's hosts (nodes + spares), when known
    elastic: Elastic = "requeue"
    max_restarts: int = 0
    retry_errors: bool = False
    can_exclude: bool = True    # the launcher can leave hosts out (not LSF jsrun)


@dataclass
class State:
    """What the supervisor carries from try to try."""

    nodes: int
    excluded: list[str] = field(default_factory=list)
    restarts: int = 0
    last_error: str | None = None
    shrunk: bool = False


@dataclass(frozen=True)
class Decision:
    """What to do after a try: `action`, why, and the world of the next try."""

    action: Action
    kind: str
    cause: str
    status: int                  # the status to exit with (action exit/stop/requeue)
    nodes: int = 0               # nodes of the next try (relaunch/shrink)
    exclude: tuple[str, ...] = ()  # every host the next try leaves out
    failed_rank: int | None = None
    failed_hosts: tuple[str, ...] = ()
    failed_at: float | None = None   # the earliest evidence of the failure
    suspects: tuple[str, ...] = ()   # hosts where every rank died: left out while spares last

    def as_record(self) -> dict:
        d = asdict(self)
        d["exclude"], d["failed_hosts"] = list(self.exclude), list(self.failed_hosts)
        d["suspects"] = list(self.suspects)
        return d


def _who(rank: int | None, host: str | None) -> str:
    if rank is None:
        return host or "?"
    return f"rank {rank}" + (f" on {host}" if host else "")


def classify(out: Outcome, plan: Plan, state: State) -> Decision:
    """What happened in a try (the action left to `decide`: 'exit' or 'relaunch')."""
    hosts = out.hosts_of_ranks()
    used = set(hosts.values()) or set(plan.hosts)
    st = int(out.status)
    if st == 0:
        return Decision("exit", "done", "the ranks finished", 0)
    if out.signalled or st == int(ExitCode.PREEMPTED):
        return Decision("exit", "preempted", "the ranks saved and stopped (a signal)", st)
    down = [h for h in dict.fromkeys([*out.down_hosts, *out.failed_nodes])
            if h in used or not hosts]
    why = "is down for the scheduler"
    if not down and out.silent_hosts:
        down = list(out.silent_hosts)
        why = ("stopped beating (none of its ranks sent a liveness beat for "
               "launch.node_timeout_s, and neither they nor the launcher reported an end)")
    if not down and out.vanished_hosts():
        down = out.vanished_hosts()
        why = "vanished with every rank on it (no exit status from the launcher)"
    if down:
        ranks = sorted(r for r, h in hosts.items() if h in down)
        first = ranks[0] if ranks else None
        when = out.last_record_time(ranks) if ranks else None
        return Decision("relaunch", "node_lost", f"node {', '.join(down)} {why}"
                        + (f" (ranks {', '.join(map(str, ranks))})" if ranks else ""), st,
                        failed_rank=first, failed_hosts=tuple(down), failed_at=when)
    failed = out.announced()
    if failed is not None and "error" in failed:
        rank, host = failed.get("rank"), failed.get("host")
        code = int(failed.get("exit_code", st) or st)
        line = f"{_who(rank, host)} failed: {failed['error']}"
        when = float(failed.get("time", out.ended_at))
        if code in NO_RETRY:
            return Decision("stop", "user_error", line, code, failed_rank=rank,
                            failed_hosts=(host,) if host else (), failed_at=when)
        if code == int(ExitCode.HUNG):
            return Decision("relaunch", "hung", line, code, failed_rank=rank, failed_at=when)
        if not out.killed_ranks:
            if COMM_ERROR.search(str(failed["error"])):   # a peer gone, seen by a survivor
                return Decision("relaunch", "process_lost", f"{line} (a lost peer: the "
                                "error is the network's, not the code's)", st,
                                failed_rank=rank, failed_at=when,
                                suspects=tuple(out.dead_hosts()))
            return Decision("relaunch", "error", line, code, failed_rank=rank,
                            failed_hosts=(host,) if host else (), failed_at=when)
    hung = [e for e in out.records if e.get("event") == "hung"]
    if hung or st == int(ExitCode.HUNG):
        line = str(hung[0].get("line") or "no step within launch.step_timeout_s") if hung \
            else "the ranks hung (no step within launch.step_timeout_s)"
        when = float(hung[0]["time"]) if hung else None
        return Decision("relaunch", "hung", line, int(ExitCode.HUNG), failed_at=when)
    killed = sorted(out.killed_ranks) or out.silent_ranks()
    if out.killed_ranks:
        rank = killed[0]
        how = out.killed_ranks[rank]
        cause = f"{_who(rank, hosts.get(rank))} died ({how}) without an error of its own"
    elif killed:
        rank = killed[0]
        cause = (f"ranks {', '.join(map(str, killed))} ended without a word (status {st}: "
                 "killed, out of memory, or ended by a watchdog); first "
                 f"{_who(rank, hosts.get(rank))}")
    else:
        rank = None
        cause = f"the launcher ended with status {st} and no rank said why"
    when = out.last_record_time([rank]) if rank is not None else None
    return Decision("relaunch", "process_lost", cause, st, failed_rank=rank,
                    failed_hosts=(hosts[rank],) if rank in hosts else (), failed_at=when,
                    suspects=tuple(out.dead_hosts()))


def decide(out: Outcome, plan: Plan, state: State) -> Decision:
    """The next step after a try; updates nothing (the supervisor applies it to `state`)."""
    d = classify(out, plan, state)
    if d.action in ("exit", "stop"):
        if d.kind == "user_error" and state.shrunk:   # the shrunk world does not fit the config
            return _with(d, "requeue", REQUEUE_STATUS,
                         f"{d.cause} (on {state.nodes} nodes after shrinking: requeueing at "
                         f"{plan.nodes} nodes)")
        return d
    if d.kind == "error":
        if not plan.retry_errors:
            return _with(d, "stop", d.status, f"{d.cause} (an error in the code or data: not "
                         "retried; launch.retry_errors=true retries it)")
        if state.last_error is not None and _same_error(state.last_error, d.cause):
            return _with(d, "stop", d.status, f"{d.cause} (the same error as the try before: "
                         "not retried again)")
    if state.restarts >= plan.max_restarts:
        why = f"launch.max_restarts={plan.max_restarts} restart(s) used"
        if d.kind == "node_lost":
            return _with(d, "requeue", REQUEUE_STATUS, f"{d.cause}; {why}: requeueing")
        return _with(d, "stop", d.status if d.status else 1, f"{d.cause}; {why}: ending")
    exclude = tuple(dict.fromkeys([*state.excluded, *out.down_hosts,
                                   *(d.failed_hosts if d.kind == "node_lost" else ())]))
    if d.kind != "node_lost":
        spare = [h for h in plan.hosts if h not in exclude and h not in d.suspects]
        if d.suspects and plan.can_exclude and len(spare) >= state.nodes:
            return _with(d, "relaunch", d.status, f"{d.cause}; leaving out "
                         f"{', '.join(d.suspects)}, where every rank died, while a spare is "
                         "there", nodes=state.nodes, exclude=(*exclude, *d.suspects))
        return _with(d, "relaunch", d.status, d.cause, nodes=state.nodes, exclude=exclude)
    if not plan.can_exclude:
        return _with(d, "requeue", REQUEUE_STATUS, f"{d.cause}; this launcher cannot leave a "
                     "node out: requeueing")
    left = [h for h in plan.hosts if h not in exclude] if plan.hosts else None
    if left is None:   # hosts unknown: trust that the allocation holds the spares asked for
        return _with(d, "relaunch", d.status, d.cause, nodes=state.nodes, exclude=exclude)
    if len(left) >= state.nodes:
        return _with(d, "relaunch", d.status, d.cause, nodes=state.nodes, exclude=exclude)
    if plan.elastic == "shrink" and left:
        return _with(d, "shrink", d.status, f"{d.cause}; no spare left: going on with "
                     f"{len(left)} node(s) instead of {state.nodes} (launch.elastic=shrink)",
                     nodes=len(left), exclude=exclude)
    return _with(d, "requeue", REQUEUE_STATUS, f"{d.cause}; no spare node left "
                 f"(launch.elastic={plan.elastic}): requeueing")


def _with(d: Decision, action: Action, status: int, cause: str, **kw: object) -> Decision:
    return Decision(action, d.kind, cause, status, failed_rank=d.failed_rank,
                    failed_hosts=d.failed_hosts, failed_at=d.failed_at, suspects=d.suspects,
                    **kw)  # type: ignore[arg-type]


def _same_error(a: str, b: str) -> bool:
    """The same error, whichever rank or host raised it."""
    strip = lambda s: re.sub(r"^rank \d+( on \S+)? failed: ", "", s).split(" (")[0]  # noqa: E731
    return strip(a) == strip(b)


def apply(state: State, d: Decision) -> State:
    """`state` after a relaunch or shrink by `d`."""
    return State(nodes=d.nodes or state.nodes, excluded=list(d.exclude),
                 restarts=state.restarts + 1,
                 last_error=d.cause if d.kind == "error" else None,
                 shrunk=state.shrunk or d.action == "shrink")


def choose_hosts(plan: Plan, state: State) -> list[str]:
    """The hosts of the next try, in allocation order (empty: the launcher chooses)."""
    return [h for h in plan.hosts if h not in state.excluded][:state.nodes]


def summary(decisions: Sequence[dict]) -> str:
    """One line per recovery record, for logs."""
    return "\n".join(f"try {d.get('attempt')}: {d.get('kind')} -> {d.get('action')}: "
                     f"{d.get('cause')}" for d in decisions)
