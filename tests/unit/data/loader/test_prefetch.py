"""Background reads (spmd.data.loader.prefetch through BatchFeed): bit-identical batches with and
without prefetch, the same batches for a resumed run, read errors raised by the step that
needs them, the time the loop waited, and a clean exit with reads in flight."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from spmd.config.schema import MeshConfig
from spmd.data import ArrayDataError, ArraySource, BatchField, write_arrays
from spmd.data.loader.feed import BatchFeed
from spmd.engine.mesh import build_mesh
from spmd.sharding import rules_for
from tests.helpers.env import REPO, clean_env

N, BATCH, GRID = 40, 8, 8
FIELDS = {"u0": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None)),
          "u1": BatchField((GRID, GRID, 2), np.float32, ("batch", "x", "y", "channels"))}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(5)
    return write_arrays(tmp_path_factory.mktemp("prefetch") / "d.h5", {
        "train/u0": rng.standard_normal((N, GRID, GRID)).astype(np.float32),
        "train/u1": rng.standard_normal((N, GRID, GRID, 2)).astype(np.float32)})


def source(path, **kw) -> ArraySource:
    return ArraySource(path, {"u0": "train/u0", "u1": "train/u1"}, FIELDS, BATCH,
                       **{"seed": 4, **kw})


def feed(strategy="dp", axes=None, **kw) -> BatchFeed:
    mesh = build_mesh(MeshConfig(strategy=strategy, axes=axes or {}), jax.devices())
    return BatchFeed(FIELDS, BATCH, mesh, rules_for(strategy), **kw)


def host(batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


@pytest.mark.parametrize("strategy, axes", [("dp", {}),
                                            ("spatial", {"context": 4, "tensor": 2})])
def test_prefetched_batches_are_bit_identical(data, strategy, axes):
    plain, ahead = feed(strategy, axes), feed(strategy, axes)
    off, on = source(data), source(data, prefetch=3, read_threads=3)
    for step in range(12):
        a, b = host(plain.global_batch(off, step)), host(ahead.global_batch(on, step))
        for name in FIELDS:
            assert a[name].tobytes() == b[name].tobytes()
            assert b[name].dtype == np.float32
    reader = ahead._readers[id(on)][1]
    # every step after the first was asked of the reader ahead of time; how many were
    # already read when asked depends on the CPU the threads got (11 of 11 on an idle machine)
    assert reader.hits + reader.misses == 12 and reader.hits >= 1, (reader.hits, reader.misses)
    ahead.close()


def test_a_resumed_run_reads_the_same_batches(data):
    uninterrupted = feed()
    src = source(data, prefetch=2, read_threads=2)
    seen = [host(uninterrupted.global_batch(src, s)) for s in range(10)]
    resumed = feed()                                  # a new process restored step 6
    src2 = source(data, prefetch=2, read_threads=2)
    for step in range(6, 10):
        got = host(resumed.global_batch(src2, step))
        np.testing.assert_array_equal(got["u1"], seen[step]["u1"])
    got = host(resumed.global_batch(src2, 2))         # a jump back: read at once
    np.testing.assert_array_equal(got["u0"], seen[2]["u0"])
    uninterrupted.close()
    resumed.close()


def test_the_feed_reads_what_the_source_says_and_stops_at_until(data):
    f = feed()
    src = source(data, prefetch=2, read_threads=1, prefetch_until=3)
    for step in range(3):
        f.global_batch(src, step)
    reader = f._readers[id(src)][1]
    assert not reader._steps                          # nothing read beyond step 2
    forced = feed(prefetch=0)
    forced.global_batch(src, 0)
    assert not forced._readers                        # BatchFeed(prefetch=0) overrides
    f.close()


class Failing:
    """Rows of `inner`, but reading step `bad` fails as a damaged file does."""

    reads_slabs = True
    prefetch, read_threads = 2, 2

    def __init__(self, inner, bad):
        self.inner, self.bad, self.steps = inner, bad, []

    def rows(self, step, start, stop, region=None):
        self.steps.append(step)
        if step == self.bad:
            raise ArrayDataError(f"data.path=/x/part7.h5: reading record 3 of dataset "
                                 f"'train/u0' failed (step {step})")
        return self.inner.rows(step, start, stop, region)


def test_a_read_error_is_raised_by_the_step_that_needs_it(data):
    f = feed()
    src = Failing(source(data), bad=4)
    for step in range(4):                  # steps 4 and 5 are read ahead, 4 fails
        f.global_batch(src, step)
    deadline = time.monotonic() + 30
    while 4 not in src.steps and time.monotonic() < deadline:
        time.sleep(0.01)                   # the read ahead runs in a background thread
    assert 4 in src.steps and threading.current_thread() is threading.main_thread()
    with pytest.raises(ArrayDataError, match=r"part7.h5.*'train/u0'.*step 4"):
        f.global_batch(src, 4)
    src.bad = None
    f.global_batch(src, 4)                 # the failed read is not cached
    f.close()


class Slow:
    """A source that takes `delay` seconds per call (thread-safe: it only sleeps)."""

    reads_slabs = False

    def __init__(self, inner, delay, prefetch):
        self.inner, self.delay, self.prefetch, self.read_threads = inner, delay, prefetch, 1

    def rows(self, step, start, stop):
        time.sleep(self.delay)
        return self.inner.rows(step, start, stop)


def test_the_wait_for_data_is_measured_and_hidden_by_prefetch(data):
    waits = {}
    for depth in (0, 2):
        f, src = feed(), Slow(source(data), 0.2, depth)
        f.global_batch(src, 0)
        per_step = []
        for step in range(1, 5):
            time.sleep(0.3)                # the step computes while the next batch is read
            f.global_batch(src, step)
            per_step.append(f.last_wait_s)
            assert 0 <= f.last_read_wait_s <= f.last_wait_s
        waits[depth] = max(per_step)
        assert f.calls == 5 and f.total_wait_s >= sum(per_step)
        f.close()
    assert waits[0] >= 0.2 and waits[2] < 0.1


EXIT_PROBE = """
import sys, time
sys.path.insert(0, {repo!r})
import jax, numpy as np
from spmd.config.schema import MeshConfig
from spmd.data import ArraySource, BatchField
from spmd.data.loader.feed import BatchFeed
from spmd.engine.mesh import build_mesh
from spmd.sharding import rules_for

class Slow:
    reads_slabs, prefetch, read_threads = False, 4, 2
    def __init__(self, inner): self.inner = inner
    def rows(self, step, start, stop):
        if step > 0:
            time.sleep(30)                       # a read that hangs (a stuck file system)
        return self.inner.rows(step, start, stop)

fields = {{"u0": BatchField(({grid}, {grid}, 1), np.float32, ("batch", "x", "y", None))}}
mesh = build_mesh(MeshConfig(strategy="dp"), jax.devices())
feed = BatchFeed(fields, {batch}, mesh, rules_for("dp"))
src = Slow(ArraySource({path!r}, {{"u0": "train/u0"}}, fields, {batch}))
feed.global_batch(src, 0)                        # steps 1..4 now in flight, never finish
print("done", flush=True)
"""


def test_exit_with_reads_in_flight_does_not_hang(data):
    probe = EXIT_PROBE.format(repo=str(REPO), grid=GRID, batch=BATCH, path=str(data))
    began = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60, env=clean_env(JAX_NUM_CPU_DEVICES="8"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done" in r.stdout and time.perf_counter() - began < 25


def test_the_thread_that_finishes_a_step_combines_it():
    """The last part's thread runs `combine` (the feed builds device arrays there); an
    exception in combine is raised by get() of that step only."""
    from spmd.data.loader.prefetch import Prefetcher

    combined_in: list[str] = []

    def plan(step):
        parts = [lambda k=k: k * 10 + step for k in range(3)]

        def combine(results):
            combined_in.append(threading.current_thread().name)
            if step == 2:
                raise ValueError("combine failed at step 2")
            return results

        return parts, combine

    reader = Prefetcher(plan, depth=2, threads=2, name="t-read")
    try:
        assert reader.get(0)[0] == [0, 10, 20]
        assert reader.get(1)[0] == [1, 11, 21]
        with pytest.raises(ValueError, match="step 2"):
            reader.get(2)
        assert reader.get(3)[0] == [3, 13, 23]
    finally:
        reader.close()
    assert len(combined_in) >= 4
    assert all(name.startswith("t-read") for name in combined_in)


def test_a_starved_caller_is_handed_the_whole_window_but_never_waits_on_a_hung_read():
    """A caller that has to wait waits for the steps after its own too (they then come
    without a wake-up each); a later step whose read hangs holds a done step back for at
    most twice the window's time at the recent pace."""
    from spmd.data.loader.prefetch import Prefetcher

    stuck = threading.Event()

    def plan(step):
        def part():
            if step >= 6:
                stuck.wait(30)                     # a read that hangs (a stuck file system)
            time.sleep(0.01)
            return step
        return [part], lambda results: results[0]

    reader = Prefetcher(plan, depth=3, threads=1, name="t-window")
    try:
        assert reader.get(0)[0] == 0               # first step: no pace yet, only step 0
        value, waited = reader.get(1)              # starved: steps 1..4 handed over at once
        assert value == 1 and waited > 0.02
        with reader._cv:
            assert all(reader._steps[s].done for s in (2, 3, 4))
        assert all(reader.get(s)[1] < 0.005 for s in (2, 3, 4))
        began = time.perf_counter()
        assert reader.get(5)[0] == 5               # 6..8 hang: 5 comes anyway
        assert time.perf_counter() - began < 1.0
    finally:
        stuck.set()
        reader.close()
