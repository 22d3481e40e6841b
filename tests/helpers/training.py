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
    from spmd.engine.runtime import build_runtime

    return build_runtime(cfg.engine_sections(), mesh, task if task is not None else
                         build_task(cfg))


def config_losses(path, strategy: str, devices, steps: int, *overrides: str):
    """(losses, runtime) of `steps` updates of the config at `path` under `mesh.strategy`
    on `devices`, in this process."""
    from spmd.config.load import load_config
    from spmd.engine.mesh import build_mesh

    cfg = load_config(path, [f"mesh.strategy={strategy}", *overrides])
    rt = runtime_for(cfg, build_mesh(cfg.mesh, devices))
    return train_steps(rt, steps)[0], rt


def shardings_json(path, capsys, strategy: str) -> dict:
    """`spmd shardings PATH mesh.strategy=STRATEGY --json`, run in this process, parsed."""
    import argparse
    import json

    from spmd.cli import shardings_cmd

    args = argparse.Namespace(config=str(path), overrides=[f"mesh.strategy={strategy}"],
                              devices=None, json=True)
    assert shardings_cmd.run(args) == 0
    return json.loads(capsys.readouterr().out)
