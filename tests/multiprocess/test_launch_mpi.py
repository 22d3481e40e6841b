"""Real ranks under mpiexec: resolution with MPI, and the stop vote's agreement (StopVote)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.helpers.env import REPO, clean_env, mpiexec_path

pytestmark = pytest.mark.slow


def mpiexec(n: int, *argv: str, env: dict[str, str], timeout: float = 120):
    return subprocess.run([mpiexec_path(), "-n", str(n), "-launcher", "fork", *argv],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def reports(stdout: str) -> list[dict]:
    """The JSON objects the ranks printed, by rank (one write each, so never interleaved)."""
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])


def test_doctor_under_mpiexec():
    result = mpiexec(2, sys.executable, "-m", "spmd.cli", "doctor", "--json", env=clean_env())
    assert result.returncode == 0, result.stderr
    r0, r1 = reports(result.stdout)
    for rank, r in enumerate((r0, r1)):
        assert (r["rank"], r["size"], r["local_rank"], r["local_size"]) == (rank, 2, rank, 2)
        assert (r["launcher"], r["node_id"], r["num_nodes"]) == ("hydra", 0, 1)
        assert r["sources"]["rank"] == "PMI_RANK" and r["mpi"]["used"]
        assert r["sources"]["node_of_rank"] == "hostname allgather over MPI"
    assert r0["coordinator"] == r1["coordinator"] and r0["coordinator"].startswith("127.0.0.1:")
    assert "broadcast over MPI" in r0["sources"]["coordinator"]


MPI4PY_SCRIPT = r"""
import json, sys
from mpi4py import MPI
from spmd.launch import resolve_launch_env
env = resolve_launch_env({}, MPI.COMM_WORLD)  # no launcher variables: only MPI knows
sys.stdout.write(json.dumps(env.to_dict()) + "\n")
"""


def test_mpi4py_path(tmp_path):
    script = tmp_path / "resolve.py"
    script.write_text(MPI4PY_SCRIPT)
    result = mpiexec(2, sys.executable, str(script), env=clean_env(PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    r0, r1 = reports(result.stdout)
    for rank, r in enumerate((r0, r1)):
        assert (r["launcher"], r["rank"], r["size"]) == ("mpi4py", rank, 2)
        assert (r["local_rank"], r["local_size"], r["node_of_rank"]) == (rank, 2, [0, 0])
        assert r["sources"]["rank"] == "mpi4py COMM_WORLD"


WATCHER_SCRIPT = r"""
import json, os, signal, sys, time
from spmd.comm import RankGroup, StopVote
from spmd.errors import ExitCode
from spmd.launch import PreemptionWatcher, bootstrap
env = bootstrap(60, 60)
halt = os.environ.get("HALT_FILE")
watcher = StopVote(PreemptionWatcher.install(halt_file=halt, env=env),
                   RankGroup(env, 30, "launch.barrier_timeout_s", "preempt"))
if env.rank == 0 and os.environ.get("DEADLINE_IN_S"):
    watcher.deadline = time.time() + float(os.environ["DEADLINE_IN_S"])
kill_rank, kill_step = int(os.environ.get("KILL_RANK", -1)), int(os.environ.get("KILL_STEP", -1))
for step in range(100000):
    if env.rank == kill_rank and step == kill_step:
        os.kill(os.getpid(), signal.SIGUSR1)
    if env.rank == 1 and step == 20 and halt:
        open(halt, "w").close()  # rank 1 creates it; rank 0 notices
    if watcher.should_stop(step):
        report = {"rank": env.rank, "step": step, "reason": watcher.reason}
        sys.stdout.write(json.dumps(report) + "\n")  # one write: ranks never interleave
        sys.exit(ExitCode.PREEMPTED)
    time.sleep(0.001)
sys.exit(1)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("agreement", ["mpi", "jax_kv"])
def test_signal_on_one_rank_stops_all_at_same_step(tmp_path, agreement):
    script = tmp_path / "watch.py"
    script.write_text(WATCHER_SCRIPT)
    extra = {} if agreement == "mpi" else {"SPMD_MPI": "0",
                                           "SPMD_COORDINATOR": f"127.0.0.1:{free_port()}"}
    env = clean_env(PYTHONPATH=str(REPO), KILL_RANK="1", KILL_STEP="7", **extra)
    result = mpiexec(2, sys.executable, str(script), env=env)
    assert result.returncode == 75, result.stdout + result.stderr
    r0, r1 = reports(result.stdout)
    assert r0["step"] == r1["step"] == 7
    assert r0["reason"] == r1["reason"]
    assert r0["reason"].startswith("SIGUSR1 received by rank 1 on ")


def test_halt_file_stops_all(tmp_path):
    script = tmp_path / "watch.py"
    script.write_text(WATCHER_SCRIPT)
    env = clean_env(PYTHONPATH=str(REPO), HALT_FILE=str(tmp_path / "HALT"))
    result = mpiexec(2, sys.executable, str(script), env=env)
    assert result.returncode == 75, result.stdout + result.stderr
    r0, r1 = reports(result.stdout)
    assert r0["step"] == r1["step"] >= 20
    assert "halt file" in r0["reason"] and r0["reason"] == r1["reason"]


def test_deadline_known_to_rank0_stops_all(tmp_path):
    script = tmp_path / "watch.py"
    script.write_text(WATCHER_SCRIPT)
    result = mpiexec(2, sys.executable, str(script),
                     env=clean_env(PYTHONPATH=str(REPO), DEADLINE_IN_S="1.0"))
    assert result.returncode == 75, result.stdout + result.stderr
    r0, r1 = reports(result.stdout)
    assert r0["step"] == r1["step"] > 0
    assert "wall-time deadline" in r1["reason"] and "rank 0" in r1["reason"]


HANG_SCRIPT = r"""
import sys, time
from spmd.comm import RankGroup, StopVote
from spmd.launch import LaunchError, PreemptionWatcher, bootstrap
env = bootstrap(60, 60)
watcher = StopVote(PreemptionWatcher.install(env=env),
                   RankGroup(env, 2, "launch.barrier_timeout_s", "preempt"))
try:
    for step in range(100):
        if env.rank == 1 and step == 5:
            time.sleep(6)  # rank 1 stops taking part
            sys.exit(0)
        watcher.should_stop(step)
except LaunchError as e:
    print(f"LaunchError: {e}", flush=True)
    sys.exit(2)
"""


def test_missing_rank_times_out_instead_of_hanging(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    result = mpiexec(2, sys.executable, str(script), env=clean_env(PYTHONPATH=str(REPO)),
                     timeout=60)
    assert result.returncode != 0
    assert "LaunchError: rank 0 on" in result.stdout
    assert "agree whether to stop at step 5" in result.stdout


STAGGERED_EXIT = r"""
import atexit, os, signal, time
def check():  # registered first, so it runs last: after bootstrap's exit handler
    if signal.getsignal(signal.SIGUSR1) != signal.SIG_IGN:
        os._exit(3)
atexit.register(check)
from spmd.launch import bootstrap
env = bootstrap(init_timeout_s=60)
time.sleep(0.4 * env.rank)   # ranks finish one after another, as rank 0 does after its plots
"""


def test_ranks_that_end_one_after_another_are_not_killed_by_hydras_sigusr1(tmp_path):
    """Hydra (-disable-auto-cleanup) sends SIGUSR1 to all ranks as each one closes its PMI
    socket; a rank past its Python handlers must ignore it, behind `spmd run`'s shim or not."""
    from spmd.launch import rank_shim

    script = tmp_path / "staggered.py"
    script.write_text(STAGGERED_EXIT)
    env = clean_env(PYTHONPATH=str(REPO), JAX_NUM_CPU_DEVICES="1")
    for shim in ((), (sys.executable, rank_shim.__file__)):
        for _ in range(2):
            result = mpiexec(3, "-disable-auto-cleanup", *shim, sys.executable, str(script),
                             env=env)
            assert result.returncode == 0, (shim, result.returncode, result.stderr[-3000:])


def test_watched_signals_are_ignored_once_the_interpreter_exits(tmp_path):
    # the probe is registered first, so it runs after the watcher's exit handler (LIFO)
    code = ("import atexit, os, signal\n"
            "atexit.register(lambda: os._exit(0 if all(signal.getsignal(s) == signal.SIG_IGN\n"
            "    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)) else 3))\n"
            "from spmd.launch import PreemptionWatcher, resolve_launch_env\n"
            "PreemptionWatcher.install(env=resolve_launch_env({}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=clean_env(), timeout=120, cwd=REPO)
    assert result.returncode == 0, (result.returncode, result.stderr)
