"""Transformer LM training throughput and MFU on one GPU, in bf16.

    python benchmarks/gpu_mfu.py                 # on a GPU node; "no GPU: skipped" elsewhere
    python benchmarks/gpu_mfu.py --short         # CI: a tiny model on whatever JAX has (CPU)

The largest model of a ladder whose compiled step fits the GPU (XLA's own memory
analysis of the compiled step, against the device's allocator limit) is trained for
a few steps on one device-resident synthetic batch. MFU = model FLOPs per second /
peak, with model FLOPs from the PaLM formula (6 N per token plus causal attention
12 L d T / 2 per token: `LanguageModelTask.flops_per_example`) and the dense bf16
peak of the device (989 TFLOP/s for H100 SXM and H200). Target: MFU >= 50%.

The GPU XLA flags and environment of spmd's system profiles (`spmd.systems`) are
applied before JAX starts; `--system NAME` takes them from that profile instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))   # spmd without `pip install`
from common import Stats, json_line, machine, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "transformer_tiny.yaml"
TARGET_MFU = 0.50
# Dense bf16 peak FLOP/s by device kind (substring match, first wins).
PEAKS = (("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("A100", 312e12),
         ("MI300", 1307e12), ("MI250", 383e12))


def _model(layers: int, d: int, batch: int, seq: int = 1024, vocab: int = 32768) -> list[str]:
    return [f"model.num_layers={layers}", f"model.d_model={d}", f"model.num_heads={d // 128}",
            f"model.d_ff={4 * d}", f"model.seq_len={seq}", f"model.vocab_size={vocab}",
            f"train.batch_size={batch}"]


# Largest first; head dimension 128, d_ff = 4 d, 1024-token sequences, >= 8k tokens per step.
LADDER = {
    "2.7b": _model(32, 2560, 8),
    "1.3b": _model(24, 2048, 8),
    "1.3b-b4": _model(24, 2048, 4),
    "760m": _model(24, 1536, 8),
    "350m": _model(24, 1024, 16),
    "125m": _model(12, 768, 16, vocab=32768),
}
TINY = ["model.num_layers=2", "model.d_model=128", "model.num_heads=4", "model.d_ff=512",
        "model.seq_len=64", "model.vocab_size=256", "train.batch_size=4"]
COMMON = ["model.dtype=bfloat16", "mesh.strategy=dp", "train.warmup_steps=0"]


def apply_gpu_settings(system: str | None) -> tuple[list[str], dict[str, str]]:
    """XLA flags and environment of the system profile, set before JAX starts."""
    from spmd.systems import GPU_XLA_FLAGS, NVIDIA_GPU_ENV, system_profile

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


def choose(sizes: list[str], overrides: list[str], device, limit_fraction: float):
    """The first (largest) size whose compiled step fits the device: (name, rt, compiled, plan)."""
    import jax

    from spmd.config import load_config
    from spmd.mesh import build_mesh
    from spmd.plan import plan_from_compiled
    from spmd.runtime import build_runtime

    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    tried = []
    for name in sizes:
        extra = TINY if name == "tiny" else LADDER[name]
        cfg = load_config(CONFIG, [*COMMON, *extra, *overrides])
        rt = build_runtime(cfg, build_mesh(cfg.mesh, [device]))
        compiled, seconds = rt.compile_train_step()
        plan = plan_from_compiled(rt, compiled, seconds, config_name=name)
        fits = limit is None or plan.peak_bytes <= limit_fraction * limit
        tried.append(f"{name}: peak {plan.peak_bytes / 2**30:.1f} GiB"
                     + ("" if limit is None else f" of {limit / 2**30:.1f} GiB limit")
                     + f", compiled in {seconds:.0f} s")
        print(tried[-1], "-> fits" if fits else "-> too big", flush=True)
        if fits:
            return name, rt, compiled, plan, tried
        del rt, compiled
        jax.clear_caches()
    raise SystemExit(f"none of {', '.join(sizes)} fits the device: " + "; ".join(tried))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true",
                        help="CI smoke test: tiny model on any backend (CPU), never fails")
    parser.add_argument("--size", default=None,
                        help=f"one of {', '.join(LADDER)} (default: the largest that fits)")
    parser.add_argument("--system", default=None, help="system profile for XLA flags/env")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense bf16 TFLOP/s (default: from the device kind)")
    parser.add_argument("--headroom", type=float, default=0.95,
                        help="use at most this fraction of the allocator limit (default 0.95)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="extra config overrides (e.g. train.batch_size=4)")
    args = parser.parse_args(argv)

    flags, env = apply_gpu_settings(args.system)
    import jax

    backend = jax.default_backend()
    if backend != "gpu" and not args.short:
        print(f"no GPU: skipped (JAX backend is '{backend}'). On a GPU node run: "
              f"python benchmarks/gpu_mfu.py")
        return 0
    device = jax.devices()[0]
    if args.short:
        sizes, steps, reps = ["tiny"], 2, 2
    else:
        sizes, steps, reps = [args.size] if args.size else list(LADDER), args.steps, args.reps
    name, rt, compiled, plan, tried = choose(sizes, args.overrides, device, args.headroom)

    state = rt.init()
    batch = rt.feed.global_batch(rt.task.train_source(), 0)   # device-resident, reused
    for _ in range(2):                                         # warm-up (already compiled)
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    import time

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append((time.perf_counter() - start) / steps)
    loss = float(metrics["loss"])
    step = Stats.of(times)

    cfg, m = rt.cfg, rt.cfg.model
    tokens = cfg.train.batch_size * m.seq_len
    model_flops = rt.task.flops_per_example() * cfg.train.batch_size
    peak = peak_flops(device.device_kind, args.peak_tflops)
    reference_only = peak is None and args.short
    if reference_only:
        peak = PEAKS[1][1]   # exercise the MFU arithmetic against the H100 peak
    n_params = m.num_layers * (4 * m.d_model ** 2 + 2 * m.d_model * m.d_ff) \
        + 2 * m.vocab_size * m.d_model
    mfu = model_flops / step.median / peak if peak else None
    hfu = plan.flops_compiled / step.median / peak if peak and plan.flops_compiled else None
    rows = [("size", "params", "L", "d", "batch x seq", "step ms (median [min-max])",
             "tokens/s", "TFLOP/s", "MFU")]
    rows.append((name, f"{n_params / 1e9:.2f}B", str(m.num_layers), str(m.d_model),
                 f"{cfg.train.batch_size} x {m.seq_len}",
                 f"{step.median * 1e3:.1f} [{step.min * 1e3:.1f}-{step.max * 1e3:.1f}]",
                 f"{tokens / step.median:,.0f}", f"{model_flops / step.median / 1e12:.1f}",
                 f"{mfu:.1%}" if mfu is not None else "n/a"))
    peak_note = ("unknown" if peak is None else f"{peak / 1e12:.0f} TFLOP/s"
                 + (" (H100's, for reference only)" if reference_only else ""))
    print(f"device: {device.device_kind} ({backend}); peak {peak_note}")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    print(table(rows))
    verdict = None
    if args.short or backend != "gpu":
        print("short/CPU mode: the MFU figure is meaningless here; this only proves the code path")
    elif mfu is not None:
        verdict = "PASS" if mfu >= TARGET_MFU else "FAIL"
        print(f"{verdict}: MFU {mfu:.1%} vs target >= {TARGET_MFU:.0%}")
    print(json_line({
        "benchmark": "gpu_mfu", "mode": "short" if args.short else "full", "verdict": verdict,
        "size": name, "params": n_params, "num_layers": m.num_layers, "d_model": m.d_model,
        "d_ff": m.d_ff, "seq_len": m.seq_len, "vocab_size": m.vocab_size,
        "batch_size": cfg.train.batch_size, "step_s": step.as_dict(5),
        "tokens_per_s": round(tokens / step.median, 1), "model_flops_per_step": model_flops,
        "xla_flops_per_step": plan.flops_compiled, "peak_flops": peak,
        "mfu": None if mfu is None else round(mfu, 4),
        "hfu_xla": None if hfu is None else round(hfu, 4),
        "peak_bytes": plan.peak_bytes, "loss": loss, "tried": tried, "xla_flags": flags,
        "env": env, "machine": machine(),
    }))
    return 1 if verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
