"""Recovery inside the allocation (spmd.launch.recovery, node_state, supervisor): the decision
table, the schedulers' node states and launch lines, and the supervisor run for real against
stand-in launchers and node-state commands (srun/sinfo, flux, mpiexec/pbsnodes, jsrun/bhosts)
that act out a scripted failure per try and log how they were called.

The same protocol under a real Slurm: tests/slurm/test_slurm_recovery.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd.errors import ExitCode
from spmd.launch import node_state
from spmd.launch.launch_config import LaunchConfig
from spmd.launch.recovery import (
    REQUEUE_STATUS,
    Outcome,
    Plan,
    State,
    apply,
    decide,
    exited_from_launcher,
    expand_hostlist,
    failed_nodes_from_launcher,
    killed_from_launcher,
    only_silent_hosts_left,
)
from tests.helpers.env import REPO

HOSTS = ("n1", "n2", "n3", "n4", "n5")


def started(*hosts: str, t: float = 100.0) -> list[dict]:
    return [{"event": "started", "rank": r, "host": h, "time": t} for r, h in enumerate(hosts)]


def failed(rank: int, host: str, error: str, code: int, t: float = 105.0) -> dict:
    return {"event": "failed", "rank": rank, "host": host, "error": error, "exit_code": code,
            "first": True, "time": t}


# ---------------------------------------------------------------- host lists, launcher output


def test_hostlists_expand_as_slurm_and_flux_write_them():
    assert expand_hostlist("n[01-03,7],login1") == ["n01", "n02", "n03", "n7", "login1"]
    assert expand_hostlist("nid[001-002]-ib") == ["nid001-ib", "nid002-ib"]
    assert expand_hostlist("a,b") == ["a", "b"] and expand_hostlist("") == []


def test_srun_s_report_of_killed_tasks_names_the_ranks():
    text = ("srun: error: n2: task 1: Killed\nsrun: error: n1: task 0: Exited with exit code 69\n"
            "srun: error: n3: tasks 4-5: Segmentation fault\n")
    assert killed_from_launcher(text) == {1: "Killed", 4: "Segmentation fault",
                                          5: "Segmentation fault"}
    assert killed_from_launcher("srun: error: n3: task 4-5: Aborted") == {4: "Aborted",
                                                                           5: "Aborted"}


def test_srun_s_report_of_exits_and_node_failures():
    text = ("srun: error: n1: tasks 0-1: Exited with exit code 1\n"
            "srun: error: Node failure on n3\nsrun: error: n2: task 2: Killed\n")
    assert exited_from_launcher(text) == {0, 1}
    assert failed_nodes_from_launcher(text) == ["n3"]


def test_max_restarts_defaults_from_the_spares():
    assert LaunchConfig().restarts() == 0
    assert LaunchConfig(spare_nodes=2).restarts() == 3
    assert LaunchConfig(elastic="shrink").restarts() == 1
    assert LaunchConfig(spare_nodes=2, max_restarts=0).restarts() == 0


# ---------------------------------------------------------------- the decision table


def plan(**kw) -> Plan:
    base = {"nodes": 4, "ranks_per_node": 2, "hosts": HOSTS, "max_restarts": 3}
    return Plan(**{**base, **kw})


def four_nodes_ranks() -> list[dict]:
    return started("n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4")


def test_a_node_down_for_the_scheduler_is_left_out_and_a_spare_taken():
    out = Outcome(status=69, records=four_nodes_ranks(), down_hosts=["n3"])
    d = decide(out, plan(), State(nodes=4))
    assert (d.action, d.kind, d.nodes, d.exclude) == ("relaunch", "node_lost", 4, ("n3",))
    assert d.failed_rank == 4 and d.failed_hosts == ("n3",) and "n3" in d.cause
    state = apply(State(nodes=4), d)
    assert state.restarts == 1 and state.excluded == ["n3"]


def test_no_spare_left_requeues_or_shrinks():
    out = Outcome(status=69, records=four_nodes_ranks(), down_hosts=["n3"])
    state = State(nodes=4, excluded=["n5"], restarts=1)   # the spare is gone already
    d = decide(out, plan(), state)
    assert (d.action, d.status) == ("requeue", REQUEUE_STATUS) and "no spare" in d.cause
    d = decide(out, plan(elastic="shrink"), state)
    assert (d.action, d.nodes, d.exclude) == ("shrink", 3, ("n5", "n3"))
    assert apply(state, d).shrunk


def test_a_killed_rank_on_a_healthy_node_is_relaunched_in_place():
    out = Outcome(status=137, records=four_nodes_ranks(), killed_ranks={5: "Killed"})
    d = decide(out, plan(), State(nodes=4))
    assert (d.action, d.kind, d.exclude, d.failed_rank) == ("relaunch", "process_lost", (), 5)
    assert "rank 5 on n3 died (Killed)" in d.cause


def test_a_host_where_every_rank_died_is_left_out_while_a_spare_is_there():
    # both ranks on n3 killed (the node's processes went with it), the others exited 1
    out = Outcome(status=137, records=four_nodes_ranks(), killed_ranks={4: "Killed",
                                                                        5: "Killed"},
                  exited_ranks={0, 1, 2, 3, 6, 7})
    d = decide(out, plan(), State(nodes=4))
    assert (d.kind, d.action, d.exclude) == ("process_lost", "relaunch", ("n3",))
    assert "where every rank died" in d.cause
    # no spare left: in place (a suspect is no proof)
    d = decide(out, plan(), State(nodes=4, excluded=["n5"]))
    assert d.exclude == ("n5",)
    # one of two ranks of a host killed: the host answered for the other one
    out = Outcome(status=137, records=four_nodes_ranks(), killed_ranks={5: "Killed"},
                  exited_ranks={0, 1, 2, 3, 4, 6, 7})
    assert decide(out, plan(), State(nodes=4)).exclude == ()


def test_ranks_that_ended_without_a_word_are_named():
    records = started("n1", "n1") + [{"event": "saved", "rank": 0, "time": 101.0}]
    d = decide(Outcome(status=69, records=records), plan(nodes=1, hosts=("n1",)),
               State(nodes=1))
    assert d.kind == "process_lost" and "ranks 0, 1 ended without a word" in d.cause
    assert d.failed_at == 101.0


def test_an_error_in_the_code_is_not_retried_as_a_lost_node():
    records = four_nodes_ranks() + [failed(2, "n2", "ValueError: bad input", 1)]
    d = decide(Outcome(status=1, records=records), plan(), State(nodes=4))
    assert (d.action, d.kind, d.status) == ("stop", "error", 1)
    assert "rank 2 on n2 failed: ValueError: bad input" in d.cause and "retry_errors" in d.cause


def test_retry_errors_retries_once_but_never_the_same_error_twice():
    records = four_nodes_ranks() + [failed(2, "n2", "OSError: stale file handle", 1)]
    p = plan(retry_errors=True)
    d = decide(Outcome(status=1, records=records), p, State(nodes=4))
    assert d.action == "relaunch" and d.exclude == ()
    state = apply(State(nodes=4), d)
    again = four_nodes_ranks() + [failed(6, "n4", "OSError: stale file handle", 1)]
    d2 = decide(Outcome(status=1, records=again), p, state)
    assert (d2.action, d2.status) == ("stop", 1) and "same error" in d2.cause


def test_a_survivor_s_network_error_is_a_lost_peer_not_an_error_in_the_code():
    gloo = ("JaxRuntimeError: INTERNAL: Gloo all-reduce failed: [../third_party/gloo/"
            "transport/tcp/pair.cc:534] Connection reset by peer")
    records = four_nodes_ranks() + [failed(0, "n1", gloo, 1)]
    d = decide(Outcome(status=1, records=records), plan(), State(nodes=4))
    assert (d.action, d.kind) == ("relaunch", "process_lost") and "lost peer" in d.cause
    # a rank the launcher saw die by a signal: the others' errors follow from it
    records = four_nodes_ranks() + [failed(0, "n1", "ValueError: x", 1)]
    d = decide(Outcome(status=1, records=records, killed_ranks={3: "Killed"}), plan(),
               State(nodes=4))
    assert (d.action, d.kind, d.failed_rank) == ("relaunch", "process_lost", 3)


def test_a_host_whose_ranks_all_vanished_is_left_out():
    out = Outcome(status=1, records=four_nodes_ranks(), exited_ranks={0, 1, 2, 3, 6, 7})
    d = decide(out, plan(), State(nodes=4))
    assert (d.action, d.kind, d.exclude) == ("relaunch", "node_lost", ("n3",))
    assert "vanished with every rank on it" in d.cause and d.failed_rank == 4
    out = Outcome(status=1, records=four_nodes_ranks(), failed_nodes=["n2"])
    assert decide(out, plan(), State(nodes=4)).exclude == ("n2",)
    # a launcher that reports no exits (mpiexec, flux run): nothing is guessed
    d = decide(Outcome(status=1, records=four_nodes_ranks()), plan(), State(nodes=4))
    assert d.kind == "process_lost" and d.exclude == ()


def test_a_host_that_stopped_beating_is_left_out_even_when_srun_says_nothing():
    out = Outcome(status=137, records=four_nodes_ranks(), silent_hosts=["n3"])
    d = decide(out, plan(), State(nodes=4))
    assert (d.action, d.kind, d.exclude, d.failed_hosts) == ("relaunch", "node_lost", ("n3",),
                                                            ("n3",))
    assert "stopped beating" in d.cause and d.failed_rank == 4
    # the scheduler's word comes first when it has one
    out = Outcome(status=137, records=four_nodes_ranks(), silent_hosts=["n3"],
                  down_hosts=["n2"])
    assert decide(out, plan(), State(nodes=4)).exclude == ("n2",)


def test_config_and_data_errors_are_never_retried():
    for code in (ExitCode.USER_ERROR, ExitCode.NONFINITE, ExitCode.LEASE_LOST):
        records = four_nodes_ranks() + [failed(0, "n1", "train.batch_size ...", int(code))]
        d = decide(Outcome(status=int(code), records=records), plan(retry_errors=True),
                   State(nodes=4))
        assert (d.action, d.kind, d.status) == ("stop", "user_error", int(code))


def test_a_config_that_does_not_fit_the_shrunk_world_requeues_at_full_size():
    records = started("n1", "n1") + [failed(0, "n1", "train.batch_size=16 does not divide", 2)]
    d = decide(Outcome(status=2, records=records), plan(),
               State(nodes=3, shrunk=True, restarts=1))
    assert (d.action, d.status) == ("requeue", REQUEUE_STATUS) and "at 4 nodes" in d.cause


def test_max_restarts_bounds_the_tries():
    out = Outcome(status=137, records=four_nodes_ranks(), killed_ranks={1: "Killed"})
    d = decide(out, plan(max_restarts=2), State(nodes=4, restarts=2))
    assert (d.action, d.status) == ("stop", 137) and "launch.max_restarts=2" in d.cause
    lost = Outcome(status=69, records=four_nodes_ranks(), down_hosts=["n1"])
    d = decide(lost, plan(max_restarts=0), State(nodes=4))
    assert d.action == "requeue"   # a lost node past the bound: requeued, as without recovery


def test_finished_preempted_and_hung():
    assert decide(Outcome(status=0), plan(), State(nodes=4)).action == "exit"
    d = decide(Outcome(status=75), plan(), State(nodes=4))
    assert (d.action, d.kind, d.status) == ("exit", "preempted", 75)
    d = decide(Outcome(status=9, signalled=True), plan(), State(nodes=4))
    assert d.kind == "preempted"
    hung = [{"event": "hung", "rank": 0, "time": 103.0, "line": "rank 3 did not reach step 7"}]
    d = decide(Outcome(status=76, records=four_nodes_ranks() + hung), plan(), State(nodes=4))
    assert (d.action, d.kind, d.failed_at) == ("relaunch", "hung", 103.0)


def test_lsf_cannot_leave_a_node_out_and_requeues():
    out = Outcome(status=69, records=four_nodes_ranks(), down_hosts=["n2"])
    d = decide(out, plan(can_exclude=False), State(nodes=4))
    assert d.action == "requeue" and "cannot leave a node out" in d.cause


# ---------------------------------------------------------------- schedulers, with stand-ins


def stub(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)


QUERY_STUB = """import os, sys
name = os.path.basename(sys.argv[0])
open(os.environ["STUB_LOG"], "a").write(" ".join([name] + sys.argv[1:]) + "\\n")
sys.stdout.write(os.environ.get("STUB_OUT_" + os.path.basename(sys.argv[0]), ""))
"""


@pytest.fixture
def bindir(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    for name in ("sinfo", "flux", "pbsnodes", "bhosts"):
        stub(d, name, QUERY_STUB)
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "calls.log"))
    return d


def test_down_hosts_per_scheduler(bindir, monkeypatch, tmp_path):
    monkeypatch.setenv("STUB_OUT_sinfo", "n1 alloc\nn2 down*\nn3 mix\nn4 drain\nn5 idle*\n")
    assert node_state.down_hosts("slurm", HOSTS) == ["n2", "n4", "n5"]
    monkeypatch.setenv("STUB_OUT_flux", "n[3-4]\n")
    assert node_state.down_hosts("flux", HOSTS) == ["n3", "n4"]
    monkeypatch.setenv("STUB_OUT_pbsnodes", "n2   down   node down: communication closed\n")
    assert node_state.down_hosts("pbs", HOSTS) == ["n2"]
    monkeypatch.setenv("STUB_OUT_bhosts", "HOST_NAME STATUS JL/U MAX\nn1 ok - 42\n"
                                          "n5 unavail - 42\n")
    assert node_state.down_hosts("lsf", HOSTS) == ["n5"]
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0] == "sinfo -h -N -n n1,n2,n3,n4,n5 -o %N %t"
    assert calls[1] == "flux resource list -s down -no {nodelist}"
    monkeypatch.setenv("PATH", "/nonexistent")   # a missing tool: nothing known, no error
    assert node_state.down_hosts("slurm", HOSTS) == []


def test_allocation_hosts_per_scheduler(bindir, monkeypatch, tmp_path):
    assert node_state.allocation_hosts("slurm", {"SLURM_JOB_NODELIST": "n[1-3]"}) == [
        "n1", "n2", "n3"]
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\nx1\nx2\nx3\n")
    assert node_state.allocation_hosts("pbs", {"PBS_NODEFILE": str(nodefile)}) == [
        "x1", "x2", "x3"]
    assert node_state.allocation_hosts("lsf", {"LSB_MCPU_HOSTS": "batch1 1 h1 42 h2 42"}) == [
        "h1", "h2"]
    monkeypatch.setenv("STUB_OUT_flux", "f[0-2]\n")
    assert node_state.allocation_hosts("flux") == ["f0", "f1", "f2"]


def test_launch_lines_leave_the_failed_hosts_out():
    kw = {"nodes": 3, "ranks_per_node": 2, "exclude": ["n2"], "hosts": ["n1", "n3", "n4"]}
    assert node_state.launch_argv("slurm", "srun --nodes={nodes} --ntasks={ranks}", **kw) == [
        "srun", "--exclude=n2", "--nodes=3", "--ntasks=6"]
    assert node_state.launch_argv("flux", "flux run -N{nodes} -n{ranks} -g1", **kw) == [
        "flux", "run", "--requires=-host:n2", "-N3", "-n6", "-g1"]
    assert node_state.launch_argv("pbs", "mpiexec -n {ranks} -ppn 2 $SPMD_BIND", **kw,
                                  environ={"SPMD_BIND": "/r/bind.sh"}) == [
        "mpiexec", "--hosts", "n1,n3,n4", "-n", "6", "-ppn", "2", "/r/bind.sh"]
    assert node_state.launch_argv("lsf", "jsrun -n{ranks} -r2", **kw) == ["jsrun", "-n6", "-r2"]
    assert node_state.launch_argv("slurm", "srun -N{nodes}", nodes=4, ranks_per_node=1) == [
        "srun", "-N4"]


# ---------------------------------------------------------------- the supervisor, for real

# A stand-in launcher: the Nth call acts out try N of FAKE_TRIES (a JSON list): it writes the
# try's records to run.dir/events.jsonl as the ranks would, prints its stderr lines and exits
# with its status. A try may also ask to be signalled ("wait": seconds) and then exit 75, and
# may start real liveness beacons ("beats": rank, host and, for a node that dies, how long it
# beats), as the ranks of those hosts would.
LAUNCHER = r"""import json, os, signal, sys, time
log = os.environ["STUB_LOG"]
open(log, "a").write(" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\n")
n = sum(1 for line in open(log) if line.split()[0] == os.path.basename(sys.argv[0])) - 1
tries = json.loads(os.environ["FAKE_TRIES"])
t = tries[min(n, len(tries) - 1)]
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
if "on_abort" in t:   # srun's report of the tasks its abort killed
    signal.signal(signal.SIGINT, lambda s, f: (sys.stderr.write(t["on_abort"]),
                                               sys.stderr.flush(), os._exit(137)))
with open(os.path.join(os.environ["FAKE_RUN_DIR"], "events.jsonl"), "a") as fh:
    for e in t.get("events", []):
        fh.write(json.dumps({"time": time.time(), **e}) + "\n")
sys.stderr.write(t.get("stderr", ""))
sys.stderr.flush()
beacons, began = [], time.time()
if t.get("beats"):
    from spmd.launch import liveness
    host, port = os.environ["SPMD_BEAT_ADDR"].rsplit(":", 1)
    for b in t["beats"]:
        beacon = liveness.Beacon((host, int(port)), b["rank"],
                                 int(os.environ["SPMD_RECOVERY_ATTEMPT"]))
        beacon.message["host"] = b["host"]
        beacons.append((beacon.start(), b.get("for")))
time.sleep(t.get("hang", 0))   # survivors that do not notice the dead rank
deadline = time.time() + t.get("wait", 0)
while time.time() < deadline and not got:
    for beacon, beats_for in beacons:   # a node that dies: its beats stop, with no bye
        if beats_for is not None and time.time() - began > beats_for:
            beacon.child.kill()
    time.sleep(0.02)
sys.exit(75 if got else t["status"])
"""


def supervise(tmp_path: Path, bindir: Path, scheduler: str, launcher: str, tries: list[dict],
              *args: str, env: dict | None = None, nodes: int = 2) -> tuple[int, str, Path]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    for name in ("srun", "mpiexec", "jsrun"):
        stub(bindir, name, LAUNCHER)
    if scheduler == "flux":   # `flux run` acts the tries, `flux hostlist`/`resource` answer
        stub(bindir, "flux", "import os, sys\nif sys.argv[1] == 'run':\n    exec(open("
             f"{str(bindir / 'srun')!r}).read().split(chr(10), 1)[1])\n"
             + QUERY_STUB.replace("os.path.basename(sys.argv[0])", "'flux_' + sys.argv[1]"))
    full_env = {**os.environ, "FAKE_TRIES": json.dumps(tries), "FAKE_RUN_DIR": str(run_dir),
                **(env or {})}
    r = subprocess.run([sys.executable, "-m", "spmd.launch.supervisor", "--scheduler",
                        scheduler, "--run-dir", str(run_dir), "--nodes", str(nodes),
                        "--ranks-per-node", "1", "--launcher", launcher, *args, "--",
                        "python", "-m", "spmd.cli", "train", "cfg.yaml"],
                       env=full_env, capture_output=True, text=True, timeout=60)
    return r.returncode, r.stderr, run_dir


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "recovery.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def calls(tmp_path: Path, word: str) -> list[str]:
    return [c for c in (tmp_path / "calls.log").read_text().splitlines() if c.startswith(word)]


NODE_DIES = {"events": [{"event": "started", "rank": 0, "host": "n1"},
                        {"event": "started", "rank": 1, "host": "n2"}],
             "stderr": "srun: error: n2: task 1: Killed\n", "status": 137}
FINISHES = {"events": [{"event": "started", "rank": 0, "host": "n1"},
                       {"event": "started", "rank": 1, "host": "n3"},
                       {"event": "finished", "rank": 0}], "status": 0}


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_slurm_node_loss_relaunches_on_a_spare_without_the_node(bindir, tmp_path):
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun --nodes={nodes} --ntasks={ranks} --mpi=pmi2",
        [NODE_DIES, FINISHES], "--max-restarts", "2",
        env={"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "77",
             "STUB_OUT_sinfo": "n1 alloc\nn2 down*\nn3 idle\n"})
    assert code == 0, err
    first, second = calls(tmp_path, "srun")
    assert first.startswith("srun --nodes=2 --ntasks=2 --mpi=pmi2 python -m spmd.cli train")
    assert second.startswith("srun --exclude=n2 --nodes=2 --ntasks=2"), second
    launch0, recovery, launch1 = records(run_dir)
    assert (launch0["event"], launch1["event"], launch1["exclude"]) == ("launch", "launch",
                                                                      ["n2"])
    assert recovery["kind"] == "node_lost" and recovery["failed_hosts"] == ["n2"]
    assert recovery["failed_rank"] == 1 and recovery["action"] == "relaunch"
    assert recovery["job_id"] == "77" and recovery["ended_at"] <= recovery["time"]
    assert "try 0 ended (node_lost): node n2 is down" in err and "without n2" in err


@pytest.mark.slow   # runs the supervisor, its stand-in launchers and real beacons
def test_a_host_that_stops_beating_ends_the_try_in_seconds_and_is_left_out(bindir, tmp_path):
    """n2's ranks stop beating after 1 s (no bye: the node died) while n1's beat on, and
    neither srun nor the scheduler says a word: the supervisor ends the try about
    launch.node_timeout_s later, not after the 60 s the try would still wait."""
    silent_n2 = {"events": [{"event": "started", "rank": 0, "host": "n1"},
                            {"event": "started", "rank": 1, "host": "n2"}],
                 "beats": [{"rank": 0, "host": "n1"}, {"rank": 1, "host": "n2", "for": 1.0}],
                 "wait": 60, "status": 137}
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun --nodes={nodes} --ntasks={ranks}",
        [silent_n2, FINISHES], "--max-restarts", "2", "--node-timeout", "2",
        env={"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "78",
             "STUB_OUT_sinfo": "n1 alloc\nn2 alloc\nn3 idle\n"})
    assert code == 0, err
    launch0, recovery, launch1 = records(run_dir)
    assert recovery["kind"] == "node_lost" and recovery["action"] == "relaunch", recovery
    assert recovery["silent_hosts"] == ["n2"] and recovery["failed_hosts"] == ["n2"]
    assert recovery["down_hosts"] == [] and "stopped beating" in recovery["cause"]
    assert launch1["exclude"] == ["n2"]
    # 1 s of beats, the 2 s timeout, the abort: far below the try's 60 s (CI may be loaded)
    assert 3.0 <= recovery["ended_at"] - launch0["time"] < 20.0, (launch0, recovery)
    assert "n2 stopped beating: no word from its rank(s) 1 in" in err, err


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_flux_and_pbs_leave_the_failed_host_out(bindir, tmp_path):
    code, err, _ = supervise(
        tmp_path, bindir, "flux", "flux run -N{nodes} -n{ranks} -g1", [NODE_DIES, FINISHES],
        "--max-restarts", "1", env={"STUB_OUT_flux_hostlist": "n[1-3]\n",
                                    "STUB_OUT_flux_resource": "n2\n"})
    assert code == 0, err
    runs = calls(tmp_path, "flux run")
    assert len(runs) == 2 and runs[1].startswith("flux run --requires=-host:n2 -N2 -n2"), runs

    (tmp_path / "calls.log").unlink()
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("n1\nn2\nn3\n")
    code, err, _ = supervise(
        tmp_path, bindir, "pbs", "mpiexec -n {ranks} -ppn 1 $SPMD_BIND", [NODE_DIES, FINISHES],
        "--max-restarts", "1", env={"PBS_NODEFILE": str(nodefile), "SPMD_BIND": "/x/bind.sh",
                                    "STUB_OUT_pbsnodes": "n2 down\n"})
    assert code == 0, err
    first, second = calls(tmp_path, "mpiexec")
    assert first.startswith("mpiexec -n 2 -ppn 1 /x/bind.sh python")
    assert second.startswith("mpiexec --hosts n1,n3 -n 2 -ppn 1 /x/bind.sh"), second


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_lsf_requeues_after_a_lost_node(bindir, tmp_path):
    code, err, run_dir = supervise(
        tmp_path, bindir, "lsf", "jsrun -n{ranks} -r1", [NODE_DIES, FINISHES],
        "--max-restarts", "2", env={"LSB_MCPU_HOSTS": "b 1 n1 4 n2 4 n3 4",
                                    "STUB_OUT_bhosts": "HOST STATUS\nn2 unavail\n"})
    assert code == REQUEUE_STATUS, err
    assert len(calls(tmp_path, "jsrun")) == 1
    assert records(run_dir)[-1]["action"] == "requeue"


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_shrink_goes_on_with_the_nodes_left(bindir, tmp_path):
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun --nodes={nodes} --ntasks={ranks}",
        [NODE_DIES, FINISHES], "--max-restarts", "1", "--elastic", "shrink",
        env={"SLURM_JOB_NODELIST": "n[1-2]", "STUB_OUT_sinfo": "n2 down*\n"})
    assert code == 0, err
    assert calls(tmp_path, "srun")[1].startswith("srun --exclude=n2 --nodes=1 --ntasks=1")
    assert records(run_dir)[1]["action"] == "shrink" and "new mesh" in err


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_an_exception_ends_the_job_with_its_error_after_one_try(bindir, tmp_path):
    error = {"events": [{"event": "started", "rank": 0, "host": "n1"},
                        {"event": "started", "rank": 1, "host": "n2"},
                        {"event": "failed", "rank": 1, "host": "n2", "first": True,
                         "exit_code": 1, "error": "KeyError: 'x'"}], "status": 1}
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun -N{nodes}", [error], "--max-restarts", "3",
        env={"SLURM_JOB_NODELIST": "n[1-3]", "STUB_OUT_sinfo": "n1 alloc\nn2 alloc\n"})
    assert code == 1 and len(calls(tmp_path, "srun")) == 1, err
    assert "rank 1 on n2 failed: KeyError: 'x'" in err and "ending the job with status 1" in err
    (tmp_path / "calls.log").unlink()
    code, err, _ = supervise(
        tmp_path, bindir, "slurm", "srun -N{nodes}", [error], "--max-restarts", "3",
        "--retry-errors", env={"SLURM_JOB_NODELIST": "n[1-3]"})
    assert code == 1 and len(calls(tmp_path, "srun")) == 2, err   # once more, not 3 more
    assert "the same error as the try before" in err


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_a_signal_is_passed_on_and_nothing_restarts(bindir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stub(bindir, "srun", LAUNCHER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spmd.launch.supervisor", "--scheduler", "slurm", "--run-dir",
         str(run_dir), "--nodes", "1", "--ranks-per-node", "1", "--max-restarts", "3",
         "--launcher", "srun -N{nodes}", "--", "true"],
        env={**os.environ, "FAKE_TRIES": json.dumps([{"wait": 30, "status": 0}]),
             "FAKE_RUN_DIR": str(run_dir)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "calls.log").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR2)   # as the job script forwards a warning
    assert proc.wait(timeout=20) == int(ExitCode.PREEMPTED), proc.stderr.read()
    assert len(calls(tmp_path, "srun")) == 1


# ---------------------------------------------------------------- the rendered job scripts

CONFIG = REPO / "configs" / "mlp_tiny.yaml"


def render_with(system: str, *args: str, spare_nodes: int | None = 1) -> str:
    from spmd.hpc.batch_scripts import make_request, render

    req = make_request(CONFIG, system=system, nodes=4, time="1:00", account="a",
                       overrides=list(args), workdir=REPO, spare_nodes=spare_nodes)
    return render(req)


def test_spare_nodes_hold_more_nodes_and_run_the_supervisor():
    text = render_with("slurm")
    assert "#SBATCH --nodes=5\n" in text and "#SBATCH --no-kill\n" in text
    assert "python -m spmd.launch.supervisor --scheduler slurm" in text.replace(
        sys.executable, "python")
    assert "--nodes 4 --ranks-per-node 1 --elastic requeue --max-restarts 2" in text
    assert "--launcher 'srun --mpi=pmi2 --nodes={nodes} --ntasks={ranks}" in text
    assert "launch.spare_nodes=1" in text   # the ranks' config says so too
    assert 'JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$SPMD_RUN_DIR/xla_cache}"' \
        in text
    flux = render_with("flux", "launch.elastic=shrink", "launch.max_restarts=5")
    assert "#flux: -N 5\n" in flux and "--elastic shrink --max-restarts 5" in flux
    assert "--requires=-host" in flux and "go on with fewer nodes" in flux
    pbs = render_with("polaris")
    assert "#PBS -l select=5:system=polaris" in pbs and "tolerate_node_failures=all" in pbs
    assert "mpiexec -n {ranks} -ppn 4 --depth=8 --cpu-bind depth $SPMD_BIND" in pbs
    assert "export SPMD_BIND" in pbs
    lsf = render_with("summit")
    assert "#BSUB -nnodes 5" in lsf and "jsrun cannot leave a failed node" in lsf


def test_without_recovery_the_script_is_as_before():
    text = render_with("slurm", spare_nodes=None)
    assert "#SBATCH --nodes=4\n" in text and "--no-kill" not in text
    assert "spmd.launch.supervisor" not in text
    assert "\nsrun --mpi=pmi2 --nodes=4 --ntasks=4" in text
    assert "spmd.launch.supervisor" in render_with("slurm", "launch.max_restarts=1",
                                                   spare_nodes=None)


def test_jobscript_cli_takes_spare_nodes(capsys):
    from spmd.cli import main

    assert main(["jobscript", str(CONFIG), "--check", "none", "--system", "summit",
                 "--nodes", "2", "--time", "30", "-A", "a", "--spare-nodes", "1"]) == 0
    captured = capsys.readouterr()
    assert "#BSUB -nnodes 3" in captured.out
    assert "jsrun cannot leave a failed node out" in captured.err


@pytest.mark.slow   # the whole job script under bash, with stand-in srun, sinfo, scontrol
@pytest.mark.parametrize("spares,expect", [(1, "relaunch"), (0, "requeue")])
def test_the_slurm_script_relaunches_or_requeues(bindir, tmp_path, spares, expect):
    import dataclasses

    from spmd.hpc.batch_scripts import make_request, write_script

    run_dir = tmp_path / "run"
    stub(bindir, "srun", LAUNCHER)
    stub(bindir, "scontrol", QUERY_STUB)
    req = make_request(CONFIG, system="slurm", nodes=1, time="30", workdir=REPO,
                       overrides=[f"run.dir={run_dir}", "launch.max_restarts=1"],
                       spare_nodes=spares)
    script = write_script(dataclasses.replace(req, command=("true",)), tmp_path / "job.sh")
    env = {**os.environ, "SLURM_JOB_ID": "55",
           "SLURM_JOB_NODELIST": "n[1-2]" if spares else "n1",
           "STUB_OUT_sinfo": "n1 down*\nn2 idle\n",
           "FAKE_TRIES": json.dumps([{**NODE_DIES, "events": [
               {"event": "started", "rank": 0, "host": "n1"}]}, FINISHES]),
           "FAKE_RUN_DIR": str(run_dir)}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    sruns, requeues = calls(tmp_path, "srun"), calls(tmp_path, "scontrol requeue")
    if expect == "relaunch":
        assert len(sruns) == 2 and "--exclude=n1" in sruns[1] and not requeues, r.stderr
    else:
        assert len(sruns) == 1 and requeues == ["scontrol requeue 55"], r.stderr
        assert "no spare node left" in r.stderr and "no restart left in this job" in r.stderr


# ---------------------------------------------------------------- spmd report


def test_report_times_each_recovery_against_the_jobs():
    from spmd.cli.report_cmd import format_ledger, format_recoveries, recoveries
    from spmd.rundir.goodput import build_ledger

    def ev(event: str, t: float, **fields) -> dict:
        return {"event": event, "time": t, "rank": 0, "host": "n1", **fields}

    events = [ev("started", 1000, size=2, nodes=1, job_id="9", process_start=1000),
              ev("initialized", 1010, step=0, seconds=2.0), ev("compiled", 1015, seconds=3.0),
              ev("saved", 1025.5, tier="local", step=10, blocking_s=0.1),
              ev("started", 1031, size=2, nodes=1, job_id="9", process_start=1031),
              ev("restored", 1040, step=10, seconds=4.0), ev("compiled", 1042, seconds=1.0),
              ev("finished", 1053, step=20)]
    metrics = ([{"step": s, "time": 1015.0 + s, "loss": 1.0, "step_time_s": 1.0}
                for s in range(1, 13)]
               + [{"step": s, "time": 1032.0 + s, "loss": 1.0, "step_time_s": 1.0}
                  for s in range(11, 21)])
    decision = {"event": "recovery", "time": 1030.5, "ended_at": 1030.0, "failed_at": 1027.0,
                "attempt": 0, "kind": "process_lost", "action": "relaunch", "failed_rank": 1,
                "failed_hosts": ["n2"], "cause": "rank 1 on n2 died (Killed)", "nodes": 1,
                "nodes_before": 1}
    ledger = build_ledger(events, metrics)
    (row,) = recoveries([{"event": "launch", "time": 999}, decision], ledger, metrics)
    assert (row["failed_job"], row["relaunched_job"], row["restored_step"]) == (0, 1, 10)
    assert row["detect_s"] == 3.0 and row["relaunch_s"] == 1.0
    assert (row["bootstrap_s"], row["restore_s"], row["compile_s"]) == (5.0, 4.0, 1.0)
    assert row["steps_computed_twice"] == 2 and row["to_first_step_s"] == 16.0
    text = format_recoveries([row])
    assert "rank 1 on n2  process_lost  relaunch  3.0" in text
    table = format_ledger(ledger, [row])
    assert "0->1 4.0 s relaunch" in table   # from the last record to the new start
    assert "  queue               0.0 s" in table and "  relaunch            4.0 s" in table


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_a_try_whose_survivors_do_not_notice_a_dead_rank_is_ended(bindir, tmp_path):
    hangs = {**NODE_DIES, "hang": 60}
    t0 = time.monotonic()
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun -N{nodes}", [hangs, FINISHES], "--max-restarts", "1",
        "--grace", "1", "--poll", "0", env={"SLURM_JOB_NODELIST": "n[1-3]"})
    assert code == 0 and time.monotonic() - t0 < 30, err
    assert "a rank or node died and the others still run 1 s later: ending the try" in err
    decision = records(run_dir)[1]
    assert (decision["kind"], decision["failed_rank"]) == ("process_lost", 1), decision


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_a_host_the_scheduler_reports_down_ends_the_try(bindir, tmp_path):
    hangs = {**NODE_DIES, "stderr": "", "hang": 60}
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun -N{nodes}", [hangs, FINISHES], "--max-restarts", "1",
        "--poll", "0.5", env={"SLURM_JOB_NODELIST": "n[1-3]", "STUB_OUT_sinfo": "n2 down*\n"})
    assert code == 0, err
    assert "n2 of this try is down for the scheduler: ending the try" in err
    assert calls(tmp_path, "srun")[1].startswith("srun --exclude=n2"), calls(tmp_path, "srun")


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_a_launcher_that_outlives_the_ranks_failure_is_ended(bindir, tmp_path):
    """Try 0: a survivor announced a network error, srun reported no exit (still waiting on
    everything): ended grace + --ending after the announcement. Try 1: srun reported rank 0's
    exit and waits on n2, whose rank said nothing: ended --silent later, n2 left out."""
    started = [{"event": "started", "rank": 0, "host": "n1"},
               {"event": "started", "rank": 1, "host": "n2"}]
    failed = {"event": "failed", "rank": 0, "host": "n1", "first": True, "exit_code": 1,
              "error": "Gloo connection reset by peer"}
    announced = {"events": [*started, failed], "stderr": "", "hang": 60}
    stuck = {"events": [*started, failed], "hang": 60,
             "stderr": "srun: error: n1: task 0: Exited with exit code 1\n"}
    t0 = time.monotonic()
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun -N{nodes}", [announced, stuck, FINISHES],
        "--max-restarts", "2", "--grace", "0", "--poll", "0", "--ending", "3", "--silent", "1",
        env={"SLURM_JOB_NODELIST": "n[1-4]"})
    assert code == 0 and time.monotonic() - t0 < 30, err
    assert "the ranks reported a failure" in err and "ending the try" in err
    assert "every rank but those on n2 ended, and none of theirs said a word" in err, err
    d0, d1 = (r for r in records(run_dir) if r["event"] == "recovery")
    assert (d0["kind"], d0["exclude"]) == ("process_lost", []), d0
    assert (d1["kind"], d1["exclude"]) == ("node_lost", ["n2"]), d1
    assert "vanished with every rank on it" in d1["cause"], d1


def test_only_silent_hosts_left_needs_every_other_rank_accounted_for():
    recs = [{"event": "started", "rank": r, "host": h}
            for r, h in enumerate(["n1", "n1", "n2", "n2", "n3", "n3"])]
    assert only_silent_hosts_left(recs, {0, 1, 2, 3}, {}) == ["n3"]
    assert only_silent_hosts_left(recs, {0, 1, 2}, {}) == []        # rank 3 may still end
    assert only_silent_hosts_left(recs, {0, 1, 2}, {3: "Killed"}) == ["n3"]
    ended = [*recs, {"event": "failed", "rank": 3}]
    assert only_silent_hosts_left(ended, {0, 1, 2}, {}) == ["n3"]    # an end record counts
    assert only_silent_hosts_left(recs, {0, 1, 2, 3, 4}, {}) == []  # n3 said something
    assert only_silent_hosts_left(recs, set(), {}) == []            # no exits reported


@pytest.mark.slow   # runs the supervisor and its stand-in launchers
def test_deaths_the_supervisor_caused_do_not_turn_an_error_into_a_lost_rank(bindir, tmp_path):
    error = {"events": [{"event": "started", "rank": 0, "host": "n1"},
                        {"event": "started", "rank": 1, "host": "n2"},
                        {"event": "failed", "rank": 1, "host": "n2", "first": True,
                         "exit_code": 1, "error": "KeyError: 'x'"}],
             "stderr": "srun: error: n2: task 1: Exited with exit code 1\n", "hang": 60,
             "on_abort": "srun: error: n1: task 0: Killed\n"}
    code, err, run_dir = supervise(
        tmp_path, bindir, "slurm", "srun -N{nodes}", [error, FINISHES], "--max-restarts", "2",
        "--grace", "0", "--poll", "0", env={"SLURM_JOB_NODELIST": "n[1-3]"})
    assert code == 1 and len(calls(tmp_path, "srun")) == 1, err
    decision = records(run_dir)[1]
    assert (decision["kind"], decision["action"], decision["exclude"]) == ("error", "stop", [])


def test_a_late_record_of_the_ended_try_is_not_the_next_try_s(tmp_path, monkeypatch):
    """Seen in recovery_bench (2026-11-30): a rank of try 0 that the launcher had not killed
    yet wrote its `failed` record 4 s after try 1 started, and try 1 was ended for it as a
    user error, the job with it. Each rank's records name its try (SPMD_RECOVERY_ATTEMPT);
    the supervisor reads only the current try's."""
    from spmd.launch.liveness import ATTEMPT_VAR
    from spmd.launch.recovery import read_records
    from spmd.rundir.metrics import EventLog

    path = tmp_path / "events.jsonl"
    for attempt, event in ((0, "started"), (1, "started"), (0, "failed"), (1, "saved")):
        monkeypatch.setenv(ATTEMPT_VAR, str(attempt))
        log = EventLog(path, rank=1)
        log.record(event, step=3)
        log.close()
    monkeypatch.delenv(ATTEMPT_VAR)
    unsupervised = EventLog(path, rank=0)          # a run without the supervisor: no try
    unsupervised.record("saved", step=4)
    unsupervised.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("attempt") for r in records] == [0, 1, 0, 1, None]
    since = records[0]["time"]
    assert [(r["event"], r.get("attempt")) for r in read_records(tmp_path, since, 1)] == [
        ("started", 1), ("saved", 1), ("saved", None)]
    assert len(read_records(tmp_path, since)) == 5            # no try named: every record
    assert [r["event"] for r in read_records(tmp_path, since, 0)] == ["started", "failed",
                                                                      "saved"]
