"""`spmd eval`: the task's evaluation metrics on a split, with a run's trained parameters.

The metrics are computed as the trainer's evaluation computes them (the same jitted eval
step, the model in eval mode and any `rngs` from a fixed key), over every window of the split
once by default (spmd.loop.split_eval: the last partial batch padded and its padding taken
out), with how many windows were scored and, for weather and climate files, the time range
they cover. `max_batches=data.eval_batches` scores what the trainer's evaluations score (their
first batches), so it reproduces the last evaluation in a run's metrics.jsonl.

Weather scores: a task whose eval metrics hold latitude-weighted mean squared errors
(`lat_mse_<channel>_<lead>`, `persistence_lat_mse_<channel>_<lead>`: a TrajectoryTask whose
`latitudes()` is not None, or any task that returns spmd.scores.weather.weather_scores) gets
their square roots, `lat_rmse_*` and `persistence_lat_rmse_*`, taken after the mean over
every eval batch: WeatherBench2's RMSE, the model's next to persistence's (docs/metrics.md).
"""

from __future__ import annotations

from spmd.config.load import build_task
from spmd.engine.runtime import build_runtime
from spmd.errors import SpmdError
from spmd.inference.loading import Trained
from spmd.loop.split_eval import evaluate
from spmd.scores.weather import finish_scores

SPLITS = ("test", "train")


def evaluate_split(trained: Trained, split: str = "test",
                   max_batches: int | None = None) -> dict[str, float | int | str]:
    """Mean eval metrics of `trained` over every window of the split (at most `max_batches`
    whole batches), on `trained.mesh`, with `windows_scored`, `windows_in_split` and, where
    the windows have times, `windows_from` / `windows_to`."""
    if split not in SPLITS:
        raise SpmdError(f"--split {split}: the splits are {', '.join(SPLITS)}")
    cfg = trained.config
    if not cfg.train.eval_every:  # a task offers its eval split only when evaluation is on
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_every": 1})})
    task = build_task(cfg)
    if task.eval_source() is None:
        raise SpmdError(f"task {cfg.task} has no evaluation (its eval_source() is None): "
                        "spmd eval needs a task with eval metrics")
    if split != "test" and task.eval_batch_fields() is not None:
        raise SpmdError(f"--split {split}: task {cfg.task} evaluates with its own batch layout "
                        f"(eval_batch_fields(), e.g. rollout targets) on its test split "
                        f"only; use --split test")
    rt = build_runtime(cfg.engine_sections(), trained.mesh, task)
    assert rt.eval_step is not None
    source = task.eval_source() if split == "test" else task.train_source()
    return finish_scores(evaluate(rt, trained.params, None, source, max_batches=max_batches))
