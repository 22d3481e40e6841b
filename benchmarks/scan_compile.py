"""Compile time of the train step, scanned vs unrolled layers (any backend; CPU here).

    python benchmarks/scan_compile.py                       # 24 x 256, remat none and dots
    python benchmarks/scan_compile.py --layers 24 --d-model 2048 --remat dots   # on a GPU

Each case builds spmd's runtime on one device and times `Runtime.compile_train_step()`
(lower + compile on abstract inputs; nothing runs), in a fresh JAX cache per case. Prints a
table and one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import add_record_option, emit, machine, table  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "transformer_tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--remat", default="none,dots", help="comma-separated model.remat values")
    p.add_argument("--dtype", default="float32")
    add_record_option(p)
    args = p.parse_args(argv)

    import jax

    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime

    d = args.d_model
    base = [f"model.num_layers={args.layers}", f"model.d_model={d}",
            f"model.num_heads={max(1, d // 64)}", f"model.d_ff={4 * d}",
            f"model.seq_len={args.seq}", f"model.vocab_size={args.vocab}",
            f"train.batch_size={args.batch}", f"model.dtype={args.dtype}", "mesh.strategy=dp"]
    results = []
    for remat in args.remat.split(","):
        for scan in (True, False):
            jax.clear_caches()
            cfg = load_config(CONFIG, [*base, f"model.remat={remat}",
                                       f"model.scan_layers={str(scan).lower()}"])
            rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()[:1]),
                               build_task(cfg))
            compiled, seconds = rt.compile_train_step()
            results.append({"scan_layers": scan, "remat": remat, "compile_s": round(seconds, 2),
                            "hlo_lines": compiled.as_text().count("\n")})
            print(results[-1], flush=True)
    rows = [("layers x d", "remat", "scan_layers", "compile s", "compiled HLO lines")]
    rows += [(f"{args.layers} x {d}", r["remat"], str(r["scan_layers"]), f"{r['compile_s']:.1f}",
              f"{r['hlo_lines']:,}") for r in results]
    print(table(rows))
    emit({"benchmark": "scan_compile", "layers": args.layers, "d_model": d,
                     "seq_len": args.seq, "batch_size": args.batch, "results": results,
                     "backend": jax.default_backend(), "machine": machine()}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
