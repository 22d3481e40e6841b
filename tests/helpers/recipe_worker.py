"""A rank that trains a tiny MLP with train.grad_accum 1 and 4 under dp, fsdp and tp.

    mpiexec -n 2 python tests/helpers/recipe_worker.py OUT.json

Every rank builds, for each strategy, the runtime with K = 1 and with K = 4 microbatches,
trains STEPS steps from the same initial state on the same global batches, gathers the
parameters to host, and rank 0 writes OUT.json: per strategy the largest relative
differences of the losses and of the parameters, and (fsdp, tp) whether the K = 4 step's
compiled HLO has all-to-alls or collective-permutes K = 1's has not: what moving batch rows
between devices would take. (XLA may still all-gather a microbatch's activations to build a
sharded weight gradient when that is cheaper than reduce-scattering it, as under fsdp with
one row per device here: a choice of the partitioner, not a reshuffle of the batch.)
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "mlp_tiny.yaml"
SMALL = ["model.num_layers=1", "model.d_hidden=64", "train.batch_size=32", "run.progress=false"]
STRATEGIES = {"dp": [], "fsdp": [], "tp": ["mesh.axes.data=2", "mesh.axes.tensor=4"]}
STEPS = 3
HLO_CHECKED = ("fsdp", "tp")   # the in-process test checks dp's compiled step
MOVES = re.compile(r"\b(all-to-all|collective-permute)(?:-start)?\(")


def main(argv: list[str]) -> int:
    (out,) = argv
    from spmd.launch import bootstrap

    env = bootstrap()
    import jax
    import numpy as np

    from spmd.comm.host_gather import gather_to_host
    from spmd.config.load import build_task, load_config
    from spmd.engine.mesh import build_mesh
    from spmd.engine.runtime import build_runtime

    def train(overrides: list[str]):
        cfg = load_config(CONFIG, overrides)
        mesh = build_mesh(cfg.mesh, jax.devices(), env.node_of_rank)
        rt = build_runtime(cfg.engine_sections(), mesh, build_task(cfg))
        state, source, losses = rt.init(), rt.task.train_source(), []
        for step in range(STEPS):
            state, metrics = rt.train_step(state, rt.feed.global_batch(source, step))
            losses.append(float(metrics["loss"]))
        params = [np.asarray(gather_to_host(x))
                  for x in jax.tree.leaves(state.params)]
        return rt, np.array(losses), params

    def rel(a, b) -> float:
        return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-3)))

    report = {}
    for strategy, axes in STRATEGIES.items():
        overrides = [*SMALL, f"mesh.strategy={strategy}", *axes]
        rt_1, losses_1, params_1 = train(overrides)
        rt, losses_4, params_4 = train([*overrides, "train.grad_accum=4"])
        moves = ([Counter(m.group(1) for m in MOVES.finditer(r.compile_train_step()[0].as_text()))
                  for r in (rt_1, rt)] if strategy in HLO_CHECKED else [None, None])
        report[strategy] = {
            "loss_rel": rel(losses_4, losses_1),
            "param_rel": max(rel(a, b) for a, b in zip(params_4, params_1)),
            "batch_moves": moves[0] != moves[1],
            "mesh": {k: v for k, v in rt.mesh.shape.items() if v > 1},
            "processes": env.size,
        }
    if env.rank == 0:
        Path(out).write_text(json.dumps(report))
    if env.size > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
