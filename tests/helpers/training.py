"""Training in the test process: a built runtime step by step, and a tiny MLP run's config."""

from __future__ import annotations


def train_steps(rt, steps: int) -> tuple[list[float], dict]:
    """Train a built runtime in this process for `steps` steps: (losses, final state)."""
    state = rt.init()
    source = rt.task.train_source()
    losses = []
    for step in range(steps):
        state, metrics = rt.train_step(state, rt.feed.global_batch(source, step))
        losses.append(float(metrics["loss"]))
    return losses, state


def mlp_config(run_dir, *, steps: int = 6, **sections: dict) -> dict:
    """Config of a tiny MLP run in `run_dir` (no plots, no progress bar), batch 8; each
    keyword (train=, checkpoint=, mesh=, ...) is merged into that section."""
    config = {"run": {"dir": str(run_dir), "plots": False, "progress": False},
              "model": {"name": "mlp", "d_in": 8, "d_hidden": 16, "d_out": 4, "num_layers": 1},
              "train": {"steps": steps, "batch_size": 8}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def runtime_for(cfg, mesh, task=None):
    """The engine's runtime of a run config on `mesh`, split as the trainer splits it: the
    task built from the config (or `task`), the engine handed its own sections only."""
    from spmd.config import build_task
    from spmd.engine.engine_config import EngineSections
    from spmd.engine.runtime import build_runtime

    return build_runtime(EngineSections.of(cfg), mesh, task if task is not None else
                         build_task(cfg))
