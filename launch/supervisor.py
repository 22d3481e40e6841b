"""The job script's recovery supervisor: start the ranks, and start them again in the same
allocation when a node or a rank is lost.

    python -m spmd.launch.supervisor --scheduler slurm --run-dir RUN --nodes N \\
        --ranks-per-node R --launcher 'srun --nodes={nodes} --ntasks={ranks} ...' \\
        [--elastic requeue|shrink] [--max-restarts M] [--retry-errors] \\
        -- python -m spmd.cli train ...

A job script rendered with spares or a restart budget (`spmd jobscript --spare-nodes K`,
launch.spare_nodes / launch.max_restarts) runs this instead of the launcher line. Each try
runs the launcher (its stderr passed through, and read for the ranks it reports killed) and
listens for the ranks' liveness beats (spmd.launch.liveness: a host that stops beating is a
lost node, and the try is ended at once); when it ends with a failure the supervisor
gathers the evidence (the ranks' records of the try in run.dir/events.jsonl, which name the
failed rank and host, the hosts that stopped beating, and the scheduler's node states),
lets `spmd.launch.recovery.decide` choose, writes the decision to run.dir/recovery.jsonl
(`spmd report` shows each one) and relaunches without the failed hosts, or exits: 0, the
ranks' status, or 76 for the job script to requeue. The ranks restore from the last
checkpoint as any resumed run does (partner copies, else the persistent tier) and load
the compiled step they kept (run.dir/executables) or JAX's compilation cache.

Signals: USR1/USR2/TERM/INT are passed to the running launcher (srun forwards them to the
ranks), and no try starts after one. Knows nothing of models: a try is a command line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from spmd.launch import liveness, node_state
from spmd.launch.coordinator import own_address
from spmd.launch.env import job_identity
from spmd.launch.recovery import (
    RECORDS_NAME,
    Decision,
    Outcome,
    Plan,
    State,
    apply,
    choose_hosts,
    decide,
    ended_ranks,
    exited_from_launcher,
    failed_nodes_from_launcher,
    killed_from_launcher,
    of_try,
    only_silent_hosts_left,
    read_records,
)

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
LEASE_NAME = "lease.json"     # spmd.rundir.lease's file (this layer may not import it)
HUNG_NAME = "HUNG"            # spmd.comm.hang_watchdog's report of a hang
GRACE_S = 10.0   # a rank died by a signal: the others may end on their own this long
POLL_S = 5.0     # between two looks at the scheduler's node states during a try
READ_S = 1.0     # between two reads of the ranks' new records during a try
ENDING_S = 10.0  # a failure's ranks end within this (spmd.comm.job_failure's waits)
DOWN_WAIT_S = 5.0  # srun's abort of a try with a host down: the live ranks end within this
SILENT_S = ENDING_S   # every rank off some hosts ended and none of theirs said a word in
                      # the time a failure's ranks take to end: their hosts are lost


class _Follow:
    """The records of one try (`of_try`) appended to events.jsonl, read incrementally."""

    def __init__(self, path: Path, since: float, attempt: int):
        self.path, self.since, self.attempt, self.offset, self.rest = path, since, attempt, 0, b""

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        out = []
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if of_try(e, self.since, self.attempt):
                out.append(e)
        return out


def say(msg: str) -> None:
    job = job_identity(os.environ)[0] or ""
    print(f"spmd-recovery {job} [{time.strftime('%Y-%m-%d %H:%M:%S')}]: {msg}",
          file=sys.stderr, flush=True)


class Supervisor:
    """One job's tries; `run()` returns the status the job script goes on with."""

    def __init__(self, scheduler: str, run_dir: Path, launcher: str, command: list[str],
                 plan: Plan):
        self.scheduler, self.run_dir = scheduler, Path(run_dir)
        self.launcher, self.command, self.plan = launcher, command, plan
        self.proc: subprocess.Popen | None = None
        self.signalled: int | None = None
        self.grace_s, self.poll_s = GRACE_S, POLL_S
        self.ending_s, self.silent_s = ENDING_S, SILENT_S
        self.node_timeout_s = liveness.TIMEOUT_S   # 0: no beats asked for
        self.beats: liveness.Listener | None = None
        self.beat_host = ""                     # the address the ranks beat to
        self.ranks = plan.nodes * plan.ranks_per_node
        self.silent: dict[str, float] = {}     # hosts that stopped beating: seconds silent
        self.before_abort: str | None = None   # the launcher's report when we ended the try

    # ------------------------------------------------------------ signals

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = signum
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except OSError:
                pass

    def install(self) -> None:
        for s in FORWARDED:
            signal.signal(s, self._on_signal)

    # ------------------------------------------------------------ tries

    def _try(self, argv: list[str], attempt: int, started: float) -> tuple[int, str]:
        env = {**os.environ, liveness.ATTEMPT_VAR: str(attempt)}
        if self.beats is not None:
            self.beats.new_try(attempt)
            env[liveness.ADDR_VAR] = f"{self.beat_host}:{self.beats.port}"
        # the launcher's lines about tasks and nodes (one per node and status on srun: a
        # large job's are kept whole), for the evidence
        tail: deque[str] = deque(maxlen=100_000)
        self.proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True,
                                     errors="replace", start_new_session=True)

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                sys.stderr.write(line)
                if "task" in line or "Node failure" in line:
                    tail.append(line)
            sys.stderr.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        status = self._watch(self.proc, tail, started, attempt)
        reader.join(5.0)
        return (128 - status if status < 0 else status), "".join(tail)

    def _watch(self, proc: subprocess.Popen, tail: deque[str], started: float,
               attempt: int) -> int:
        """Wait for the try; end it when it is broken but its ranks have not noticed: a rank
        the launcher reports dead by a signal while the others still run `grace_s` later (a
        peer on another host may wait for the heartbeat timeout), or a host the try's ranks
        run on (their `started` records) that the scheduler reports down (checked every
        `poll_s`), or a host none of whose ranks still due has beaten for `node_timeout_s`
        while another host's did (a lost node, seen in seconds: spmd.launch.liveness), or a
        launcher that waits only for hosts none of whose ranks said a word while every other
        rank has ended (`silent_s` later: a lost node where the ranks do not beat)."""
        broken_at: float | None = None
        silent_since: float | None = None
        next_poll = time.monotonic() + self.poll_s
        aborted = False
        announced_at: float | None = None
        events = _Follow(self.run_dir / "events.jsonl", started, attempt)
        records: list[dict] = []   # the try's records so far
        next_read = time.monotonic() + READ_S
        while True:
            try:
                return proc.wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
            if aborted or self.signalled is not None:
                continue
            now = time.monotonic()
            text = "".join(tail)   # what the launcher said of tasks and nodes so far
            exited, killed = exited_from_launcher(text), killed_from_launcher(text)
            if self.beats is not None and self.node_timeout_s:
                self.beats.drain(now)
                ended = ended_ranks(records) | exited | set(killed)
                timeout = liveness.timeout_for(self.node_timeout_s, self.ranks)
                # a host that fell silent while others beat; or, once the launcher saw every
                # rank elsewhere end, the hosts it still waits for that stopped beating
                silent = (self.beats.silent_hosts(timeout, ended, now)
                          or self.beats.silent_hosts(
                              timeout, ended, now,
                              left=only_silent_hosts_left(records, exited, killed)))
                if silent:
                    self.silent = silent
                    ranks = self.beats.ranks_on(silent)
                    say(f"{', '.join(sorted(silent))} stopped beating: no word from its "
                        f"rank(s) {', '.join(map(str, ranks))} in "
                        f"{max(silent.values()):.1f} s (a lost node): ending the try")
                    aborted = self._abort(proc, tail, wait_s=1.0)
                    continue
            if broken_at is None and (killed or failed_nodes_from_launcher(text)):
                broken_at = now
            poll_due, read_due = bool(self.poll_s) and now >= next_poll, now >= next_read
            if poll_due or read_due:   # the try's records so far, read once for both
                new = events.new()
                records += new
                if any(e.get("event") in ("failed", "hung") for e in new):
                    announced_at = announced_at or now
            if poll_due:
                next_poll = now + self.poll_s
                hosts = sorted({str(e["host"]) for e in records
                                if e.get("event") == "started" and "host" in e})
                down = node_state.down_hosts(self.scheduler, hosts) if hosts else []
                if down:
                    say(f"{', '.join(down)} of this try is down for the scheduler: ending the "
                        "try")
                    # the launcher waits in vain for that host's tasks: a short wait
                    aborted = self._abort(proc, tail, wait_s=DOWN_WAIT_S)
                    continue
            if read_due:
                next_read = now + READ_S
                silent = only_silent_hosts_left(records, exited, killed)
                silent_since = (silent_since or now) if silent else None
                if silent and now - silent_since >= self.silent_s:
                    say(f"every rank but those on {', '.join(silent)} ended, and none of "
                        f"theirs said a word in {now - silent_since:.0f} s (a lost node?): "
                        "ending the try")
                    aborted = self._abort(proc, tail, wait_s=1.0)
                    continue
            if announced_at is not None and now - announced_at >= self.grace_s + self.ending_s:
                say(f"the ranks reported a failure {now - announced_at:.0f} s ago and the "
                    "launcher still runs (ranks on a lost node?): ending the try")
                aborted = self._abort(proc, tail)
                continue
            if broken_at is not None and now - broken_at >= self.grace_s:
                say(f"a rank or node died and the others still run {self.grace_s:g} s later: "
                    "ending the try")
                aborted = self._abort(proc, tail)

    def _abort(self, proc: subprocess.Popen, tail: deque[str], wait_s: float = 10.0) -> bool:
        """End a broken try: srun aborts its step on two SIGINTs within a second (SIGKILL to
        every task); other launchers, and an srun still there `wait_s` later (it waits for
        the tasks of a node that is down until slurmctld gives up on it), get SIGKILL with
        their process group. What the launcher reported until now is kept: the deaths that
        follow are ours."""
        self.before_abort = "".join(tail)
        if self.scheduler == "slurm":
            for _ in range(2):
                try:
                    proc.send_signal(signal.SIGINT)
                except OSError:
                    return True
                time.sleep(0.2)
            try:
                proc.wait(timeout=wait_s)
                return True
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        return True

    def _record(self, record: dict) -> None:
        path = self.run_dir / RECORDS_NAME
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as e:
            say(f"could not write {path}: {e}")

    def _clear_for_relaunch(self) -> None:
        """Every rank of the try has ended: the lease rank 0 held for this job is free (it
        would otherwise keep the next try waiting for run.lease_stale_s when rank 0's host
        died), and the hang report belongs to the try that hung."""
        job_id, restarts = job_identity(os.environ)
        lease = self.run_dir / LEASE_NAME
        try:
            holder = json.loads(lease.read_text())
        except (OSError, ValueError):
            holder = None
        if (isinstance(holder, dict) and job_id and holder.get("job_id") == job_id
                and int(holder.get("restart_count", 0)) == restarts):
            lease.unlink(missing_ok=True)
            say(f"released the lease {lease} left by the ended try (pid {holder.get('pid')} "
                f"on {holder.get('host')})")
        (self.run_dir / HUNG_NAME).unlink(missing_ok=True)

    def run(self) -> int:
        plan = self.plan
        state = State(nodes=plan.nodes)
        attempt = 0
        if self.node_timeout_s and self.beats is None:
            try:
                self.beats = liveness.Listener()
                self.beat_host = own_address(socket.gethostname())
            except OSError as e:
                say(f"no listener for the ranks' liveness beats ({e}): a lost node is seen "
                    "from srun and the scheduler only")
                self.beats = None
        while True:
            hosts = choose_hosts(plan, state) if plan.hosts else []
            argv = node_state.launch_argv(
                self.scheduler, self.launcher, nodes=state.nodes,
                ranks_per_node=plan.ranks_per_node, hosts=hosts,
                exclude=state.excluded, relaunch=attempt > 0) + self.command
            started = time.time()
            self._record({"event": "launch", "time": started, "attempt": attempt,
                          "nodes": state.nodes, "ranks": state.nodes * plan.ranks_per_node,
                          "hosts": hosts, "exclude": state.excluded,
                          "job_id": job_identity(os.environ)[0]})
            say(f"try {attempt}: {state.nodes} node(s) x {plan.ranks_per_node} rank(s)"
                + (f", leaving out {', '.join(state.excluded)}" if state.excluded else ""))
            self.before_abort, self.silent = None, {}
            status, stderr = self._try(argv, attempt, started)
            before = stderr if self.before_abort is None else self.before_abort
            ended = time.time()
            if status == 0 and self.signalled is None:
                return 0
            down = (node_state.down_hosts(self.scheduler, plan.hosts)
                    if plan.hosts and self.signalled is None else [])
            outcome = Outcome(status=status,
                              records=read_records(self.run_dir, started, attempt),
                              killed_ranks=killed_from_launcher(before),
                              reported_ranks=set(killed_from_launcher(stderr)),
                              exited_ranks=exited_from_launcher(stderr),
                              failed_nodes=failed_nodes_from_launcher(stderr), down_hosts=down,
                              silent_hosts=sorted(self.silent),
                              signalled=self.signalled is not None, started_at=started,
                              ended_at=ended)
            d = decide(outcome, plan, state)
            if d.kind in ("done", "preempted"):
                return d.status
            self._record({"event": "recovery", "time": time.time(), "attempt": attempt,
                          "ended_at": ended, "status": status, "nodes_before": state.nodes,
                          "down_hosts": down, "silent_hosts": sorted(self.silent),
                          "job_id": job_identity(os.environ)[0],
                          **d.as_record()})
            say(_describe(d, attempt))
            if d.action not in ("relaunch", "shrink"):
                return d.status
            if self.signalled is not None:   # a stop came while deciding
                return 75
            self._clear_for_relaunch()
            state = apply(state, d)
            attempt += 1


def _describe(d: Decision, attempt: int) -> str:
    head = f"try {attempt} ended ({d.kind}): {d.cause}"
    if d.action == "relaunch":
        return head + f"; starting again on {d.nodes} node(s)" + (
            f" without {', '.join(d.exclude)}" if d.exclude else "")
    if d.action == "shrink":
        return head + f"; starting again on {d.nodes} node(s) (the ranks log the new mesh)"
    if d.action == "requeue":
        return head + f"; exiting {d.status} for the job script to requeue"
    return head + f"; ending the job with status {d.status}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spmd.launch.supervisor",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--scheduler", required=True, choices=node_state.SCHEDULERS)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--nodes", required=True, type=int, help="nodes to train on")
    p.add_argument("--ranks-per-node", required=True, type=int)
    p.add_argument("--launcher", required=True,
                   help="the launch line, with {nodes} and {ranks} left open")
    p.add_argument("--elastic", choices=("requeue", "shrink"), default="requeue")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--retry-errors", action="store_true")
    p.add_argument("--grace", type=float, default=GRACE_S, metavar="S",
                   help="end a try whose other ranks still run S seconds after the launcher "
                        "reported one dead by a signal")
    p.add_argument("--poll", type=float, default=POLL_S, metavar="S",
                   help="seconds between looks at the scheduler's node states during a try "
                        "(0: only after it)")
    p.add_argument("--ending", type=float, default=ENDING_S, metavar="S",
                   help="a failure's ranks end within S seconds of its announcement: past "
                        "grace + S the try is ended")
    p.add_argument("--silent", type=float, default=SILENT_S, metavar="S",
                   help="end a try S seconds after every rank but those of some hosts ended "
                        "and none of theirs said a word")
    p.add_argument("--node-timeout", type=float, default=liveness.TIMEOUT_S, metavar="S",
                   help="a host none of whose ranks has sent its liveness beat for S seconds "
                        "while the others beat is lost (0: no beats; launch.node_timeout_s)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- each rank's command")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("give each rank's command after --")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    hosts = node_state.allocation_hosts(args.scheduler)
    plan = Plan(nodes=args.nodes, ranks_per_node=args.ranks_per_node, hosts=tuple(hosts),
                elastic=args.elastic, max_restarts=args.max_restarts,
                retry_errors=args.retry_errors,
                can_exclude=node_state.can_exclude(args.scheduler))
    if hosts and len(hosts) < args.nodes:
        say(f"the allocation has {len(hosts)} host(s) ({', '.join(hosts)}), fewer than the "
            f"{args.nodes} to train on")
    sup = Supervisor(args.scheduler, args.run_dir, args.launcher, args.command, plan)
    sup.grace_s, sup.poll_s = args.grace, args.poll
    sup.ending_s, sup.silent_s = args.ending, args.silent
    sup.node_timeout_s = args.node_timeout
    sup.install()
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
