"""The training loop: one rank's view of a run, from bootstrap to the last save."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from spmd.checkpoint import make_checkpointer
from spmd.config import Config
from spmd.launch import (
    HALT_FILE_NAME,
    PREEMPTED_EXIT_CODE,
    LaunchEnv,
    PreemptionWatcher,
    bootstrap,
    job_end_time,
    shutdown,
)
from spmd.lease import RunLease
from spmd.mesh import build_mesh
from spmd.metrics import EventLog, JsonlWriter, Progress, setup_logging
from spmd.runtime import Runtime, build_runtime
from spmd.tasks import make_task

log = logging.getLogger("spmd.trainer")

def evaluate(rt: Runtime, params, sample_path: Path | None) -> dict[str, float]:
    """Mean of the task's eval metrics over `data.eval_batches` fixed batches.

    With a sample step, the first batch's sample outputs go to `sample_path` (rank 0).
    """
    source = rt.task.eval_source()
    totals: dict[str, float] = {}
    n = rt.task.eval_batches()
    for i in range(n):
        batch = rt.feed.global_batch(source, i)
        metrics = jax.device_get(rt.eval_step(params, batch))
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) / n
        if i == 0 and rt.sample_step is not None:
            sample = jax.device_get(rt.sample_step(params, batch))
            if sample_path is not None:
                np.savez(sample_path, **sample)
    return totals


def compile_train_step(rt: Runtime, events: EventLog):
    """Compile ahead of time, so the first step's time is a step's, and log how long XLA took."""
    t0 = time.perf_counter()
    batch = {name: jax.ShapeDtypeStruct(f.global_shape(rt.cfg.train.batch_size), f.dtype,
                                        sharding=rt.feed.shardings[name])
             for name, f in rt.feed.fields.items()}
    compiled = rt.train_step.lower(rt.state.abstract, batch).compile()
    events.emit("compiled", seconds=round(time.perf_counter() - t0, 3))
    return compiled


def run_training(cfg: Config, env: LaunchEnv, events: EventLog) -> int:
    """Train on an initialized JAX runtime; returns the process exit status."""
    is_main = env.rank == 0
    run_dir = cfg.run.dir
    task = make_task(cfg)
    task.prepare(is_main)
    if env.size > 1:
        multihost_utils.sync_global_devices("spmd:task-prepared")
    rt = build_runtime(cfg, build_mesh(cfg.mesh, jax.devices(), env.node_of_rank), task)
    mesh_desc = {k: v for k, v in rt.mesh.shape.items() if v > 1}
    log.info("mesh %s over %d devices, %d processes; params %s B total, %s B per device",
             mesh_desc or "(all axes 1)", rt.mesh.size, env.size,
             f"{rt.model.report.total_bytes:,}", f"{rt.model.report.bytes_per_device:,}")

    ckpt = make_checkpointer(cfg, env, events)
    restored = ckpt.restore(rt.state.abstract)
    if restored is not None:
        state, start = restored.state, restored.step
        events.emit("restored", step=start, source=restored.source, detail=restored.detail)
    else:
        state, start = rt.init(), 0
        events.emit("initialized", step=0)

    watcher = PreemptionWatcher.install(halt_file=run_dir / HALT_FILE_NAME,
                                        timeout_s=cfg.launch.barrier_timeout_s, env=env)
    end_time = job_end_time(env, os.environ)
    if end_time is not None:
        watcher.deadline = end_time - cfg.launch.walltime_margin_s
        log.info("allocation ends at %s; stopping %ss before", time.ctime(end_time),
                 cfg.launch.walltime_margin_s)

    metrics_log = JsonlWriter(run_dir / "metrics.jsonl", enabled=is_main)
    total = cfg.train.steps
    progress = Progress(total, start, enabled=is_main and cfg.run.progress)
    source = rt.task.train_source()
    batch = cfg.train.batch_size
    units = rt.task.tokens_per_example()

    def run_eval(done: int, params) -> None:
        """Evaluate the params after `done` updates (eval records' `step` counts updates)."""
        sample_path = run_dir / "eval_sample.npz" if is_main else None
        record = {"step": done, **evaluate(rt, params, sample_path)}
        metrics_log.write(record)
        events.emit("evaluated", **record)

    try:
        if rt.eval_step is not None and start == 0:
            run_eval(0, state["params"])  # the baseline every later evaluation is compared with
        train_step = compile_train_step(rt, events)
        last_time, last_step = time.perf_counter(), start
        for step in range(start, total):
            state, metrics = train_step(state, rt.feed.global_batch(source, step))
            done = step + 1
            if done % cfg.run.log_every == 0 or done == total:
                values = jax.device_get(metrics)
                now = time.perf_counter()
                step_time = (now - last_time) / (done - last_step)
                last_time, last_step = now, done
                record = {"step": step, "loss": float(values["loss"]), "step_time_s": step_time,
                          "samples_per_s": batch / step_time}
                if units > 1:
                    record["tokens_per_s"] = batch * units / step_time
                record.update({k: float(v) for k, v in values.items() if k != "loss"})
                if not np.isfinite(record["loss"]):
                    events.emit("nonfinite_loss", step=step, loss=str(record["loss"]))
                metrics_log.write(record)
                progress.update(done, record["loss"], record["samples_per_s"],
                                step_time * (total - done))
            if rt.eval_step is not None and (done % cfg.train.eval_every == 0 or done == total):
                run_eval(done, state["params"])
                last_time = time.perf_counter()  # evaluation is not step time
            ckpt.maybe_save(done, state)
            if watcher.should_stop(done):
                ckpt.maybe_save(done, state, force=True)
                ckpt.close()
                events.emit("preempted", step=done, reason=watcher.reason,
                            exit_code=PREEMPTED_EXIT_CODE)
                return PREEMPTED_EXIT_CODE
        ckpt.maybe_save(total, state, force=True)
        ckpt.close()
        events.emit("finished", step=total)
        if is_main and cfg.run.plots:
            metrics_log.close()
            from spmd.plots import make_plots

            events.emit("plotted", files=[p.name for p in make_plots(run_dir)])
        return 0
    finally:
        progress.close()
        metrics_log.close()


def train(cfg: Config, debug: bool = False) -> int:
    """`spmd train`: bootstrap this rank, train, and shut the distributed runtime down."""
    env = bootstrap(init_timeout_s=cfg.launch.init_timeout_s,
                    heartbeat_timeout_s=cfg.launch.heartbeat_timeout_s)
    run_dir = Path(cfg.run.dir)
    lease, events = None, None
    try:
        # One writer per run.dir: rank 0 leases it before writing there; refused -> all exit 2.
        lease = RunLease.acquire(run_dir, env, cfg.run.lease_stale_s,
                                 cfg.launch.barrier_timeout_s)
        run_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(run_dir, env.rank, debug)
        if env.rank == 0:
            (run_dir / "config.yaml").write_text(cfg.to_yaml())
        events = EventLog(run_dir / "events.jsonl", env.rank)
        events.emit("started", launcher=env.launcher, size=env.size, node=env.node_id,
                    restart_count=env.restart_count, job_id=env.job_id)
        lease.start(events)  # logs acquire / take-over; heartbeat thread while training
        return run_training(cfg, env, events)
    finally:
        if env.size > 1:
            shutdown()  # jax.distributed.shutdown, after disarming the peer watchdog
        if lease is not None:
            lease.release()  # clean finish, preemption (75) or error: all ranks are done
        if events is not None:
            events.close()
