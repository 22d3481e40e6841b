"""Transformer LM training throughput and MFU on one GPU, in bf16.

    python benchmarks/gpu_mfu.py                 # on a GPU node; "no GPU: skipped" elsewhere
    python benchmarks/gpu_mfu.py --short         # CI: a tiny model on whatever JAX has (CPU)

The largest model of a ladder whose compiled step fits the GPU (XLA's own memory
analysis of the compiled step, against the device's allocator limit) is trained for
a few steps on one device-resident synthetic batch. MFU = model FLOPs per second /
peak, with model FLOPs from the PaLM formula (6 N per token plus causal attention
12 L d T / 2 per token: `LanguageModelTask.flops_per_example`) and the dense bf16
peak of the device (989 TFLOP/s for H100 SXM and H200). Target: MFU >= 50%.

The GPU XLA flags and environment of spmd's system profiles (`spmd.hpc.systems`) are
applied before JAX starts; `--system NAME` takes them from that profile instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the checkout last: an installed spmd comes first (a GPU node's `pip install --target`,
# benchmarks/gpu_wheels.sh), whose spmd.launch a checkout's spmd/ would hide
sys.path.append(str(Path(__file__).resolve().parents[1]))
from common import Stats, add_record_option, emit, machine, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "transformer_tiny.yaml"
TARGET_MFU = 0.50
# Dense bf16 peak FLOP/s by device kind (substring match, first wins).
PEAKS = (("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("A100", 312e12),
         ("MI300", 1307e12), ("MI250", 383e12))


# name -> (layers, d_model, batch, seq); head dimension 128, d_ff = 4 d, vocab 32768.
LADDER = {
    "2.7b": (32, 2560, 8, 1024),
    "1.3b": (24, 2048, 8, 1024),
    "1.3b-b16": (24, 2048, 16, 1024),
    "3.3b-w4096": (16, 4096, 4, 2048),
    "760m": (24, 1536, 8, 1024),
    "350m": (24, 1024, 16, 1024),
    "125m": (12, 768, 16, 1024),
}
TINY = (2, 128, 4, 64)         # any backend: the CI size (head dim 32, vocab 256)
COMMON = ["model.dtype=bfloat16", "mesh.strategy=dp", "schedule.warmup_steps=0"]


def size_overrides(name: str, seq: int | None, batch: int | None) -> list[str]:
    """Config overrides of one ladder size, with --seq / --batch replacing its own."""
    layers, d, b, t = TINY if name == "tiny" else LADDER[name]
    heads, vocab = (4, 256) if name == "tiny" else (d // 128, 32768)
    return [f"model.num_layers={layers}", f"model.d_model={d}", f"model.num_heads={heads}",
            f"model.d_ff={4 * d}", f"model.seq_len={seq or t}", f"model.vocab_size={vocab}",
            f"train.batch_size={batch or b}"]


def apply_gpu_settings(system: str | None) -> tuple[list[str], dict[str, str]]:
    """XLA flags and environment of the system profile, set before JAX starts."""
    from spmd.hpc.systems import GPU_XLA_FLAGS, NVIDIA_GPU_ENV, system_profile

    if system is not None:
        profile = system_profile(system)
        flags, env = list(profile.xla_flags), dict(profile.env)
    else:
        flags, env = list(GPU_XLA_FLAGS), dict(NVIDIA_GPU_ENV)
    existing = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([existing, *flags]).strip()
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return flags, env


def peak_flops(device_kind: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for name, peak in PEAKS:
        if name.lower() in device_kind.lower():
            return peak
    return None


def n_params(m) -> int:
    return (m.num_layers * (4 * m.d_model ** 2 + 2 * m.d_model * m.d_ff)
            + 2 * m.vocab_size * m.d_model)


def compile_size(name: str, overrides: list[str], device, limit, limit_fraction: float):
    """Compile spmd's step for one size on `device`: (rt, compiled, plan, fits)."""
    from spmd.aot.plan import plan_from_compiled
    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime

    cfg = load_config(CONFIG, [*COMMON, *overrides])
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, [device]),
                       build_task(cfg))
    compiled, seconds = rt.compile_train_step()
    plan = plan_from_compiled(rt, compiled, seconds, config_name=name)
    fits = limit is None or plan.peak_bytes <= limit_fraction * limit
    return rt, compiled, plan, fits


def plain_pair(rt, state):
    """The plain-JAX step of the same model and options, from spmd's initial values."""
    import jax
    import numpy as np
    from plain_lm import make_step

    m, o = rt.task.cfg.model, rt.sections.optimizer
    attention = _attention_of(rt)
    tx, step = make_step(dtype=jax.numpy.dtype(m.dtype), attention=attention, remat=m.remat,
                         lr=o.lr,
                         weight_decay=o.weight_decay, grad_clip=o.grad_clip,
                         loss_chunk=m.loss_chunk)
    params = jax.tree.map(lambda x: jax.device_put(np.asarray(x), x.sharding), state.params)
    opt_state = jax.jit(tx.init)(params)
    return step, params, opt_state, attention


def _attention_of(rt) -> str:
    """The attention implementation spmd resolved for this model (auto made concrete)."""
    from spmd.tasks.lm import resolve_attention

    return resolve_attention(rt.task.cfg.model)


def measured_peak(device, planned: int, beside=()) -> dict:
    """The device's measured peak memory once spmd's step has run (the allocator's high-water
    mark: init, batch, step), less the bytes of `beside` (the plain-JAX copy of the state that
    --compare holds at the same time), against `spmd plan`'s prediction of the same compiled
    step. None where the backend keeps no statistics (CPU)."""
    import jax

    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    if not peak:
        return {"measured_peak_bytes": None, "plan_over_measured": None}
    peak -= sum(x.nbytes for x in jax.tree.leaves(beside))
    return {"measured_peak_bytes": int(peak), "plan_over_measured": round(planned / peak, 4)}


def run_size(name: str, overrides: list[str], device, limit, args, peak) -> dict:
    """Compile, check the fit, time spmd (and plain JAX with --compare) for one size."""
    import time

    import jax
    import numpy as np
    from common import interleaved, median_ci, paired_ratios

    rt, compiled, plan, fits = compile_size(name, overrides, device, limit, args.headroom)
    cfg, m = rt.task.cfg, rt.task.cfg.model
    record = {"size": name, "params": n_params(m), "num_layers": m.num_layers,
              "d_model": m.d_model, "d_ff": m.d_ff, "seq_len": m.seq_len,
              "vocab_size": m.vocab_size, "batch_size": cfg.train.batch_size,
              "remat": m.remat, "attention": _attention_of(rt), "loss_chunk": m.loss_chunk,
              "scan_layers": m.scan_layers, "peak_bytes": plan.peak_bytes,
              "fits": fits, "compile_s": round(plan.compile_seconds, 2),
              "xla_flops_per_step": plan.flops_compiled}
    print(f"{name}: peak {plan.peak_bytes / 2**30:.1f} GiB"
          + ("" if limit is None else f" of {limit / 2**30:.1f} GiB limit")
          + f", spmd compiled in {plan.compile_seconds:.1f} s"
          + ("" if fits else " -> too big, skipped"), flush=True)
    if not fits:
        return record

    state = rt.init()
    batch = rt.feed.global_batch(rt.task.train_source(), 0)   # device-resident, reused
    box = {"spmd": state}

    def run_spmd():
        for _ in range(args.steps):
            box["spmd"], box["spmd_metrics"] = compiled(box["spmd"], batch)
        jax.block_until_ready((box["spmd"], box["spmd_metrics"]))

    runners = {"spmd": run_spmd}
    if args.compare:
        step, params, opt_state, _ = plain_pair(rt, state)
        start = time.perf_counter()
        step = step.lower(params, opt_state, batch).compile()
        record["plain_compile_s"] = round(time.perf_counter() - start, 2)
        box["plain"] = (params, opt_state)
        # Same start, same first loss: the two programs compute the same thing.
        box["spmd"], metrics = compiled(box["spmd"], batch)
        jax.block_until_ready(box["spmd"])
        record.update(measured_peak(device, plan.peak_bytes, beside=(params, opt_state)))
        params, opt_state, loss = step(params, opt_state, batch)
        box["plain"] = (params, opt_state)
        a, b = float(metrics["loss"]), float(loss)
        record["first_loss"] = {"spmd": a, "plain": b}
        if not np.isclose(a, b, rtol=2e-2 if m.dtype == "bfloat16" else 1e-5):
            raise AssertionError(f"{name}: first losses differ: spmd {a} vs plain JAX {b}")

        def run_plain():
            p, o = box["plain"]
            for _ in range(args.steps):
                p, o, box["plain_loss"] = step(p, o, batch)
            box["plain"] = (p, o)
            jax.block_until_ready((p, o, box["plain_loss"]))

        runners["plain"] = run_plain
    times = interleaved(runners, args.reps, warmup=1)
    if not args.compare:     # spmd's alone ran: the high-water mark is its own
        record.update(measured_peak(device, plan.peak_bytes))
    per_step = {k: [x / args.steps for x in v] for k, v in times.items()}
    spmd = Stats.of(per_step["spmd"])
    tokens = cfg.train.batch_size * m.seq_len
    model_flops = rt.task.flops_per_example() * cfg.train.batch_size
    record.update(
        step_s=spmd.as_dict(5), tokens_per_s=round(tokens / spmd.median, 1),
        model_flops_per_step=model_flops, loss=float(box["spmd_metrics"]["loss"]),
        mfu=None if peak is None else round(model_flops / spmd.median / peak, 4),
        hfu_xla=(None if peak is None or not plan.flops_compiled
                 else round(plan.flops_compiled / spmd.median / peak, 4)))
    if args.compare:
        plain = Stats.of(per_step["plain"])
        ratios = paired_ratios(per_step["spmd"], per_step["plain"])
        record.update(
            plain_step_s=plain.as_dict(5),
            plain_mfu=None if peak is None else round(model_flops / plain.median / peak, 4),
            ratio=Stats.of(ratios).as_dict(4),
            ratio_ci95=[round(x, 4) for x in median_ci(ratios)])
    jax.clear_caches()      # the caller drops this size's buffers before the next one
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true",
                        help="CI smoke test: --size tiny, 2 steps x 2 reps, on any backend")
    parser.add_argument("--size", default=None,
                        help=f"comma-separated sizes: tiny (any backend), {', '.join(LADDER)} "
                             f"(default on a GPU: the whole ladder, sizes that do not fit "
                             f"are reported and skipped)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the "
                                                              "size's)")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: the "
                                                                "size's)")
    parser.add_argument("--remat", default="dots",
                        help="model.remat: none, full, dots, dots_with_batch, save_attention "
                             "(default dots)")
    parser.add_argument("--attention", default="auto", help="model.attention: auto, xla, cudnn")
    parser.add_argument("--loss-chunk", type=int, default=0, help="model.loss_chunk (0: off)")
    parser.add_argument("--unrolled", action="store_true", help="model.scan_layers=false")
    parser.add_argument("--compare", action="store_true",
                        help="also time a plain-JAX step of the same model and options "
                             "(interleaved) and report spmd / plain")
    parser.add_argument("--system", default=None, help="system profile for XLA flags/env")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense bf16 TFLOP/s (default: from the device kind)")
    parser.add_argument("--headroom", type=float, default=0.95,
                        help="use at most this fraction of the allocator limit (default 0.95)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="extra config overrides (e.g. model.positions=learned)")
    add_record_option(parser)
    args = parser.parse_args(argv)
    if args.short:
        args.size, args.steps, args.reps = args.size or "tiny", 2, 2

    flags, env = apply_gpu_settings(args.system)
    import jax

    backend = jax.default_backend()
    sizes = args.size.split(",") if args.size else list(LADDER)
    unknown = [s for s in sizes if s != "tiny" and s not in LADDER]
    if unknown:
        parser.error(f"--size {','.join(unknown)}: choose from tiny, {', '.join(LADDER)}")
    on_gpu = backend == "gpu"
    if not on_gpu and sizes != ["tiny"]:
        print(f"no GPU: skipped (JAX backend is '{backend}'). On a GPU node run: "
              f"python benchmarks/gpu_mfu.py --compare  (or --size tiny here)")
        return 0
    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    peak = peak_flops(device.device_kind, args.peak_tflops)
    reference_only = peak is None and not on_gpu
    if reference_only:
        peak = PEAKS[1][1]   # exercise the MFU arithmetic against the H100 peak
    options = [f"model.remat={args.remat}", f"model.attention={args.attention}",
               f"model.loss_chunk={args.loss_chunk}",
               f"model.scan_layers={'false' if args.unrolled else 'true'}"]
    results = [run_size(name, [*size_overrides(name, args.seq, args.batch), *options,
                               *args.overrides], device, limit, args, peak)
               for name in sizes]
    ran = [r for r in results if "step_s" in r]
    if not ran:
        raise SystemExit("none of " + ", ".join(sizes) + " fits the device")

    head = ["size", "params", "L x d", "batch x seq", "remat", "attn", "compile s",
            "step ms (median [min-max])", "tokens/s", "MFU"]
    if args.compare:
        head += ["plain ms", "plain MFU", "spmd/plain (paired median [95% CI])",
                 "plain compile s"]
    rows = [tuple(head)]
    for r in ran:
        st = r["step_s"]
        row = [r["size"], f"{r['params'] / 1e9:.2f}B", f"{r['num_layers']} x {r['d_model']}",
               f"{r['batch_size']} x {r['seq_len']}", r["remat"], r["attention"],
               f"{r['compile_s']:.1f}",
               f"{st['median'] * 1e3:.1f} [{st['min'] * 1e3:.1f}-{st['max'] * 1e3:.1f}]",
               f"{r['tokens_per_s']:,.0f}", "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"]
        if args.compare:
            lo, hi = r["ratio_ci95"]
            row += [f"{r['plain_step_s']['median'] * 1e3:.1f}",
                    "n/a" if r["plain_mfu"] is None else f"{r['plain_mfu']:.1%}",
                    f"{r['ratio']['median']:.3f} [{lo:.3f}-{hi:.3f}]",
                    f"{r['plain_compile_s']:.1f}"]
        rows.append(tuple(row))
    peak_note = ("unknown" if peak is None else f"{peak / 1e12:.0f} TFLOP/s"
                 + (" (H100's, for reference only)" if reference_only else ""))
    print(f"device: {device.device_kind} ({backend}); peak {peak_note}; jax {jax.__version__}")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    print(table(rows))
    verdict = None
    best = max(ran, key=lambda r: r["mfu"] or 0)
    if not on_gpu:
        print("CPU mode: MFU and ratios are meaningless here; this only proves the code path")
    elif best["mfu"] is not None:
        verdict = "PASS" if best["mfu"] >= TARGET_MFU else "FAIL"
        print(f"{verdict}: best MFU {best['mfu']:.1%} ({best['size']}) vs target >= "
              f"{TARGET_MFU:.0%}")
        if args.compare:
            worst = max(r["ratio"]["median"] for r in ran)
            print(f"spmd / plain JAX step time: worst paired median {worst:.3f} (target <= 1.0)")
    emit({
        "benchmark": "gpu_mfu", "mode": "short" if args.short else "full", "verdict": verdict,
        "backend": backend, "device_kind": device.device_kind, "compare": args.compare,
        **{k: best[k] for k in ("size", "params", "num_layers", "d_model", "d_ff", "seq_len",
                                "vocab_size", "batch_size", "step_s", "tokens_per_s",
                                "model_flops_per_step", "xla_flops_per_step", "mfu",
                                "hfu_xla", "peak_bytes", "loss", "compile_s")},
        "peak_flops": peak, "results": results, "xla_flags": flags, "env": env,
        "machine": machine(),
    }, args)
    return 1 if verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
