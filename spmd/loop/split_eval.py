"""An evaluation pass over a split: every window once, the last partial batch padded and its
padding taken out.

    metrics = evaluate(rt, params, sample_path, source, max_batches=None)   # the whole split

The task's eval metrics averaged over the examples scored (float64 on the host, each batch
weighted by its real examples), plus what was scored: `windows_scored` and `windows_in_split`,
and, for a source whose windows have times (weather and climate files), `windows_from` and
`windows_to` (the first scored window's first time, the last one's last time).

Invariants:
- A source that knows its size (`count`: the split's windows or examples) is read from its
  first position on, each example once: all ceil(count / batch) batches, or the first
  `max_batches` whole ones (`data.eval_batches`, the quick evaluations during training),
  never more than the split holds and never wrapping round to its start. A partial last
  batch goes through `spmd.data.sources.padded_tail.PaddedTail` (the real examples and copies of the
  first of them, then a batch of copies alone), and the copies' share is subtracted, exactly
  for metrics that are means over a batch's examples (`Task.eval_metrics`).
- A source without a size (generated data, an endless stream) is read for `max_batches`
  batches (default: `data.eval_batches`), as before.
- Every process runs the same batches in the same order (the counts come from the source,
  the same on every process).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmd.data.batch import DataSource
from spmd.data.sources.padded_tail import PaddedTail
from spmd.engine.runtime import Runtime

log = logging.getLogger("spmd.loop")

SAMPLES_KEPT = 4     # examples of the first eval batch kept in eval_sample.npz


def split_size(source: DataSource) -> int | None:
    """The split's number of windows or examples, or None for an endless source."""
    count = getattr(source, "count", None)
    return int(count) if isinstance(count, int | np.integer) and count > 0 else None


def evaluate(rt: Runtime, params: Any, sample_path: Path | None,
             source: DataSource | None = None,
             max_batches: int | None = None) -> dict[str, Any]:
    """Mean eval metrics over the split (module docstring). `source`: default the task's
    eval source; `max_batches`: at most that many whole batches (None: every window of a
    sized source, `data.eval_batches` of an endless one). With a sample step, the first
    batch's first few sample outputs go to `sample_path` (rank 0)."""
    source = source if source is not None else rt.task.eval_source()
    batch = rt.eval_feed.batch_size
    count = split_size(source)
    if count is None:
        steps, tail = max_batches or rt.task.eval_batches(), 0
    else:
        steps, tail = divmod(count, batch)
        if max_batches is not None and max_batches <= steps:
            steps, tail = max_batches, 0
    sums: dict[str, float] = {}

    def add(metrics: dict, weight: float) -> None:
        for k, v in jax.device_get(metrics).items():
            sums[k] = sums.get(k, 0.0) + weight * float(v)

    for i in range(steps):
        data = rt.eval_feed.global_batch(source, i)
        add(rt.eval_step(params, data), batch)
        if i == 0:
            _keep_samples(rt, params, data, sample_path)
    if tail:
        padded = PaddedTail(source, count, batch)
        data = rt.eval_feed.global_batch(padded, 0)
        add(rt.eval_step(params, data), batch)
        add(rt.eval_step(params, rt.eval_feed.global_batch(padded, 1)), -(batch - tail))
        if steps == 0:
            _keep_samples(rt, params, data, sample_path)
    scored = steps * batch + tail
    out: dict[str, Any] = {k: v / scored for k, v in sums.items()}
    out["windows_scored"] = scored
    out["windows_in_split"] = count if count is not None else scored
    out.update(_time_range(source, scored))
    return out


def _keep_samples(rt: Runtime, params: Any, data: dict, sample_path: Path | None) -> None:
    if rt.sample_step is None:
        return
    sample = jax.device_get(rt.sample_step(params, data))
    if sample_path is not None:
        np.savez(sample_path, **{k: np.asarray(v)[:SAMPLES_KEPT] for k, v in sample.items()})


def _time_range(source: DataSource, scored: int) -> dict[str, str]:
    """`windows_from` / `windows_to` of a source whose windows have times (`window_of`)."""
    window_of = getattr(source, "window_of", None)
    record_indices = getattr(source, "record_indices", None)
    batch = getattr(source, "batch_size", None)
    if window_of is None or record_indices is None or not batch or scored < 1:
        return {}
    try:
        first = record_indices(0, 0, 1)[0]
        last = record_indices((scored - 1) // batch, (scored - 1) % batch,
                              (scored - 1) % batch + 1)[0]
        start, end = window_of(int(first))["times"][0], window_of(int(last))["times"][-1]
        text = getattr(source, "time_text", lambda t: np.datetime_as_string(t, unit="m"))
        return {"windows_from": text(start), "windows_to": text(end)}
    except (TypeError, ValueError, KeyError, IndexError) as e:
        log.debug("no time range of the scored windows (%s)", e)
        return {}
