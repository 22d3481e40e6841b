"""A rank that trains the tiny MLP with every optimizer name under fsdp, in one job.

    mpiexec -n 2 python tests/helpers/optimizer_worker.py OUT.json

Every rank builds, for each of spmd.optim.OPTIMIZERS, the runtime of configs/mlp_tiny.yaml
(fsdp splitting every parameter, weight decay on) and trains STEPS steps; rank 0 writes
OUT.json: per optimizer the losses, the process count, and how many optimizer-state arrays
are split across devices (their moments follow the parameters onto both ranks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "mlp_tiny.yaml"
STEPS = 8
LR = {"adamw": 3e-3, "adam": 3e-3, "sgd": 0.02, "lion": 1e-3, "adafactor": 1e-2, "muon": 0.02}


def main(argv: list[str]) -> int:
    (out,) = argv
    from spmd.launch import bootstrap

    env = bootstrap()
    import jax

    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime
    from spmd.optim import OPTIMIZERS

    report = {}
    for name in OPTIMIZERS:
        extra = {"adafactor": ["optimizer.min_dim_size_to_factor=8"],
                 "sgd": ["optimizer.momentum=0.9"]}.get(name, [])
        cfg = load_config(CONFIG, [f"optimizer.name={name}", f"optimizer.lr={LR[name]}",
                                   "optimizer.weight_decay=0.01", "mesh.strategy=fsdp",
                                   "mesh.fsdp_min_bytes=0", "run.progress=false", *extra])
        mesh = build_mesh(cfg.mesh, jax.devices(), env.node_of_rank)
        rt = build_runtime(cfg.engine_sections(), mesh, build_task(cfg))
        state, source, losses = rt.init(), rt.task.train_source(), []
        for step in range(STEPS):
            state, metrics = rt.train_step(state, rt.feed.global_batch(source, step))
            losses.append(float(metrics["loss"]))
        split = sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.opt_state))
        report[name] = {"losses": losses, "processes": env.size, "split_state_arrays": split,
                        "devices": rt.mesh.size}
    if env.rank == 0:
        Path(out).write_text(json.dumps(report))
    if env.size > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
