"""`spmd profile`'s parser: compute, exposed collectives and idle from a Perfetto trace, for
the CPU layout (ops in the host process, one `device_ordinal` each) and the GPU layout (a
`/device:GPU:N` process with an "XLA Ops" line), and a real jax.profiler trace."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from spmd.config.schema import ProfileConfig
from spmd.errors import SpmdError
from spmd.rundir.trace_summary import covered, find_traces, summarize


def op(name: str, ts: float, dur: float, device: int, pid: int = 1, tid: int = 7) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": name, "hlo_module": "jit_train_step",
                     "device_ordinal": str(device)}}


def write(path, events) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)


def test_covered_merges_overlaps():
    assert covered([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


def test_cpu_layout_splits_each_device_window_exactly(tmp_path):
    # window 0..100 us; device 0: fusion 0-40, all-reduce 30-60 (30-40 hidden), idle 40 us;
    # device 1: fusion 0-20, all-gather 20-100: compute 20, exposed 80.
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              op("fusion.1", 0, 40, 0), op("all-reduce.2", 30, 30, 0),
              op("fusion.1", 0, 20, 1), op("all-gather", 20, 80, 1),
              {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 500, "name": "python"},
              {"ph": "X", "pid": 1, "tid": 7, "ts": 90, "dur": 5, "name": "end: fusion.1",
               "args": {"hlo_op": "fusion.1", "device_ordinal": "0"}}]
    path = tmp_path / "perfetto_trace.json.gz"
    write(path, events)
    s = summarize(path, steps=2)
    assert s.devices == 2 and s.window_s == pytest.approx(100e-6)
    assert s.compute_s == pytest.approx(30e-6)            # (40 + 20) / 2
    assert s.collective_s == pytest.approx(50e-6)         # (20 + 80) / 2
    assert s.idle_s == pytest.approx(20e-6)               # (40 + 0) / 2
    assert [(o.name, o.category) for o in s.ops] == [
        ("all-gather", "collective"), ("fusion.1", "compute"), ("all-reduce.2", "collective")]
    assert s.ops[1].seconds == pytest.approx(30e-6) and s.ops[1].count == 1
    text = s.format(top=2)
    assert "over 2 step(s)" in text and "all-gather" in text and "all-reduce.2" not in text


def test_gpu_layout_reads_the_xla_ops_line_only(tmp_path):
    meta = [{"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 9, "tid": 1, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 9, "tid": 2, "name": "thread_name",
             "args": {"name": "Stream #13"}}]
    ops = [{"ph": "X", "pid": 9, "tid": 1, "ts": 0, "dur": 60, "name": "fusion.3"},
           {"ph": "X", "pid": 9, "tid": 1, "ts": 60, "dur": 20, "name": "all-reduce-start.1"},
           {"ph": "X", "pid": 9, "tid": 2, "ts": 0, "dur": 60, "name": "sm90_xmma_gemm",
            "args": {"hlo_op": "fusion.3"}}]   # the kernel of the same op: not counted twice
    path = tmp_path / "perfetto_trace.json.gz"
    write(path, meta + ops)
    s = summarize(path)
    assert s.devices == 1 and s.compute_s == pytest.approx(60e-6)
    assert s.collective_s == pytest.approx(20e-6) and s.idle_s == pytest.approx(0)


def test_a_real_jax_profiler_trace(tmp_path):
    x = jnp.ones((64, 64))
    step = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    step(x).block_until_ready()
    jax.profiler.start_trace(str(tmp_path / "profile" / "rank00000"), create_perfetto_trace=True)
    for _ in range(3):
        step(x).block_until_ready()
    jax.profiler.stop_trace()
    traces = find_traces(tmp_path / "profile")
    assert list(traces) == [0]
    s = summarize(traces[0], steps=3)
    assert s.devices >= 1 and s.window_s > 0 and s.compute_s > 0
    assert s.compute_s + s.collective_s + s.idle_s == pytest.approx(s.window_s)


def test_a_trace_without_device_ops_is_an_error(tmp_path):
    path = tmp_path / "perfetto_trace.json.gz"
    write(path, [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5, "name": "python"}])
    with pytest.raises(SpmdError, match="no device operations"):
        summarize(path)


def test_profile_steps_must_be_ordered_and_positive():
    assert ProfileConfig().steps is None and ProfileConfig().ranks == [0]
    assert ProfileConfig(steps=(3, 5)).steps == (3, 5)
    for bad in ((5, 3), (0, 2)):
        with pytest.raises(ValueError, match=r"run.profile.steps must be \[start, stop\]"):
            ProfileConfig(steps=bad)
