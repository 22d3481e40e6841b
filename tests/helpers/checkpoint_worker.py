"""Helpers of the checkpoint tests, and a rank that restores a run and dumps its whole state.

    mpiexec -n N python tests/helpers/checkpoint_worker.py CONFIG OUT.npz [key=value ...]

Every rank builds the runtime for CONFIG (its mesh, its strategy), restores through the real
checkpointer, gathers every leaf to host, and rank 0 writes OUT.npz (leaf path -> array) and
OUT.json (step and source per rank). Used to compare states across meshes and process counts.
With OUT given as @PLAN.json (a list of [run_dir, out] pairs), one launch restores each run
directory in turn into its own OUT: the start-up (MPI, jax.distributed, the runtime) is paid
once for a batch of damaged copies of one run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "mlp_tiny.yaml"
# no plots: matplotlib's half a second of CPU at each run's end, and no test of these reads them
BASE = ("run.progress=false", "run.log_every=1", "run.plots=false")


def _env(devices: int, **extra: str) -> dict[str, str]:
    from tests.helpers.env import clean_env

    return clean_env(JAX_NUM_CPU_DEVICES=str(devices), SPMD_PROCESSES_PER_NODE="1", **extra)


def _mpi(n: int) -> list[str]:
    """mpiexec with `spmd run`'s options."""
    from spmd.cli.run_cmd import find_mpiexec, flavor_args

    mpiexec = find_mpiexec()
    return [str(mpiexec), "-n", str(n), *flavor_args(mpiexec)]


def train_cmd(n: int, run_dir: Path, *overrides: str) -> list[str]:
    """`spmd run -n N` (or `spmd train` for one process) of the tiny MLP into run_dir."""
    head = ["run", "-n", str(n)] if n > 1 else ["train"]
    return [sys.executable, "-m", "spmd.cli", *head, str(CONFIG), f"run.dir={run_dir}", *BASE,
            *overrides]


def train(n: int, run_dir: Path, *overrides: str, devices: int = 4, timeout: float = 300,
          **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(n, run_dir, *overrides), capture_output=True, text=True,
                          env=_env(devices, **env), timeout=timeout, cwd=REPO)


def dump(n: int, run_dir: Path, out: Path, *overrides: str, devices: int = 4,
         timeout: float = 300) -> dict:
    """Restore run_dir's newest checkpoint on n processes x devices; returns OUT.json + arrays."""
    cmd = [*(_mpi(n) if n > 1 else []), sys.executable, str(Path(__file__).resolve()),
           str(CONFIG), str(out), f"run.dir={run_dir}", *BASE, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(devices),
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return _read_dump(out)


def dump_each(n: int, pairs: list[tuple[Path, Path]], *overrides: str, devices: int = 4,
              timeout: float = 300) -> list[dict]:
    """`dump` of several run directories (same config and mesh) in one launch, in order."""
    plan = pairs[0][1].with_name(pairs[0][1].stem + ".plan.json")
    plan.write_text(json.dumps([[str(r), str(o)] for r, o in pairs]))
    cmd = [*(_mpi(n) if n > 1 else []), sys.executable, str(Path(__file__).resolve()),
           str(CONFIG), f"@{plan}", f"run.dir={pairs[0][0]}", *BASE, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(devices),
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [_read_dump(out) for _, out in pairs]


def _read_dump(out: Path) -> dict:
    import numpy as np

    meta = json.loads(out.with_suffix(".json").read_text())
    with np.load(out) as z:
        meta["arrays"] = {k: z[k] for k in z.files}
    return meta


def same_state(a: dict, b: dict) -> list[str]:
    """Leaf paths whose bytes, dtype or shape differ between two dumps."""
    keys = set(a["arrays"]) | set(b["arrays"])
    return sorted(k for k in keys if k not in a["arrays"] or k not in b["arrays"]
                  or a["arrays"][k].dtype != b["arrays"][k].dtype
                  or a["arrays"][k].shape != b["arrays"][k].shape
                  or a["arrays"][k].tobytes() != b["arrays"][k].tobytes())


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in out if name is None or e["event"] == name]


def committed_by_all(run_dir: Path, step: int, ranks: int = 2) -> bool:
    """Whether every rank has committed a local-tier step >= `step`."""
    steps = [int(p.parent.parent.name) for p in (run_dir / "local").glob("*/rank*/COMMITTED")
             if p.parent.parent.name.isdigit()]
    return any(steps.count(s) == ranks for s in steps if s >= step)


def step_blobs(run_dir: Path, step: int) -> dict[str, bytes]:
    """Every rank's local-tier blob of `step` (the whole state, packed): equal bit for bit."""
    return {p.parent.name: p.read_bytes()
            for p in sorted((run_dir / "local" / str(step)).glob("rank?????/shards.bin"))}


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries SPMD_TEST_TAG=tag (the job's ranks, mpiexec...)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if f"SPMD_TEST_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def kill_tagged(tag: str) -> int:
    """SIGKILL every process of the tagged job; returns how many were killed."""
    pids = tagged_pids(tag)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 30
    while tagged_pids(tag) and time.time() < deadline:
        time.sleep(0.1)
    return len(pids)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n"
                                 f"{out[-3000:]}\n{err[-6000:]}")
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    config, out, *overrides = argv
    from spmd.config.load import build_task, load_config

    cfg = load_config(config, overrides)
    from spmd.launch import bootstrap

    env = bootstrap(init_timeout_s=cfg.launch.init_timeout_s,
                    heartbeat_timeout_s=cfg.launch.heartbeat_timeout_s)
    import jax
    import numpy as np

    from spmd.checkpoint import create_checkpointer
    from spmd.checkpoint.layout import leaf_paths
    from spmd.comm.host_gather import gather_to_host
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime
    from spmd.rundir.metrics import EventLog

    mesh = build_mesh(cfg.mesh, jax.devices(), env.node_of_rank)
    rt = build_runtime(cfg.engine_sections(), mesh, build_task(cfg))
    if out.startswith("@"):
        pairs = [(Path(r), Path(o)) for r, o in json.loads(Path(out[1:]).read_text())]
    else:
        pairs = [(Path(cfg.run.dir), Path(out))]
    for run_dir, out_path in pairs:
        events = EventLog(out_path.with_name(out_path.stem + f".events{env.rank}.jsonl"),
                          env.rank)
        ckpt = create_checkpointer(cfg.checkpoint, run_dir=run_dir, env=env, events=events)
        restored = ckpt.restore(rt.state.abstract)
        if restored is None:
            print(f"rank {env.rank}: nothing to restore in {run_dir}", file=sys.stderr)
            return 3
        leaves = jax.tree.leaves(restored.state)
        arrays = {}
        for path, x in zip(leaf_paths(restored.state), leaves):
            arrays[path] = np.asarray(gather_to_host(x))
        sources = gather_to_host(
            np.array([{"local": 0, "partner": 1, "persistent": 2}[restored.source]]))
        if env.rank == 0:
            np.savez(out_path, **arrays)
            names = ["local", "partner", "persistent"]
            out_path.with_suffix(".json").write_text(json.dumps({
                "step": restored.step, "detail": restored.detail,
                "sources": [names[int(s)] for s in np.asarray(sources).reshape(-1)]}))
        ckpt.close()
        events.close()
    if env.size > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
