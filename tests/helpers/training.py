"""Training a built runtime in the test process, step by step."""

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
