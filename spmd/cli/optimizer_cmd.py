"""`spmd optimizer CONFIG [key=value ...] [--json]`: the optimizer, schedule and decay mask.

Prints the optimizer (name, learning rate, its parameters, clipping), the learning rate at a
few steps (a step as metrics.jsonl counts it: the update that made step k used
`schedule(k - 1)`), and which parameters weight decay applies to (`optimizer.no_decay`; the
default exempts biases, norm scales and embeddings). Nothing is compiled or trained.
"""

from __future__ import annotations

import argparse
import json

# what run() imports, loaded by spmd.cli.main with the garbage collector off (load_stack)
STACK = ("jax", "jax.numpy", "flax.nnx", "optax", "spmd.config.load", "spmd.engine.state")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimizer", help="print the optimizer, the learning rate over the "
                                         "steps and which parameters decay")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def shown_steps(cfg) -> list[int]:
    """Steps worth showing: the first, the warm-up's end, the quarters, the schedule's
    turning points, the last."""
    total, sched = cfg.train.steps, cfg.schedule
    steps = {1, total, sched.warmup_steps, sched.warmup_steps + 1}
    steps |= {round(total * f) for f in (0.25, 0.5, 0.75)}
    if sched.name == "wsd":
        steps.add(total - sched.decay(total))
    if sched.name == "step":
        steps |= {b for b in sched.boundaries} | {b + 1 for b in sched.boundaries}
    return sorted(s for s in steps if 1 <= s <= max(total, 1))


def describe(cfg, task, layout) -> dict:
    """What `spmd optimizer` prints, as a dict."""
    import jax

    from spmd.engine.state import learning_rate
    from spmd.optim import decays

    opt, sched = cfg.optimizer, cfg.schedule
    schedule = learning_rate(cfg.engine_sections())
    own = task.optimizer(schedule) is not None
    with jax.default_device(jax.devices("cpu")[0]):
        lrs = {s: float(schedule(s - 1)) for s in shown_steps(cfg)}
    params = []
    for p in layout.report.params:
        axes = tuple(p.logical_axes)
        params.append({"path": p.path, "shape": list(p.shape), "logical_axes": list(axes),
                       "decays": bool(opt.weight_decay) and not own
                       and decays(p.path, len(p.shape), axes, opt.no_decay)})
    return {
        "optimizer": {"name": f"{type(task).__name__}.optimizer()" if own else opt.name,
                      "lr": opt.lr, "weight_decay": opt.weight_decay,
                      "no_decay": opt.no_decay if opt.no_decay is not None else "default",
                      "grad_clip": opt.grad_clip, "parameters": opt.parameters(),
                      **({"kwargs": opt.kwargs} if opt.kwargs else {})},
        "schedule": {**sched.model_dump(mode="json"), "steps": cfg.train.steps},
        "lr": {str(s): v for s, v in lrs.items()},
        "params": params,
    }


def as_text(d: dict) -> str:
    o, s = d["optimizer"], d["schedule"]
    extra = ", ".join(f"{k} {v}" for k, v in o["parameters"].items())
    lines = [f"optimizer: {o['name']}, lr {o['lr']:g}" + (f", {extra}" if extra else "")
             + (f", kwargs {o['kwargs']}" if "kwargs" in o else ""),
             f"grad_clip: {o['grad_clip'] if o['grad_clip'] else 'off'}; weight_decay: "
             f"{o['weight_decay']:g} (no_decay: {o['no_decay']})"]
    shape = [f"warm-up {s['warmup_steps']}"] if s["warmup_steps"] else []
    if s["decay_steps"] or s["decay_fraction"]:
        shape.append(f"decay {s['decay_steps'] or s['decay_fraction']}")
    if s["name"] in ("cosine", "linear", "wsd"):
        shape.append(f"min_lr_ratio {s['min_lr_ratio']:g}")
    if s["name"] == "step":
        shape.append(f"x{s['factor']:g} at {s['boundaries']}")
    lines.append(f"schedule: {s['name']} over {s['steps']} steps"
                 + (f" ({', '.join(shape)})" if shape else ""))
    lines.append("lr by step: " + ", ".join(f"{k}: {v:.4g}" for k, v in d["lr"].items()))
    decaying = [p for p in d["params"] if p["decays"]]
    lines.append(f"weight decay applies to {len(decaying)} of {len(d['params'])} parameters:")
    width = max((len(p["path"]) for p in d["params"]), default=4)
    for p in d["params"]:
        lines.append(f"  {'decay   ' if p['decays'] else 'no decay'}  {p['path']:<{width}}  "
                     f"{tuple(p['shape'])} {tuple(p['logical_axes'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from spmd.config.load import build_task, load_config

    cfg = load_config(args.config, args.overrides)

    import jax

    from spmd.engine.axis_rules import axis_rules
    from spmd.engine.mesh import build_mesh
    from spmd.engine.state import make_optimizer, model_layout

    devices = jax.devices()
    mesh = build_mesh(cfg.mesh, devices)
    task = build_task(cfg)
    rules = axis_rules(cfg.mesh, task)
    layout = model_layout(task, cfg.train.seed, rules, mesh)
    # a module:function optimizer must import and build
    make_optimizer(cfg.engine_sections(), task, layout)
    d = describe(cfg, task, layout)
    print(json.dumps(d, indent=2) if args.json else as_text(d))
    return 0
