"""spmd.loop.split_eval: an evaluation scores every example of a split once, whatever the
batch size: its partial last batch is padded and the padding taken out, nothing wraps round,
and `max_batches` caps it at whole batches. Checked against NumPy over a file h5py wrote,
under data parallelism and under spatial slabs (spmd.data.sources.padded_tail passes regions)."""

from __future__ import annotations

from types import SimpleNamespace

import h5py
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd.config.schema import MeshConfig
from spmd.data import ArraySource, BatchField
from spmd.data.loader.feed import BatchFeed
from spmd.data.sources.padded_tail import PaddedTail
from spmd.engine.mesh import build_mesh
from spmd.loop.split_eval import evaluate
from spmd.sharding import rules_for

GRID, BATCH = 4, 8
FIELDS = {"x": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None))}
STRATEGIES = {"dp": {}, "spatial": {"context": 4, "tensor": 2}}


@jax.jit
def metrics(params, batch):
    """Means over the batch's examples: of the values, and of each example's maximum."""
    x = batch["x"]
    return {"eval_mean": jnp.mean(x), "eval_max": jnp.mean(jnp.max(x, axis=(1, 2, 3)))}


def expected(x: np.ndarray) -> dict[str, float]:
    x = x.astype(np.float64)
    return {"eval_mean": x.mean(), "eval_max": x.max(axis=(1, 2, 3)).mean()}


def runtime(strategy: str, source, eval_batches: int = 2):
    mesh = build_mesh(MeshConfig(strategy=strategy, axes=STRATEGIES[strategy]), jax.devices())
    feed = BatchFeed(FIELDS, BATCH, mesh, rules_for(strategy), prefetch=0)
    task = SimpleNamespace(eval_source=lambda: source, eval_batches=lambda: eval_batches)
    return SimpleNamespace(eval_feed=feed, eval_step=metrics, sample_step=None, task=task)


def split(tmp_path, n: int) -> tuple[ArraySource, np.ndarray]:
    x = np.random.default_rng(n).standard_normal((n, GRID, GRID, 1)).astype(np.float32)
    with h5py.File(tmp_path / f"split{n}.h5", "w") as f:
        f["test/x"] = x
    return ArraySource(tmp_path / f"split{n}.h5", {"x": "test/x"}, FIELDS, BATCH,
                       shuffle=False), x


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("n", [13, 16, 3], ids=["tail-of-5", "whole-batches", "one-short-batch"])
def test_every_example_is_scored_once(tmp_path, strategy, n):
    source, x = split(tmp_path, n)
    got = evaluate(runtime(strategy, source), None, None, source)
    for key, want in expected(x).items():
        assert got[key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert (got["windows_scored"], got["windows_in_split"]) == (n, n)
    # a cap past the split's end scores the split once, never wrapping round to its start
    assert evaluate(runtime(strategy, source), None, None, source, max_batches=9) == got


def test_a_cap_scores_the_first_whole_batches(tmp_path):
    source, x = split(tmp_path, 29)
    rt = runtime("dp", source, eval_batches=2)
    got = evaluate(rt, None, None, source, max_batches=2)       # what training evaluates
    assert got["eval_mean"] == pytest.approx(expected(x[:16])["eval_mean"], rel=1e-5)
    assert (got["windows_scored"], got["windows_in_split"]) == (16, 29)
    whole = evaluate(rt, None, None, source)
    assert whole["eval_mean"] == pytest.approx(expected(x)["eval_mean"], rel=1e-5)
    assert whole["windows_scored"] == 29


def test_an_endless_source_reads_eval_batches():
    class Endless:                      # generated data: no count
        def rows(self, step, start, stop):
            return {"x": np.full((stop - start, GRID, GRID, 1), float(step), np.float32)}

    rt = runtime("dp", Endless(), eval_batches=3)
    got = evaluate(rt, None, None)
    assert got["eval_mean"] == pytest.approx((0 + 1 + 2) / 3)
    assert got["windows_scored"] == got["windows_in_split"] == 3 * BATCH


def test_the_padded_tail_holds_the_real_rows_then_copies(tmp_path):
    source, x = split(tmp_path, 13)
    tail = PaddedTail(source, 13, BATCH)
    np.testing.assert_array_equal(tail.rows(0, 0, BATCH)["x"],
                                  np.concatenate([x[8:13], np.repeat(x[8:9], 3, axis=0)]))
    np.testing.assert_array_equal(tail.rows(0, 3, 7)["x"],
                                  np.concatenate([x[11:13], np.repeat(x[8:9], 2, axis=0)]))
    np.testing.assert_array_equal(tail.rows(1, 2, 6)["x"], np.repeat(x[8:9], 4, axis=0))
    with pytest.raises(ValueError, match="no partial last batch"):
        PaddedTail(source, 16, BATCH)
