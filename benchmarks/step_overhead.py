"""spmd's train step against a hand-written `jax.jit` step: same model, shardings, donation.

    python benchmarks/step_overhead.py            # full run: table, JSON line, PASS/FAIL
    python benchmarks/step_overhead.py --short    # CI smoke test: seconds, never fails on timing
    python benchmarks/step_overhead.py --cases tensorboard   # the TensorBoard tracker's cost
    python benchmarks/step_overhead.py --cases stragglers    # straggler gather + finite checks
    python benchmarks/step_overhead.py --cases recipe        # grad accumulation + EMA + clipping

Two cases: a dispatch-bound tiny transformer (reported as microseconds added per
step) and a compute-bound one (>= 20 ms per step here; target: median ratio <= 1.03).
The baseline is plain JAX: functions over a params pytree, optax, `NamedSharding`
in/out shardings built by hand and `donate_argnums`. Both steps start from the same
parameter values (the baseline's first loss must equal spmd's), are fed the same
device-resident batch, and are timed in interleaved repetitions (AB, BA, ...) of K
steps each, blocking on the results at the end of every repetition.

`--cases recipe` (run_recipe_case): spmd's step with a training recipe (train.grad_accum=4
microbatches accumulated in float32 by a scan, train.ema_decay=0.999, gradient clipping in
the optimizer chain) against the same recipe hand-written in plain JAX + optax (the same
`rt.tx`, a hand-written scan over microbatches, a hand-written EMA), compute-bound model at
batch 64; target: median paired ratio <= 1.03.

`--cases stragglers` (run_stragglers_case): the training loop's step, its metrics hook
logging every step (run.log_every=1: a straggler check at every step, the worst case), with
(on) the straggler monitor (spmd.loop.stragglers: `arrive`, its gather, `depart`) and the
non-finite checks (the `isfinite` of loss and gradient norm inside the jitted step, and
`NonfiniteHook`) against (off) neither. There is no switch that turns the finite checks off
(`train.nonfinite` is `stop` or `skip`), so "off" is the same jitted step function with its
`nonfinite` output dropped (XLA removes the checks' `is-finite` ops: the benchmark checks
that the compiled HLO of "off" has fewer) and no NonfiniteHook. One process has no peer to
gather from, so the monitor's group gathers over a one-rank MPI communicator (MPI_COMM_SELF)
through the same non-blocking, polled allgather that a job's ranks use
(spmd.launch.mpi.allgather_str); over many ranks an allgather of 512 B per rank every
run.log_every steps adds the network's latency on top, once per check. The monitor's own
cost per step is also timed alone (`monitor_us_per_step`: arrive + gather + depart, 2,000
steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))   # spmd without `pip install`
from common import (  # noqa: E402
    Stats,
    add_record_option,
    emit,
    interleaved,
    machine,
    median_ci,
    paired_differences,
    paired_ratios,
    table,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "transformer_tiny.yaml"
TARGET_RATIO = 1.03

TINY = ["model.num_layers=1", "model.d_model=16", "model.num_heads=2", "model.d_ff=32",
        "model.seq_len=8", "model.vocab_size=32", "train.batch_size=8"]
COMPUTE = ["model.num_layers=2", "model.d_model=128", "model.num_heads=8", "model.d_ff=512",
           "model.seq_len=64", "model.vocab_size=512", "train.batch_size=32"]
# name -> (model overrides, devices (0 = --devices), steps per rep, reps full, reps short)
CASES = {
    "dispatch-1dev": (TINY, 1, 20, 200, 5),
    "dispatch": (TINY, 0, 10, 100, 3),
    "compute": (COMPUTE, 0, 1, 100, 2),
}
SHORT_CASES = ("dispatch-1dev", "compute")
# The TensorBoard tracker against trackers off: spmd's step plus its metrics hook, logging
# every step (run.log_every=1, the worst case), compute-bound model (full), the tiny one on
# 1 device (--short); target <= 1.01.
# (name, model overrides, devices (0 = --devices), steps per rep, reps full, reps short)
TRACKER_CASE = ("tensorboard", COMPUTE, 0, 5, 60, 3)
TRACKER_SHORT = (TINY, 1, 5)   # --short: model, devices, steps per rep
TRACKER_TARGET = 1.01
# The straggler monitor + the non-finite checks against both off, every step logged and
# checked; compute-bound model (full), the tiny one on 1 device (--short); target <= 1.01.
# (name, model overrides, devices (0 = --devices), steps per rep, reps full, reps short)
STRAGGLER_CASE = ("stragglers", COMPUTE, 0, 5, 60, 3)
STRAGGLER_SHORT = (TINY, 1, 5)   # --short: model, devices, steps per rep
STRAGGLER_TARGET = 1.01
# spmd's step with a training recipe (train.grad_accum=4, train.ema_decay, gradient clipping)
# against the same recipe hand-written in plain JAX/optax; compute-bound model, batch 64
# (full), the tiny one on 1 device (--short); target <= 1.03 (TARGET_RATIO).
# (name, model overrides, devices (0 = --devices), steps per rep, reps full, reps short)
RECIPE = ["train.grad_accum=4", "train.ema_decay=0.999"]
RECIPE_CASE = ("recipe", [*COMPUTE, "train.batch_size=64"], 0, 2, 60, 3)
RECIPE_SHORT = (TINY, 1, 2)   # --short: model, devices, steps per rep


# ------------------------------------------------------------------ plain-JAX baseline


def baseline_program(cfg, mesh_devices, strategy: str, *, tx=None, grad_accum: int = 1,
                     ema_decay: float | None = None):
    """The hand-written step: plain functions on a params pytree, optax, explicit shardings.

    With `grad_accum` K > 1 or `ema_decay` (the recipe case): the step takes and returns an
    EMA too, `(params, opt_state, ema, batch) -> (params, opt_state, ema, metrics)`, and
    accumulates float32 gradients over K microbatches with a hand-written `lax.scan`
    (microbatch j: rows j, j + K, ... of every device's own rows). `tx`: the optax
    transformation to use (default: spmd's default recipe built here from the config)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    m, o, w = cfg.model, cfg.optimizer, cfg.schedule.warmup_steps
    dtype = jnp.dtype(m.dtype)
    axis = {"dp": "data", "fsdp": "fsdp"}[strategy]
    mesh = jax.make_mesh((len(mesh_devices),), (axis,), axis_types=(AxisType.Auto,),
                         devices=mesh_devices)
    embed = axis if strategy == "fsdp" else None   # FSDP shards every `embed` dimension

    def spec_of(path: str) -> P:
        leaf = path.rsplit("/", 1)[-1]
        specs = {
            "embedding": P(None, embed), "w_out": P(embed, None), "scale": P(embed),
            "wq": P(embed), "wk": P(embed), "wv": P(embed), "wo": P(None, None, embed),
            "w_up": P(embed, None), "w_down": P(None, embed),
        }
        return specs[leaf]

    def rms_norm(x, scale, eps=1e-6):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (normed * scale).astype(x.dtype)

    def rope(x, base=10_000.0):
        half = x.shape[-1] // 2
        freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
        angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
        sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
        x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)

    def attention(layer, x):
        xc = x.astype(dtype)
        q, k, v = (jnp.einsum("ble,ehd->blhd", xc, layer[w].astype(dtype))
                   for w in ("wq", "wk", "wv"))
        q, k = rope(q), rope(k)
        context = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.einsum("blhd,hde->ble", context, layer["wo"].astype(dtype))

    def mlp(layer, x):
        h = jax.nn.gelu(jnp.einsum("...i,io->...o", x.astype(dtype), layer["w_up"].astype(dtype)))
        return jnp.einsum("...i,io->...o", h.astype(dtype), layer["w_down"].astype(dtype))

    act = NamedSharding(mesh, P(axis, None, None))

    def forward(params, tokens):
        x = jax.lax.with_sharding_constraint(jnp.take(params["embedding"], tokens, axis=0), act)
        for layer in params["layers"]:
            x = x + attention(layer, rms_norm(x, layer["ln1"]["scale"])).astype(x.dtype)
            x = x + mlp(layer, rms_norm(x, layer["ln2"]["scale"])).astype(x.dtype)
            x = jax.lax.with_sharding_constraint(x, act)
        x = rms_norm(x, params["ln_f"]["scale"])
        return jnp.einsum("...i,io->...o", x.astype(dtype), params["w_out"].astype(dtype))

    def loss_fn(params, batch):
        logits = forward(params, batch["inputs"]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == batch["targets"])

    # spmd's default recipe (adamw, constant schedule with warm-up; the configs benchmarked
    # set no weight decay, so no mask)
    if tx is None:
        schedule = (optax.linear_schedule(0.0, o.lr, w) if w else optax.constant_schedule(o.lr))
        parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip else []
        tx = optax.chain(*parts, optax.adamw(schedule, weight_decay=o.weight_decay))

    def train_step(params, opt_state, batch):
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "accuracy": accuracy}
        return params, opt_state, metrics

    if grad_accum == 1 and ema_decay is None:
        return mesh, spec_of, tx, train_step

    k, decay = grad_accum, ema_decay if ema_decay is not None else 0.0
    micro_sharding = NamedSharding(mesh, P(None, axis, None))

    def recipe_step(params, opt_state, ema, batch):
        micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), micro_sharding),
            batch)

        def body(acc, mb):
            (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), (
                loss, accuracy)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        acc, (losses, accuracies) = jax.lax.scan(body, zeros, micro)
        grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)
        metrics = {"loss": losses.mean(), "grad_norm": optax.global_norm(grads),
                   "accuracy": accuracies.mean()}
        return params, opt_state, ema, metrics

    return mesh, spec_of, tx, recipe_step


def to_baseline_params(p: dict) -> dict:
    """spmd's params dict -> the baseline's own layout (same arrays, renamed)."""
    blocks = p["blocks"]
    return {
        "embedding": p["embedding"],
        "layers": [
            {"ln1": {"scale": b["attn_norm"]["scale"]}, "wq": b["attn"]["query"],
             "wk": b["attn"]["key"], "wv": b["attn"]["value"], "wo": b["attn"]["out"],
             "ln2": {"scale": b["mlp_norm"]["scale"]}, "w_up": b["mlp"]["up"]["kernel"],
             "w_down": b["mlp"]["down"]["kernel"]}
            for _, b in sorted(blocks.items())
        ],
        "ln_f": {"scale": p["final_norm"]["scale"]},
        "w_out": p["unembed"]["kernel"],
    }


def build_pair(overrides: list[str], strategy: str, num_devices: int):
    """(spmd step, spmd state, baseline step, baseline state, batch, config)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime

    # The baseline is the unrolled program with XLA attention: pin spmd to the same.
    cfg = load_config(CONFIG, [f"mesh.strategy={strategy}", "model.scan_layers=false",
                               "model.attention=xla", *overrides])
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()[:num_devices]),
                       build_task(cfg))
    batch = rt.feed.global_batch(rt.task.train_source(), 0)   # device-resident, reused
    spmd_state = rt.init()

    mesh, spec_of, tx, step_fn = baseline_program(cfg, list(rt.mesh.devices.flat), strategy)
    params = to_baseline_params(spmd_state.params)
    param_shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, spec_of(jax.tree_util.keystr(path, simple=True,
                                                                         separator="/"))),
        params)
    # The baseline's hand-written shardings must be spmd's, leaf for leaf.
    spmd_shardings = to_baseline_params(rt.state.shardings.params)
    for (path, mine), theirs, leaf in zip(jax.tree_util.tree_leaves_with_path(param_shardings),
                                          jax.tree.leaves(spmd_shardings), jax.tree.leaves(params)):
        if not mine.is_equivalent_to(theirs, leaf.ndim):
            raise AssertionError(f"baseline sharding {mine.spec} != spmd {theirs.spec} at {path}")
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
        transform_non_params=lambda _: replicated)
    batch_sharding = NamedSharding(mesh, P(mesh.axis_names[0], None))
    plain = jax.jit(
        step_fn,
        in_shardings=(param_shardings, opt_shardings, batch_sharding),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    )
    # The baseline's own buffers holding the same values (spmd's get donated).
    params = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), params, param_shardings)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

    # Same start, same first loss: the two programs compute the same thing.
    spmd_state, spmd_metrics = rt.train_step(spmd_state, batch)
    params, opt_state, plain_metrics = plain(params, opt_state, batch)
    a, b = float(spmd_metrics["loss"]), float(plain_metrics["loss"])
    if not np.isclose(a, b, rtol=1e-5):
        raise AssertionError(f"first losses differ: spmd {a} vs plain JAX {b}")
    return rt, spmd_state, plain, (params, opt_state), batch, cfg


def run_case(name: str, overrides: list[str], num_devices: int, steps: int, reps: int,
             strategy: str) -> dict:
    import jax

    from spmd.aot.plan import compiled_flops

    rt, spmd_state, plain, plain_state, batch, cfg = build_pair(overrides, strategy, num_devices)
    # The two compiled programs, side by side (cached: both steps have already run).
    programs = {}
    for key, compiled in (("spmd", rt.train_step.lower(spmd_state, batch).compile()),
                          ("plain", plain.lower(*plain_state, batch).compile())):
        programs[key] = {"xla_flops": compiled_flops(compiled),
                         "hlo_lines": compiled.as_text().count("\n")}
    box = {"spmd": spmd_state, "plain": plain_state}

    def run_spmd() -> None:
        state = box["spmd"]
        for _ in range(steps):
            state, metrics = rt.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        box["spmd"] = state

    def run_plain() -> None:
        params, opt_state = box["plain"]
        for _ in range(steps):
            params, opt_state, metrics = plain(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, metrics))
        box["plain"] = (params, opt_state)

    times = interleaved({"spmd": run_spmd, "plain": run_plain}, reps=reps, warmup=1)
    per_step = {k: [x / steps for x in v] for k, v in times.items()}
    spmd_s, plain_s = Stats.of(per_step["spmd"]), Stats.of(per_step["plain"])
    ratio_values = paired_ratios(per_step["spmd"], per_step["plain"])
    ratios = Stats.of(ratio_values)
    diffs_us = Stats.of(paired_differences(per_step["spmd"], per_step["plain"])).scaled(1e6)
    m = cfg.model
    return {
        "case": name,
        "model": f"L={m.num_layers} d={m.d_model} ff={m.d_ff} T={m.seq_len} V={m.vocab_size} "
                 f"B={cfg.train.batch_size}",
        "strategy": strategy, "devices": rt.mesh.size, "steps_per_rep": steps, "reps": reps,
        "spmd_ms": spmd_s.scaled(1e3).as_dict(4), "plain_ms": plain_s.scaled(1e3).as_dict(4),
        "ratio_of_medians": round(spmd_s.median / plain_s.median, 4),
        "paired_ratio": ratios.as_dict(4),
        "paired_ratio_ci95": [round(x, 4) for x in median_ci(ratio_values)],
        "added_us": diffs_us.as_dict(1),
        "programs": programs,
    }


def run_tracker_case(overrides: list[str], num_devices: int, steps: int, reps: int) -> dict:
    """spmd's step + MetricsHook with run.trackers=[tensorboard] vs [] (interleaved reps)."""
    import tempfile

    import jax

    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime
    from spmd.loop.builtin_hooks import MetricsHook, StepClock
    from spmd.loop.hooks import StepInfo
    from spmd.rundir.metrics import EventLog

    cfg = load_config(CONFIG, ["run.progress=false", "run.log_every=1", *overrides])
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()[:num_devices]),
                       build_task(cfg))
    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    root = Path(tempfile.mkdtemp(prefix="spmd-tracker-bench-"))
    box, runners, hooks = {}, {}, []
    for key, trackers in (("off", []), ("tensorboard", ["tensorboard"])):
        run_dir = root / key
        run_dir.mkdir()
        run = cfg.run.model_copy(update={"dir": run_dir, "trackers": trackers})
        hook = MetricsHook(rt, run_dir, EventLog(run_dir / "events.jsonl", 0), True,
                           StepClock(0), cfg.model_copy(update={"run": run}))
        hook.start(StepInfo(step=0, state=None, metrics={}))
        hooks.append(hook)
        box[key] = (rt.init(), 0)

        def runner(key: str = key, hook: MetricsHook = hook) -> None:
            state, step = box[key]
            for _ in range(steps):
                state, metrics = rt.train_step(state, batch)
                step += 1
                hook(StepInfo(step=step, state=state, metrics=metrics))
            jax.block_until_ready(state)
            box[key] = (state, step)

        runners[key] = runner
    times = interleaved(runners, reps=reps, warmup=1)
    for hook in hooks:
        hook.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tensorboard" / "tensorboard"))
    acc.Reload()
    logged = len(acc.Scalars("loss"))
    files = {key: len(list((root / key).rglob("events.out.tfevents.*")))
             for key in ("off", "tensorboard")}
    return {**paired_result("tensorboard", "tensorboard", times, steps, reps, rt, cfg),
            "scalars_logged_per_tag": logged, "event_files": files}


def paired_result(case: str, on: str, times: dict, steps: int, reps: int, rt, cfg) -> dict:
    """A case's record: per-step times of `on` and "off" (ms), their paired ratio with its
    95% CI, and the time `on` adds (us), from `interleaved`'s per-repetition times."""
    per_step = {k: [x / steps for x in v] for k, v in times.items()}
    ratio_values = paired_ratios(per_step[on], per_step["off"])
    m = cfg.model
    return {
        "case": case, "devices": rt.mesh.size, "steps_per_rep": steps, "reps": reps,
        "model": f"L={m.num_layers} d={m.d_model} ff={m.d_ff} T={m.seq_len} V={m.vocab_size} "
                 f"B={cfg.train.batch_size}",
        "off_ms": Stats.of(per_step["off"]).scaled(1e3).as_dict(4),
        f"{on}_ms": Stats.of(per_step[on]).scaled(1e3).as_dict(4),
        "paired_ratio": Stats.of(ratio_values).as_dict(4),
        "paired_ratio_ci95": [round(x, 4) for x in median_ci(ratio_values)],
        "added_us": Stats.of(paired_differences(per_step[on], per_step["off"]))
        .scaled(1e6).as_dict(1),
    }


class _SelfGroup:
    """A one-rank group that still runs MPI's polled allgather (MPI_COMM_SELF)."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_SELF

    def allgather_str(self, text: str, what: str) -> list[str]:
        from spmd.launch import mpi

        return mpi.allgather_str(self.comm, text, 60.0, "benchmark rank 0", what)


def run_stragglers_case(overrides: list[str], num_devices: int, steps: int,
                        reps: int) -> dict:
    """The loop's step + metrics hook, with (on) the straggler monitor and the non-finite
    checks or (off) neither, in interleaved repetitions (module docstring)."""
    import socket
    import tempfile

    import jax

    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime
    from spmd.engine.state import replicated
    from spmd.loop.builtin_hooks import MetricsHook, NonfiniteHook, StepClock
    from spmd.loop.hooks import StepInfo
    from spmd.loop.stragglers import StragglerMonitor
    from spmd.rundir.metrics import EventLog

    cfg = load_config(CONFIG, ["run.progress=false", "run.log_every=1", *overrides])
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()[:num_devices]),
                       build_task(cfg))
    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    inner = rt.train_step.__wrapped__          # spmd's step function, before jax.jit

    def without_finite_checks(state, batch):
        state, metrics = inner(state, batch)
        return state, {k: v for k, v in metrics.items() if k != "nonfinite"}

    steps_of = {
        "on": rt.train_step,
        "off": jax.jit(without_finite_checks,
                       in_shardings=(rt.state.shardings, dict(rt.feed.shardings)),
                       out_shardings=(rt.state.shardings, replicated(rt.mesh)),
                       donate_argnums=(0,) if cfg.train.donate else ()),
    }
    is_finite_ops = {k: f.lower(rt.state.abstract, rt.abstract_batch()).compile().as_text()
                     .count("is-finite(") for k, f in steps_of.items()}
    # The model's own ops may use is-finite (the logsumexp of the loss does); the checks add
    # theirs (loss and gradient norm) on top.
    if not is_finite_ops["on"] > is_finite_ops["off"]:
        raise AssertionError(f"is-finite ops on/off: {is_finite_ops}; the checks add none")
    try:
        group, channel = _SelfGroup(), "mpi (MPI_COMM_SELF)"
    except ImportError:
        group, channel = None, "none (mpi4py missing)"
    root = Path(tempfile.mkdtemp(prefix="spmd-straggler-bench-"))
    box, runners, closers = {}, {}, []
    for key in ("off", "on"):
        run_dir = root / key
        run_dir.mkdir()
        run = cfg.run.model_copy(update={"dir": run_dir, "trackers": []})
        events = EventLog(run_dir / "events.jsonl", 0)
        metrics = MetricsHook(rt, run_dir, events, True, StepClock(0),
                              cfg.model_copy(update={"run": run}))
        metrics.start(StepInfo(step=0, state=None, metrics={}))
        closers.append(metrics.close)
        hooks = [metrics]
        if key == "on":
            monitor = StragglerMonitor(group, 0, socket.gethostname(), 1,
                                       cfg.launch.straggler_factor, events, True)
            nonfinite = NonfiniteHook(cfg.train, (1,), events)
            nonfinite.start(StepInfo(step=0, state=None, metrics={}))
            record = metrics.record

            def record_with_fields(r: dict, record=record, monitor=monitor) -> None:
                record({**r, **monitor.fields(r["step"])})

            metrics.record = record_with_fields
            # the loop's order: arrive first, (the preemption vote), depart, nonfinite, metrics
            hooks = [monitor.arrive, monitor.depart, nonfinite, metrics]
        box[key] = (rt.init(), 0)

        def runner(key: str = key, hooks: list = hooks) -> None:
            state, step = box[key]
            fn = steps_of[key]
            for _ in range(steps):
                state, metrics = fn(state, batch)
                step += 1
                info = StepInfo(step=step, state=state, metrics=metrics)
                for hook in hooks:
                    if hook(info) is not None:
                        raise AssertionError(f"hook {hook} stopped the benchmark at {step}")
            jax.block_until_ready(state)
            box[key] = (state, step)

        runners[key] = runner
    times = interleaved(runners, reps=reps, warmup=1)
    for close in closers:
        close()
    logged = [json.loads(line) for line in (root / "on" / "metrics.jsonl").read_text()
              .splitlines()]
    if not any("slowest_rank" in r for r in logged):
        raise AssertionError("the monitor's fields never reached metrics.jsonl")

    # The monitor alone: arrive + gather + depart per step, no training step in between.
    alone = StragglerMonitor(group, 0, socket.gethostname(), 1, cfg.launch.straggler_factor,
                             None, True)
    n = 2000
    began = time.perf_counter()
    for step in range(1, n + 1):
        info = StepInfo(step=step, state=None, metrics={})
        alone.arrive(info)
        alone.depart(info)
    monitor_us = (time.perf_counter() - began) / n * 1e6

    return {**paired_result("stragglers", "on", times, steps, reps, rt, cfg),
            "gather_channel": channel, "is_finite_ops": is_finite_ops,
            "monitor_us_per_step": round(monitor_us, 2)}


def run_recipe_case(overrides: list[str], num_devices: int, steps: int, reps: int) -> dict:
    """spmd's train step with RECIPE against the hand-written recipe step (interleaved reps).

    Both use the same optax transformation (`rt.tx`: clipping + AdamW as configured), start
    from the same parameters (the first losses must agree) and are fed the same batch; the
    baseline is `baseline_program(..., grad_accum=, ema_decay=)`, donating params, optimizer
    state and EMA.
    """
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime

    cfg = load_config(CONFIG, ["mesh.strategy=dp", "model.scan_layers=false",
                               "model.attention=xla", *overrides, *RECIPE])
    t = cfg.train
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()[:num_devices]),
                       build_task(cfg))
    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    spmd_state = rt.init()
    mesh, spec_of, tx, step_fn = baseline_program(cfg, list(rt.mesh.devices.flat), "dp",
                                                  tx=rt.tx, grad_accum=t.grad_accum,
                                                  ema_decay=t.ema_decay)
    host = to_baseline_params(jax.device_get(spmd_state.params))
    param_shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, spec_of(jax.tree_util.keystr(path, simple=True,
                                                                         separator="/"))),
        host)
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, host), param_shardings,
        transform_non_params=lambda _: replicated)
    plain = jax.jit(step_fn,
                    in_shardings=(param_shardings, opt_shardings, param_shardings,
                                  NamedSharding(mesh, P(mesh.axis_names[0], None))),
                    out_shardings=(param_shardings, opt_shardings, param_shardings, replicated),
                    donate_argnums=(0, 1, 2))
    params = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), host, param_shardings)
    ema = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), host, param_shardings)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

    spmd_state, spmd_metrics = rt.train_step(spmd_state, batch)
    params, opt_state, ema, plain_metrics = plain(params, opt_state, ema, batch)
    a, b = float(spmd_metrics["loss"]), float(plain_metrics["loss"])
    if not np.isclose(a, b, rtol=1e-5):
        raise AssertionError(f"recipe: first losses differ: spmd {a} vs hand-written {b}")
    box = {"spmd": spmd_state, "off": (params, opt_state, ema)}

    def run_spmd() -> None:
        state = box["spmd"]
        for _ in range(steps):
            state, metrics = rt.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        box["spmd"] = state

    def run_plain() -> None:
        state = box["off"]
        for _ in range(steps):
            *state, metrics = plain(*state, batch)
        jax.block_until_ready((state, metrics))
        box["off"] = tuple(state)

    times = interleaved({"spmd": run_spmd, "off": run_plain}, reps=reps, warmup=1)
    return {**paired_result("recipe", "spmd", times, steps, reps, rt, cfg),
            "recipe": {"grad_accum": t.grad_accum, "ema_decay": t.ema_decay,
                       "optimizer": "the runtime's optax chain (clipping + AdamW)"},
            "off_is": "the same recipe hand-written in plain JAX + optax"}


def paired_text(record: dict) -> str:
    """The paired on/off comparison of a `paired_result` record, as the summary lines print it:
    median ratio [IQR] (95% CI), added time per step."""
    q, (lo, hi) = record["paired_ratio"], record["paired_ratio_ci95"]
    return (f"paired ratio {q['median']:.4f} [IQR {q['q1']:.4f}-{q['q3']:.4f}] (95% CI "
            f"{lo:.4f}-{hi:.4f}), added {record['added_us']['median']:+.1f} us/step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true",
                        help="CI smoke mode: a few seconds, reports but never fails on timing")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices (default 8)")
    parser.add_argument("--strategy", choices=["dp", "fsdp"], default="dp")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per case")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated subset of {', '.join(CASES)}, tensorboard, "
                             f"stragglers, recipe (default: all; --short: "
                             f"{', '.join(SHORT_CASES)})")
    add_record_option(parser)
    args = parser.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    mode = "short" if args.short else "full"
    results = []
    names = args.cases.split(",") if args.cases else list(
        SHORT_CASES if args.short else (*CASES, TRACKER_CASE[0], STRAGGLER_CASE[0],
                                        RECIPE_CASE[0]))
    tracker = stragglers = recipe = None
    for name in names:
        if name == STRAGGLER_CASE[0]:
            _, overrides, devices, steps, reps_full, reps_short = STRAGGLER_CASE
            if args.short:
                overrides, devices, steps = STRAGGLER_SHORT
            stragglers = run_stragglers_case(
                overrides, devices or args.devices, steps,
                args.reps or (reps_short if args.short else reps_full))
            continue
        if name == RECIPE_CASE[0]:
            _, overrides, devices, steps, reps_full, reps_short = RECIPE_CASE
            if args.short:
                overrides, devices, steps = RECIPE_SHORT
            recipe = run_recipe_case(overrides, devices or args.devices, steps,
                                     args.reps or (reps_short if args.short else reps_full))
            continue
        if name == TRACKER_CASE[0]:
            _, overrides, devices, steps, reps_full, reps_short = TRACKER_CASE
            if args.short:
                overrides, devices, steps = TRACKER_SHORT
            tracker = run_tracker_case(overrides, devices or args.devices, steps,
                                       args.reps or (reps_short if args.short else reps_full))
            continue
        overrides, devices, steps, reps_full, reps_short = CASES[name]
        reps = args.reps or (reps_short if args.short else reps_full)
        results.append(run_case(name, overrides, devices or args.devices, steps, reps,
                                args.strategy))

    rows = [("case", "model", "devices", "spmd ms/step (median [IQR])", "plain ms/step",
             "ratio (paired)", "added us/step (paired)", "XLA GFLOP spmd/plain")]
    for r in results:
        s, p, q, d = r["spmd_ms"], r["plain_ms"], r["paired_ratio"], r["added_us"]
        rows.append((
            r["case"], r["model"], str(r["devices"]),
            f"{s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}]",
            f"{p['median']:.3f} [{p['q1']:.3f}-{p['q3']:.3f}]",
            f"{q['median']:.3f} [{q['q1']:.3f}-{q['q3']:.3f}]",
            f"{d['median']:+.1f} [{d['q1']:+.1f}..{d['q3']:+.1f}]",
            f"{r['programs']['spmd']['xla_flops'] / 1e9:.4f}/"
            f"{r['programs']['plain']['xla_flops'] / 1e9:.4f}",
        ))
    info = machine()
    print(f"step overhead ({mode}), strategy {args.strategy}, median per-step times over "
          f"interleaved repetitions; {info.get('cpu')}, {info.get('cores')} cores, "
          f"load {info.get('loadavg_1m')}")
    if len(rows) > 1:
        print(table(rows))
    if tracker is not None:
        t, q = tracker, tracker["paired_ratio"]
        t["verdict"] = None if args.short else (
            "PASS" if q["median"] <= TRACKER_TARGET else "FAIL")
        print(f"TensorBoard tracker ({t['model']}, {t['devices']} devices, every step logged): "
              f"off {t['off_ms']['median']:.3f} ms/step, tensorboard "
              f"{t['tensorboard_ms']['median']:.3f} ms/step; {paired_text(t)}: "
              f"{t['verdict'] or 'short mode, no target checked'} vs target <= "
              f"{TRACKER_TARGET}")
        results.append(tracker)
    if recipe is not None:
        t, q = recipe, recipe["paired_ratio"]
        t["verdict"] = None if args.short else (
            "PASS" if q["median"] <= TARGET_RATIO else "FAIL")
        print(f"recipe (grad_accum={t['recipe']['grad_accum']}, ema_decay="
              f"{t['recipe']['ema_decay']}, clipping; {t['model']}, {t['devices']} devices): "
              f"hand-written {t['off_ms']['median']:.3f} ms/step, spmd "
              f"{t['spmd_ms']['median']:.3f} ms/step; {paired_text(t)}: "
              f"{t['verdict'] or 'short mode, no target checked'} vs target <= {TARGET_RATIO}")
        results.append(recipe)
    if stragglers is not None:
        t, q = stragglers, stragglers["paired_ratio"]
        t["verdict"] = None if args.short else (
            "PASS" if q["median"] <= STRAGGLER_TARGET else "FAIL")
        print(f"straggler monitor + finite checks ({t['model']}, {t['devices']} devices, "
              f"checked every step, gather over {t['gather_channel']}): off "
              f"{t['off_ms']['median']:.3f} ms/step, on {t['on_ms']['median']:.3f} ms/step; "
              f"{paired_text(t)}; the monitor alone {t['monitor_us_per_step']:.1f} us/step: "
              f"{t['verdict'] or 'short mode, no target checked'} vs target <= "
              f"{STRAGGLER_TARGET}")
        results.append(stragglers)
    verdict = None
    compute = next((r for r in results if r["case"] == "compute"), None)
    if compute is not None:
        slow = compute["spmd_ms"]["median"]
        if not args.short:
            ratio = compute["paired_ratio"]["median"]
            lo, hi = compute["paired_ratio_ci95"]
            verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
            note = "" if slow >= 20 else f"; but the step is only {slow:.1f} ms, below 20 ms"
            if lo <= TARGET_RATIO < hi:
                note += "; the 95% CI straddles the target: too noisy to be sure, rerun idle"
            print(f"{verdict}: compute-bound median paired ratio {ratio:.3f} (95% CI "
                  f"{lo:.3f}-{hi:.3f}) vs target <= {TARGET_RATIO}{note}")
        else:
            print("short mode: timings are a smoke test, no target is checked")
    emit({"benchmark": "step_overhead", "mode": mode, "strategy": args.strategy,
          "verdict": verdict, "target_ratio": TARGET_RATIO, "machine": info,
          "results": results}, args)
    failed = verdict == "FAIL" or (recipe is not None and recipe["verdict"] == "FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
