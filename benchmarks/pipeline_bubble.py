"""Pipeline bubble on 8 CPU devices: step time for M = 1, 2, 4, 8 microbatches against the
bubble model, and the compiled temporary bytes (peak activations) of GPipe vs 1F1B.

    python benchmarks/pipeline_bubble.py           # stage=4 x data=2, 8 layers, M = 1 2 4 8
    python benchmarks/pipeline_bubble.py --short   # CI: M = 1 2, one round
    python benchmarks/pipeline_bubble.py --repeats 2 --microbatches 4,8,12,16  # + circular

Method. The microbatch size is fixed (`--microbatch` rows; train.batch_size = M x rows) and
M varies, so every tick costs the same and a step costs t(M) = tau (M + k): M microbatches
of work plus k microbatches' worth of bubble. Every stage computes every tick (lockstep
SPMD; bubble slots compute on zeros), so on CPU, where the 8 devices share the cores, the
bubble is wasted compute and shows in the wall time. The model is k = S - 1 for both
schedules, the textbook bubble (S - 1) / (M + S - 1) (`sharding/pipeline.bubble_fraction`):
GPipe runs M + S - 1 forward and backward ticks, 1F1B skips its warm-up's backward and its
cool-down's forward slots (`sharding/one_f_one_b`). With `--repeats R` a circular gpipe
(`train.pipeline_repeats=R`: each microbatch goes round the stages R times through chunks
of L/(S R) layers) is timed too: its fill and drain are S - 1 chunk ticks of tau / R, so
k = (S - 1) / R and the bubble (S - 1) / (R M + S - 1).
A least-squares line through the measured t(M) gives tau (slope) and k_measured =
intercept / slope; the measured bubble at M is 1 - M tau / t(M), the model's k / (M + k).
Work outside the stack (embedding, loss, optimizer) is small at these sizes and is counted
as useful (slope) or bubble (intercept) as it falls.

Recompute: 1F1B's tau is larger than GPipe's, because the loss is outside the stack and
its schedule runs a stage forward three times per microbatch (primal, stash, inside the
VJP): tau_1f1b / tau_gpipe = (3 + b) / (1 + b) in the model, with b = a stage's backward /
forward FLOPs, read here from XLA's cost analysis of the unrolled model.

Timing: every case is compiled first; then `--rounds` rounds run every case `--steps`
times in turn (alternating the order), so load that drifts during the run touches every
case alike. A case's time is the median of its steps; its noise the IQR / median.

Memory: `temp_size_in_bytes` of each compiled step. At a fixed microbatch size GPipe's
grows with M by every tick's residuals (autodiff keeps them all); 1F1B's grows only by the
batch-sized buffers every step has and its ring of min(M, 2S - 1) stage inputs per stage
(layers recomputed in the backward), so it stops growing per tick once M >= 2S - 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import Stats, add_record_option, emit, machine, table  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "transformer_tiny.yaml"
SCHEDULES = ("gpipe", "1f1b")
CIRCULAR = "gpipe-circular"      # gpipe with train.pipeline_repeats = --repeats


def backward_cost(overrides: list[str]) -> float:
    """b: FLOPs of the layer stack's backward over its forward (unrolled, one device)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spmd.aot.plan import compiled_flops
    from spmd.config.load import build_task, load_config

    cfg = load_config(CONFIG, [*overrides, "model.scan_layers=false", "mesh.strategy=dp"])
    model = build_task(cfg).build_model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((8, cfg.model.seq_len), jnp.int32)

    def forward(state):
        return nnx.merge(graphdef, state).features(tokens)

    def gradient(state):
        return jax.grad(lambda s: forward(s).astype(jnp.float32).sum())(state)

    fwd = compiled_flops(jax.jit(forward).lower(state).compile())
    grad = compiled_flops(jax.jit(gradient).lower(state).compile())
    if not fwd or grad is None:
        raise RuntimeError("XLA's cost analysis gave no FLOP count for the model")
    return (grad - fwd) / fwd


def compile_case(base: list[str], m: int, rows: int, schedule: str, repeats: int = 1,
                 reuse: tuple | None = None):
    """(a timed step, its compiled temporaries, (the state's layout, the state)). `reuse`, an
    earlier case's last item: its state when the layout is the same (the cases differ in
    the step, not in the state), so the initializer compiles once per layout."""
    import jax

    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime

    cfg = load_config(CONFIG, [*base, f"train.microbatches={m}",
                               f"train.batch_size={m * rows}",
                               f"train.pipeline_schedule={schedule}",
                               f"train.pipeline_repeats={repeats}"])
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()),
                       build_task(cfg))
    compiled, _ = rt.compile_train_step()
    leaves, tree = jax.tree.flatten(rt.state.abstract)
    layout = (tree, [(a.shape, a.dtype, a.sharding) for a in leaves])
    state = reuse[1] if reuse is not None and reuse[0] == layout else rt.init()
    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    jax.block_until_ready(compiled(state, batch))        # warm-up
    temp = int(compiled.memory_analysis().temp_size_in_bytes)

    def step() -> float:
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, batch))
        return time.perf_counter() - start

    return step, temp, (layout, state)


def fit_line(ms: list[int], ts: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of t against M."""
    n = len(ms)
    mx, my = sum(ms) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in ms)
    slope = sum((x - mx) * (y - my) for x, y in zip(ms, ts)) / sxx
    return slope, my - slope * mx


def _fmt(x: float | None) -> str:
    return "n/a (slope <= 0: noise)" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatch", type=int, default=8,
                   help="rows per microbatch (over all data-parallel ways)")
    p.add_argument("--microbatches", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per case per round")
    p.add_argument("--repeats", type=int, default=1,
                   help="also time a circular gpipe with this many repeats (M must be "
                        "multiples of --stages)")
    p.add_argument("--short", action="store_true", help="CI mode: M = 1, 2; one round")
    add_record_option(p)
    args = p.parse_args(argv)
    if args.short:
        args.microbatches, args.rounds, args.steps = "1,2", 1, 2
        args.layers, args.d_model, args.seq = 4, 32, 16

    import jax

    from spmd.sharding.pipeline import bubble_fraction

    s, d = args.stages, args.d_model
    data = jax.device_count() // s
    base = [f"model.num_layers={args.layers}", f"model.d_model={d}", "model.num_heads=4",
            f"model.d_ff={4 * d}", f"model.seq_len={args.seq}", "model.vocab_size=256",
            "model.attention=xla", "mesh.strategy=pp", f"mesh.axes.stage={s}",
            f"mesh.axes.data={data}", "train.donate=false"]
    b = backward_cost(base)
    ms = [int(x) for x in args.microbatches.split(",")]
    schedules = {name: (name, 1) for name in SCHEDULES}
    if args.repeats > 1:
        schedules[CIRCULAR] = ("gpipe", args.repeats)
    cases, reuse = {}, None
    for m in ms:
        for name in schedules:
            step, temp, reuse = compile_case(base, m, args.microbatch, *schedules[name],
                                             reuse=reuse)
            cases[(name, m)] = (step, temp)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    order = list(cases)
    for r in range(args.rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            times[key] += [cases[key][0]() for _ in range(args.steps)]

    results, fits = [], {}
    for sched, (_, repeats) in schedules.items():
        stats = {m: Stats.of(times[(sched, m)]) for m in ms}
        slope, intercept = fit_line(ms, [stats[m].median for m in ms])
        k_model = (s - 1) / repeats      # t = (tau / R) (R M + S - 1)
        ok = slope > 0       # else the timing noise is larger than the M dependence
        fits[sched] = {"tau_s": slope, "intercept_s": intercept,
                       "k_measured": intercept / slope if ok else None, "k_model": k_model}
        for m in ms:
            t = stats[m].median
            results.append({
                "schedule": sched, "microbatches": m, "batch_size": m * args.microbatch,
                "step_s": t, "noise": stats[m].iqr / t, "steps": stats[m].n,
                "bubble_measured": 1 - m * slope / t if ok else None,
                "bubble_model": bubble_fraction(s, m, repeats), "temp_bytes": cases[(sched, m)][1]})

    head = ("schedule", "M", "step ms (median)", "noise (IQR/med)", "bubble measured",
            "bubble model (S-1)/(R M+S-1)", "temp bytes")
    rows = [head] + [(r["schedule"], str(r["microbatches"]), f"{1e3 * r['step_s']:.1f}",
                      f"{r['noise']:.1%}", _fmt(r["bubble_measured"]),
                      f"{r['bubble_model']:.3f}", f"{r['temp_bytes']:,}") for r in results]
    print(table(rows))
    for sched, f in fits.items():
        print(f"{sched}: t(M) = {1e3 * f['tau_s']:.1f} ms x (M + {_fmt(f['k_measured'])}); "
              f"model k = {f['k_model']:.2f}")
    recompute = {"model": (3 + b) / (1 + b),
                 "measured": fits["1f1b"]["tau_s"] / fits["gpipe"]["tau_s"]
                 if fits["gpipe"]["tau_s"] > 0 else None}
    print(f"b (stage backward / forward FLOPs, XLA) = {b:.3f}; 1f1b recompute tau_1f1b / "
          f"tau_gpipe = {_fmt(recompute['measured'])} (model (3 + b) / (1 + b) = "
          f"{recompute['model']:.3f})")
    emit({"benchmark": "pipeline_bubble", "mode": "short" if args.short else "full",
                     "stages": s, "data": data, "layers": args.layers, "d_model": d,
                     "seq_len": args.seq, "microbatch_rows": args.microbatch,
                     "rounds": args.rounds, "steps_per_round": args.steps,
                     "backward_cost": b, "recompute": recompute, "fits": fits,
                     "results": results,
                     "backend": jax.default_backend(), "machine": machine()}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
