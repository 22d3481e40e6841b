"""`spmd shardings CONFIG [key=value ...] [--devices N] [--json]`: the sharding report.

Per parameter: path, shape, logical axes, mesh spec, bytes per device, and notes: `padded+N`
(a short Flax spec, its last N dimensions replicated) and `auto-fsdp dim D` (no rule put it
on fsdp; `mesh.fsdp_min_bytes` split dimension D). `--json` carries the same as
`padded_dims` and `auto_fsdp_dim`. A layout that replicates what the strategy exists to
shard is warned about on stderr (logger `spmd.sharding`), as in training.
"""

from __future__ import annotations

import argparse
import json

# what run() imports, loaded by spmd.cli.main with the garbage collector off (load_stack)
STACK = ("jax", "jax.numpy", "flax.nnx", "spmd.config.load", "spmd.engine.state")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("shardings", help="print where every parameter lives, without training")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--devices", type=int, default=None,
                   help="lay out for N devices (CPU stand-ins; default: the devices JAX sees)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def format_stages(stages: dict) -> str:
    """The pipeline lines of the text report."""
    repeats = f", {stages['repeats']} repeats" if stages["repeats"] > 1 else ""
    return (f"pipeline: {stages['stages']} stages over {'+'.join(stages['stage_axes'])}, "
            f"{stages['microbatches']} microbatches, {stages['schedule']}{repeats}, bubble "
            f"{stages['bubble_fraction']:.3f}; stacked layers {stages['layers_per_stage']} per "
            f"stage: {stages['stacked_bytes_per_device']:,} B per device "
            f"({stages['stacked_bytes_unstaged_per_device']:,} B without stages)")


def run(args: argparse.Namespace) -> int:
    from spmd.config.load import build_task, load_config

    cfg = load_config(args.config, args.overrides)
    if args.devices is not None:
        from spmd.aot.stand_ins import cpu_stand_in_devices

        devices = cpu_stand_in_devices(args.devices)
    else:
        import jax

        devices = jax.devices()

    from spmd.engine.axis_rules import axis_rules, warn_replication
    from spmd.engine.mesh import build_mesh
    from spmd.engine.pipeline_checks import check_pipeline, stage_summary
    from spmd.engine.state import model_layout

    mesh = build_mesh(cfg.mesh, devices)
    task = build_task(cfg)
    rules = axis_rules(cfg.mesh, task)
    schedule = check_pipeline(cfg.train, cfg.mesh, task, rules, mesh)
    report = model_layout(task, cfg.train.seed, rules, mesh).report
    stages = stage_summary(report, rules, mesh, schedule)
    if args.json:
        print(json.dumps({**report.as_json(), "pipeline": stages}, indent=2))
    else:
        print(report.as_text())
        if stages is not None:
            print(format_stages(stages))
    warn_replication(report, cfg.mesh)
    report.check_replicated_fraction(cfg.mesh.max_replicated_fraction)
    return 0
