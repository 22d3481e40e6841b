"""Pipeline bubble on 8 CPU devices: step time for M = 1, 2, 4, 8 microbatches vs the model,
and the compiled temporary bytes (peak activations) of GPipe vs 1F1B.

    python benchmarks/pipeline_bubble.py             # stage=4 x data=2, 8 layers, M = 1 2 4 8
    python benchmarks/pipeline_bubble.py --short     # CI: M = 1 2, 2 timed steps

The model. Stages run in lockstep ticks; a GPipe forward (or backward) is M + S - 1 ticks,
each costing the work of one microbatch (B / M rows) on one stage, so the step time is
t(M) = a (M + S - 1) / M + c, with c the work outside the stack (embedding, loss, optimizer).
With c small, t(M) / t(1) = (M + S - 1) / (M S), and the bubble fraction measured from the
times is 1 - (t_ideal / t(M)) with t_ideal = t(1) / S (all S stages busy all the time).
In this implementation the bubble ticks are not idle: every stage computes every tick (on
zeros or stale slots whose results are discarded), so on CPU, where the 8 devices share
the cores, the bubble shows as wasted compute rather than waiting; the same formula holds.

Memory: `temp_size_in_bytes` of the compiled step (activations, gradients, scratch) for
GPipe (autodiff keeps every tick's residuals) and 1F1B (a ring of <= 2S - 1 stage inputs,
layers recomputed in the backward), per M.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import json_line, machine, table  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "transformer_tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (after 1 warm-up)")
    p.add_argument("--short", action="store_true", help="CI mode: M = 1, 2; 2 timed steps")
    args = p.parse_args(argv)
    if args.short:
        args.microbatches, args.steps, args.layers, args.d_model = "1,2", 2, 4, 64

    import jax

    from spmd.config import load_config
    from spmd.mesh import build_mesh
    from spmd.runtime import build_runtime
    from spmd.sharding.pipeline import bubble_fraction

    s, d = args.stages, args.d_model
    data = jax.device_count() // s
    base = [f"model.num_layers={args.layers}", f"model.d_model={d}", "model.num_heads=4",
            f"model.d_ff={4 * d}", f"model.seq_len={args.seq}", "model.vocab_size=256",
            "model.attention=xla", f"train.batch_size={args.batch}", "mesh.strategy=pp",
            f"mesh.axes.stage={s}", f"mesh.axes.data={data}", "train.donate=false"]
    results = []
    for m in (int(x) for x in args.microbatches.split(",")):
        for schedule in ("gpipe", "1f1b"):
            cfg = load_config(CONFIG, [*base, f"train.microbatches={m}",
                                       f"train.pipeline_schedule={schedule}"])
            rt = build_runtime(cfg, build_mesh(cfg.mesh, jax.devices()))
            compiled, _ = rt.compile_train_step()
            temp = int(compiled.memory_analysis().temp_size_in_bytes)
            state = rt.init()
            batch = rt.feed.global_batch(rt.task.train_source(), 0)
            jax.block_until_ready(compiled(state, batch))       # warm-up
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(compiled(state, batch))
                times.append(time.perf_counter() - start)
            results.append({"microbatches": m, "schedule": schedule, "temp_bytes": temp,
                            "step_s": statistics.median(times), "step_s_all": times,
                            "bubble_model": bubble_fraction(s, m)})
            print({k: v for k, v in results[-1].items() if k != "step_s_all"}, flush=True)
    for schedule in ("gpipe", "1f1b"):
        rows = [r for r in results if r["schedule"] == schedule]
        t1 = next((r["step_s"] for r in rows if r["microbatches"] == 1), None)
        for r in rows:
            if t1:
                r["time_ratio_measured"] = r["step_s"] / t1
                r["time_ratio_model"] = (r["microbatches"] + s - 1) / (r["microbatches"] * s)
                r["bubble_measured"] = 1 - (t1 / s) / r["step_s"]
            spread = (max(r["step_s_all"]) - min(r["step_s_all"])) / r["step_s"]
            r["spread"] = spread
    head = ("schedule", "M", "step ms (median)", "spread", "t(M)/t(1)", "model", "bubble meas.",
            "bubble model", "temp bytes")
    rows = [head] + [(r["schedule"], str(r["microbatches"]), f"{1e3 * r['step_s']:.1f}",
                      f"{r['spread']:.0%}", f"{r.get('time_ratio_measured', 0):.3f}",
                      f"{r.get('time_ratio_model', 0):.3f}", f"{r.get('bubble_measured', 0):.3f}",
                      f"{r['bubble_model']:.3f}", f"{r['temp_bytes']:,}") for r in results]
    print(table(rows))
    print(json_line({"benchmark": "pipeline_bubble", "mode": "short" if args.short else "full",
                     "stages": s, "data": data, "layers": args.layers, "d_model": d,
                     "seq_len": args.seq, "batch_size": args.batch, "results": results,
                     "backend": jax.default_backend(), "machine": machine()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
