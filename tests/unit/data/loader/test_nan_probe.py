"""A NaN in the data that reaches training (issue 35): the non-finite stop's advice points at
the data, naming field, file, dataset and record, not only at the learning rate; with finite
batches it still says to lower optimizer.lr. A real ArraySource on an HDF5 file, the real
NonfiniteHook."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from spmd.data.batch import BatchField
from spmd.data.loader.nan_probe import nonfinite_in_batches
from spmd.data.sources.arrays import ArraySource, write_arrays
from spmd.engine.engine_config import TrainConfig
from spmd.loop.builtin_hooks import NonfiniteHook
from spmd.loop.hooks import StepInfo
from spmd.rundir.metrics import EventLog

FIELDS = {n: BatchField((3,), np.float32, ("batch", "channels")) for n in ("x", "y")}


def source(tmp_path, bad_record: int | None) -> ArraySource:
    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    if bad_record is not None:
        x[bad_record, 1] = np.nan
    path = write_arrays(tmp_path / "d.h5", {"train/x": x, "train/y": x + 1})
    return ArraySource(path, {"x": "train/x", "y": "train/y"}, FIELDS, 4, shuffle=False)


def stop_reason(tmp_path, src) -> str:
    hook = NonfiniteHook(TrainConfig(batch_size=4, steps=10), (1,),
                         EventLog(tmp_path / "events.jsonl", 0),
                         data_probe=lambda lo, hi: nonfinite_in_batches(src, range(lo, hi), 4))
    hook.start(StepInfo(step=5, state=None, metrics={}))
    metrics = {"loss": jnp.float32(np.nan), "grad_norm": jnp.float32(np.nan),
               "nonfinite": jnp.int32(1)}
    stop = hook(StepInfo(step=6, state=None, metrics=metrics))
    assert stop is not None
    return stop.reason


def test_nan_in_the_batch_is_named_in_the_advice(tmp_path):
    src = source(tmp_path, bad_record=22)          # step 5 (update 6) reads records 20..23
    found = nonfinite_in_batches(src, range(0, 6), 4)
    assert found is not None and "step 6" in found and "field 'x'" in found
    assert "d.h5" in found and "dataset 'train/x'" in found and "record 22" in found
    reason = stop_reason(tmp_path, src)
    assert found in reason and "spmd data stats" in reason and "data.nan" in reason
    assert "will not help" in reason and "\n" not in reason
    assert nonfinite_in_batches(src, range(0, 5), 4) is None   # steps before it: finite


def test_finite_batches_keep_the_learning_rate_advice(tmp_path):
    reason = stop_reason(tmp_path, source(tmp_path, bad_record=None))
    assert "lower optimizer.lr" in reason and "spmd data stats" not in reason
