"""A lost node: recovery inside the job (a spare node) against ending the job and requeueing it.

Where the time goes from a node's death to the first step trained again, on real separate
nodes: the 5-node namespace cluster of the tests (tests/helpers/netns_cluster.py: every node
its own network, hostname and /local, real slurm-wlm daemons; needs root, slurm-wlm, munge).
4 nodes x 2 ranks train the transformer (configs/transformer_tiny.yaml, made larger by
--model so that a step takes about 1 s here), saving to the node-local tier every --every
steps; once step --kill-at is logged, the node of ranks 4 and 5 dies (every process by pid,
its /local deleted). Two jobs, the same config and the same kill:

- in-job: the script `spmd jobscript --spare-nodes 1` renders (5 nodes, --no-kill, the ranks
  under spmd.launch.supervisor): the supervisor ends the try, leaves the node out and starts
  the ranks again on the spare, in the same job; they restore from the partner copies.
- requeue: the script `spmd jobscript` renders without spares (what spmd did before): Slurm
  ends the job when it marks the node down, and requeues it (JobRequeue, --requeue); the
  next job starts on the nodes left and restores the same way. Its queue wait (here the
  scheduler's latency on an idle cluster; on a busy machine hours) is left out of the total
  and printed apart.

Timed from the kill (this script's clock): detect (to the end of the try: the supervisor's
`ended_at`; requeue: to the job leaving RUNNING in `scontrol`), relaunch (to the new try's or
job's first process), bootstrap and restore (the new try's parts in `spmd report --json`),
compile (the slowest rank's: the first step waits for it), to the first step trained again
(metrics.jsonl), and the steps computed twice (the ledger's lost steps). Requeue: the time
the job is not RUNNING (PENDING after Slurm's requeue, until it runs again) is its queue
wait, printed and left out of its total.

    sudo python benchmarks/recovery_bench.py [--steps 40 --every 10 --kill-at 25]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import add_record_option, emit, machine, table  # noqa: E402

CONFIG = REPO / "configs" / "transformer_tiny.yaml"
NODES, RANKS_PER_NODE = 4, 2
MODEL = ("model.d_model=128", "model.num_layers=4", "model.d_ff=512", "model.seq_len=128",
         "train.batch_size=32")


def render(run_dir: Path, spare: bool, overrides: list[str]) -> str:
    from tests.helpers.netns_cluster import JOB_ENV  # the cluster's job environment

    env = [a for k, v in JOB_ENV.items() for a in ("--env", f"{k}={v}")]
    cmd = [sys.executable, "-m", "spmd.cli", "jobscript", str(CONFIG), "--system", "slurm",
           "--nodes", str(NODES), "--ranks-per-node", str(RANKS_PER_NODE), "--time", "30",
           "--check", "none", *env, *(["--spare-nodes", "1"] if spare else []),
           f"run.dir={run_dir}", *overrides]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"spmd jobscript failed: {r.stderr}")
    return r.stdout


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, filter(None, path.read_text().splitlines()))
            if "loss" in r and "step" in r]


def hosts_of_first_try(run_dir: Path) -> dict[int, str]:
    path = run_dir / "events.jsonl"
    out: dict[int, str] = {}
    for e in map(json.loads, filter(None, path.read_text().splitlines())):
        if e.get("event") == "started" and int(e["rank"]) not in out:
            out[int(e["rank"])] = e["host"]
    return out


def slowest_compile(run_dir: Path, since: float) -> float | None:
    """The longest `compiled` record of any rank after `since`: the first step waits for the
    slowest rank (on CPU only rank 0 finds its step in the compilation cache: JAX keys a CPU
    executable by its device assignment; on GPUs every rank finds it)."""
    path = run_dir / "events.jsonl"
    seconds = [float(e["seconds"]) for e in map(json.loads, filter(None, path.read_text()
                                                                    .splitlines()))
               if e.get("event") == "compiled" and float(e["time"]) > since]
    return max(seconds) if seconds else None


def scenario(cluster, root: Path, name: str, spare: bool, args) -> dict:
    """One job: train, kill the node of ranks 4 and 5 after step args.kill_at, finish."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    overrides = [*args.model, f"train.steps={args.steps}", f"checkpoint.every={args.every}",
                 "checkpoint.keep=2", f"checkpoint.local_dir=/local/{name}",
                 "run.progress=false", "run.plots=false", "run.log_every=1",
                 "launch.init_timeout_s=300", "run.lease_stale_s=10"]
    script = render(run_dir, spare, overrides)
    nodelist = ([f"--nodelist={','.join(cluster.nodes[:NODES + 1])}"] if spare else [])
    job = cluster.sbatch(script, *nodelist, f"--job-name={name}",
                         f"--output={run_dir}/slurm-%j.out")
    deadline = time.monotonic() + 1200
    while not any(r["step"] >= args.kill_at for r in metrics(run_dir)):
        if time.monotonic() > deadline or cluster.state(job) not in ("PENDING", "RUNNING"):
            raise SystemExit(f"{name}: no step {args.kill_at}\n{cluster.describe(job)}")
        time.sleep(0.2)
    victim = hosts_of_first_try(run_dir)[4]
    killed_at = time.time()
    cluster.kill_node(victim)
    # the job's own course, seen from outside: when it stops running (requeue: Slurm ends it
    # and queues it again) and runs again
    left_running = running_again = None
    while (state := cluster.state(job)) not in ("COMPLETED", "FAILED", "CANCELLED",
                                                "TIMEOUT", "NODE_FAIL"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: not finished\n{cluster.describe(job)}")
        if state != "RUNNING" and left_running is None:
            left_running = time.time()
        if state == "RUNNING" and left_running is not None and running_again is None:
            running_again = time.time()
        time.sleep(0.25)
    info = cluster.job_info(job)
    if state != "COMPLETED":
        raise SystemExit(f"{name}: {cluster.describe(job, info)}")
    r = cluster.run(sys.executable, "-m", "spmd.cli", "report", str(run_dir), "--json",
                    timeout=120, check=False)
    report = json.loads(r.stdout)
    steps = metrics(run_dir)
    before = [s for s in steps if float(s["time"]) < killed_at]
    times = [float(s["time"]) for s in before[2:]]
    step_s = sorted(b - a for a, b in zip(times, times[1:]))
    after = [s for s in steps if float(s["time"]) > killed_at]
    first = float(after[0]["time"]) if after else float("nan")
    out = {"scenario": name, "job": job, "victim": victim, "restarts": int(info["Restarts"]),
           "step_s": step_s[len(step_s) // 2] if step_s else None,
           "kill_to_first_step_s": first - killed_at}
    if spare:   # the supervisor's row: the try's end, the relaunch, the new try's parts
        (rec,) = report["recoveries"]
        (decision,) = [d for d in map(json.loads, (run_dir / "recovery.jsonl").read_text()
                                      .splitlines()) if d.get("event") == "recovery"]
        out.update({k: rec.get(k) for k in ("relaunch_s", "bootstrap_s", "restore_s",
                                            "compile_s", "steps_computed_twice",
                                            "restored_step")},
                   detect_s=float(decision["ended_at"]) - killed_at, queue_s=0.0,
                   init_s=report["jobs"][rec["relaunched_job"]]["parts"].get("init"),
                   compile_s=slowest_compile(run_dir, float(decision["ended_at"])),
                   to_first_step_s=first - killed_at)
        return _with_other(out)
    if left_running is None or running_again is None:
        raise SystemExit(f"{name}: the job was not requeued\n{cluster.describe(job, info)}")
    failed, resumed = report["jobs"][0], report["jobs"][1]
    queue = running_again - left_running
    out.update(detect_s=left_running - killed_at, queue_s=queue,
               relaunch_s=max(resumed["start"] - running_again, 0.0),
               bootstrap_s=resumed["parts"].get("bootstrap"),
               restore_s=resumed["parts"].get("restore"),
               compile_s=slowest_compile(run_dir, running_again),
               init_s=resumed["parts"].get("init"),
               to_first_step_s=first - killed_at - queue,
               steps_computed_twice=failed["lost_steps"],
               restored_step=resumed["restored_step"])
    return _with_other(out)


PHASES = ("detect_s", "relaunch_s", "bootstrap_s", "init_s", "restore_s", "compile_s")


def _with_other(row: dict) -> dict:
    """`other_s`: to the first step, what the phases do not explain (the first step itself,
    its metrics record, data and model set-up outside `init`)."""
    row["other_s"] = row["to_first_step_s"] - sum(row.get(k) or 0.0 for k in PHASES)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="checkpoint.every (node-local)")
    p.add_argument("--kill-at", type=int, default=25, help="kill once this step is logged")
    p.add_argument("--model", nargs="*", default=list(MODEL),
                   help="config overrides that size the model (a step of about 1 s here)")
    add_record_option(p)
    args = p.parse_args(argv)

    from tests.helpers.netns_cluster import check_prerequisites, start_netns_cluster

    check_prerequisites()
    root = Path(tempfile.mkdtemp(prefix="spmd-recovery-bench-"))
    cluster = start_netns_cluster(NODES + 1)
    try:
        rows = [scenario(cluster, root, "in_job", True, args)]
        cluster.revive_node(rows[0]["victim"])
        rows.append(scenario(cluster, root, "requeue", False, args))
    finally:
        cluster.stop()

    def s(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    head = ("scenario", "step s", "detect s", "relaunch s", "bootstrap s", "init s",
            "restore s", "compile s", "other s", "to 1st step s (queue left out)", "queue s",
            "steps twice")
    print(table([head] + [(r["scenario"], s(r["step_s"]), *(s(r[k]) for k in PHASES),
                           s(r["other_s"]), s(r["to_first_step_s"]), s(r["queue_s"]),
                           str(r["steps_computed_twice"])) for r in rows]))
    emit({"benchmark": "recovery_bench", "machine": machine(), "args": vars(args),
          "rows": rows}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
