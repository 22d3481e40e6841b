"""spmd across real separate nodes: `sbatch -N 4`, 2 ranks per node, on the namespace cluster.

Each node (tests/helpers/netns_cluster.py) has its own hostname, address and /local, so
these tests see what one host never shows: the coordinator on rank 0's node address (a
127.0.0.1 coordinator cannot be reached from another namespace), node ids from real
hostnames, node-local checkpoints that other nodes cannot read, partner copies on another
node, and a node that dies with its disk.

Jobs (all tiny, sequential, one shared cluster):
- `uninterrupted`: the transformer, 6 steps, saves at 3 and 6; before training, `spmd doctor`
  on every rank; after it, `spmd ckpt ls` on every node.
- `fno`: the FNO on a 16x16 Darcy set, 4 steps.
- `killed` + `resumed`: the transformer again; the save of step 6 is held in flight
  (SPMD_CKPT_TEST_STALL) while node3 is killed (every process by pid, its slurmd, its
  /local); the same run then resumes on node1, node2, node4 and node5 from step 3, from the
  partner copies held on the survivors, and must match `uninterrupted` bit for bit.
References for "the same run on one node": the same config in the test process, one
process
with 8 CPU devices (tests.helpers.training.config_losses).

MPI: the jobs run MPICH over libfabric's tcp provider (MPIR_CVAR_CH4_NETMOD=ofi,
FI_PROVIDER=tcp), a setting of this test machine, not of spmd (docs/multinode_tests.md: UCX's
address exchange through Slurm 22.05's pmi2 arrived garbled, and libfabric's default provider
choice hung in MPI_Init).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.env import REPO, XLA_CACHE
from tests.helpers.fault_injection import fault_env
from tests.helpers.fno import make_tiny_dataset, tiny_config
from tests.helpers.netns_cluster import NetnsCluster, netns_cluster  # noqa: F401

TRANSFORMER = REPO / "configs" / "transformer_tiny.yaml"
STEPS, EVERY = 6, 3
NODES = ["node1", "node2", "node3", "node4"]
RANKS_PER_NODE = 2
SIZE = len(NODES) * RANKS_PER_NODE
COMMON = ("run.progress=false", "run.plots=false", "run.log_every=1",
          "checkpoint.timeout_s=300", "launch.init_timeout_s=300", "run.lease_stale_s=10")
TRAIN_T = (f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=2", *COMMON)
JOB_TIMEOUT = 600


def job_env(**extra: str) -> str:
    """`export` lines for a job script: CPU JAX, one device per rank, MPICH over OFI."""
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", "PYTHONUNBUFFERED": "1",
           "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", **XLA_CACHE, **extra}
    return "".join(f"export {k}={v}\n" for k, v in env.items())


def train_script(config: Path, run_dir: Path, *overrides: str, doctor: bool = False,
                 ckpt_ls: bool = False, **env: str) -> str:
    py = f"{sys.executable} -m spmd.cli"
    lines = ["#!/bin/bash", "set -u", f"cd {REPO}", job_env(**env), f"mkdir -p {run_dir}"]
    if doctor:
        lines.append(f"srun --mpi=pmi2 --output={run_dir}/doctor-%t.json {py} doctor --json "
                     "|| exit 3")
    lines.append(f"srun --mpi=pmi2 {py} train {config} run.dir={run_dir} "
                 + " ".join(overrides) + " || exit $?")
    if ckpt_ls:
        lines.append(f"srun --nodes={len(NODES)} --ntasks={len(NODES)} --ntasks-per-node=1 "
                     f"--output={run_dir}/ckpt-ls-%N.json "
                     f"{py} ckpt ls {run_dir} --json || exit 4")
    return "\n".join(lines) + "\n"


def submit(cluster: NetnsCluster, script: str, nodes: list[str], name: str,
           out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    return cluster.sbatch(script, f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
                          f"--ntasks-per-node={RANKS_PER_NODE}", "--cpus-per-task=1",
                          f"--job-name={name}", f"--output={out}/slurm-{name}-%j.out")


def finish(cluster: NetnsCluster, job: str) -> None:
    info = cluster.wait_finished(job, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", cluster.describe(job, info)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last record of each step (a resumed run repeats none here)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "step" in rec:
            out[int(rec["step"])] = float(rec["loss"])
    return out


def events(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e.get("event") == name]


def one_node_losses(config: Path, steps: int, *overrides: str) -> list[float]:
    """The same run on one node: one process with 8 CPU devices (this one)."""
    import jax

    from tests.helpers.training import config_losses

    return config_losses(config, "dp", jax.devices()[:SIZE], steps, *overrides)[0]


@pytest.fixture(scope="module")
def cluster(netns_cluster):  # noqa: F811
    for node in netns_cluster.nodes:   # a module before us may have killed one
        if node not in netns_cluster.idle_nodes():
            netns_cluster.revive_node(node)
    return netns_cluster


ONE_NODE: dict[Path, list[float]] = {}   # made while the uninterrupted job runs


@pytest.fixture(scope="module")
def one_node(uninterrupted) -> list[float]:
    """The transformer's losses in one process with 8 devices (tests/helpers/training)."""
    return ONE_NODE[TRANSFORMER]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("mn") / "uninterrupted"
    script = train_script(TRANSFORMER, run_dir, *TRAIN_T, "checkpoint.local_dir=/local/plain",
                          doctor=True, ckpt_ls=True)
    job = submit(cluster, script, NODES, "uninterrupted", run_dir)
    ONE_NODE[TRANSFORMER] = one_node_losses(TRANSFORMER, STEPS, *TRAIN_T)
    finish(cluster, job)
    return run_dir


def test_doctor_shows_four_hosts_and_a_coordinator_on_a_node_address(cluster, uninterrupted):
    reports = [json.loads((uninterrupted / f"doctor-{t}.json").read_text())
               for t in range(SIZE)]
    assert [r["rank"] for r in reports] == list(range(SIZE))
    hosts = [r["hostname"] for r in reports]
    assert hosts == [n for n in NODES for _ in range(RANKS_PER_NODE)], hosts
    assert [r["node_id"] for r in reports] == [r // RANKS_PER_NODE for r in range(SIZE)]
    assert {r["num_nodes"] for r in reports} == {4}
    assert {r["local_size"] for r in reports} == {RANKS_PER_NODE}
    coordinators = {r["coordinator"] for r in reports}
    assert len(coordinators) == 1, coordinators
    host = coordinators.pop().rsplit(":", 1)[0]
    assert host == cluster.addr["node1"], f"coordinator on {host}, not node1's address"


def test_four_nodes_train_the_transformer_as_one_node_does(uninterrupted, one_node):
    got = losses(uninterrupted)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], one_node, rtol=1e-6)
    started = events(uninterrupted, "started")
    assert started and {e["nodes"] for e in started} == {4}, started


def test_node_local_tier_and_partner_copies_sit_on_other_nodes(cluster, uninterrupted):
    """Read each node's own /local: its ranks' copies, and partner copies of other nodes'."""
    node_of = {r: NODES[r // RANKS_PER_NODE] for r in range(SIZE)}
    for step in (EVERY, STEPS):
        holders: dict[int, str] = {}
        for node in NODES:
            step_dir = cluster.local(node) / "plain" / str(step)
            dirs = sorted(p.name for p in step_dir.iterdir())
            own = [r for r in range(SIZE) if node_of[r] == node]
            assert dirs == [f"rank{r:05d}" for r in own], (node, step, dirs)
            for r in own:
                marker = json.loads((step_dir / f"rank{r:05d}" / "COMMITTED").read_text())
                assert marker["host"] == node
                for q in marker["partners"]:
                    assert (step_dir / f"rank{r:05d}" / f"partner-rank{q:05d}.bin").is_file()
                    assert node_of[q] != node, f"rank {q}'s partner copy on its own {node}"
                    holders[q] = node
        assert sorted(holders) == list(range(SIZE)), f"step {step}: partner copies {holders}"
    # and `spmd ckpt ls`, run on every node, says which node holds what
    for node in NODES:
        listing = json.loads((uninterrupted / f"ckpt-ls-{node}.json").read_text())
        assert listing["host"] == node and listing["local_dir"] == "/local/plain"
        step = next(s for s in listing["local"] if s["step"] == STEPS)
        assert {(c["rank"], c["host"]) for c in step["ranks"]} == {
            (r, node) for r in range(SIZE) if node_of[r] == node}
        partners = {q for c in step["ranks"] for q in c["partners"]}
        assert partners and all(node_of[q] != node for q in partners)


def test_four_nodes_train_the_fno_as_one_node_does(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mn_fno")
    data = make_tiny_dataset(tmp / "darcy.h5")
    config = tiny_config(tmp, data, train={"steps": 4, "batch_size": 8, "seed": 0,
                                            "eval_every": 0})
    run_dir = tmp / "run"
    script = train_script(config, run_dir, *COMMON)
    job = submit(cluster, script, NODES, "fno", run_dir)
    want = one_node_losses(config, 4, *COMMON)      # compiles while the job runs
    finish(cluster, job)
    got = losses(run_dir)
    np.testing.assert_allclose([got[s] for s in sorted(got)], want, rtol=1e-6)


def test_killed_node_restores_from_partner_copies_on_survivors(cluster, uninterrupted,
                                                               tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mn_kill") / "killed"
    stall = fault_env(stall=f"{STEPS}:600")
    killed = submit(cluster, train_script(TRANSFORMER, run_dir, *TRAIN_T,
                                          "checkpoint.local_dir=/local/kill", **stall),
                    NODES, "killed", run_dir)
    try:
        in_flight = [cluster.local(n) / "kill" / str(STEPS) / f"rank{r:05d}.tmp" / "index.json"
                     for r, n in enumerate(n for n in NODES for _ in range(RANKS_PER_NODE))]
        deadline = time.monotonic() + JOB_TIMEOUT
        while not all(p.exists() for p in in_flight):
            assert time.monotonic() < deadline, cluster.describe(killed)
            assert cluster.state(killed) in ("PENDING", "RUNNING"), cluster.describe(killed)
            time.sleep(0.5)
        pids = cluster.kill_node("node3")
        assert len(pids) >= 3, pids          # slurmd, slurmstepd(s) and the two ranks
        assert not cluster.node_pids("node3") and not cluster.local("node3").exists()
    finally:
        cluster.run("scancel", killed, check=False)
    cluster.wait_finished(killed, timeout=120)
    assert max(losses(run_dir)) == STEPS   # it trained to the end; step 6 never committed

    survivors = ["node1", "node2", "node4", "node5"]
    resumed = submit(cluster, train_script(TRANSFORMER, run_dir, *TRAIN_T,
                                           "checkpoint.local_dir=/local/kill"),
                     survivors, "resumed", run_dir)
    finish(cluster, resumed)
    restored = events(run_dir, "restored")
    assert restored and {e["step"] for e in restored} == {EVERY}, restored
    assert {e["source"] for e in restored} <= {"local", "partner"}, restored
    # ranks 4 and 5 (node3's) came back from their partner copies on node4
    detail = " ".join(e.get("detail", "") for e in restored)
    assert "partner" in detail, restored
    got = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed_losses = {r["step"]: r["loss"] for r in got[-(STEPS - EVERY):] if "loss" in r}
    want = losses(uninterrupted)
    assert resumed_losses == {s: want[s] for s in range(EVERY + 1, STEPS + 1)}
    cluster.revive_node("node3")
