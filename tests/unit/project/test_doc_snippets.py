"""The documentation's Python snippets (issue 36 item 5).

Every ```python block of README.md and docs/ runs as written unless it is marked
`# not run: <why>` (tests/helpers/doc_snippets.py): tests/multiprocess/test_main_job.py runs
them all verbatim after the README's main job. Here, fast: the marking, that each runnable
snippet compiles, and the two recipes that failed as written (issue 36): Flax's NNX restore
of `spmd export`'s params for a model annotated with `nnx.with_partitioning` (eager
sharding), and plain Orbax given the relative path the snippet uses.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from tests.helpers.doc_snippets import NOT_RUN, all_snippets

SNIPPETS = all_snippets()


def snippet(page: str, contains: str) -> str:
    found = [s for s in SNIPPETS if s.page == page and contains in s.code]
    assert len(found) == 1, (page, contains, [s.where for s in found])
    assert found[0].runnable, found[0].where
    return found[0].code


def test_every_snippet_runs_or_says_why_not():
    assert len(SNIPPETS) >= 8
    for s in SNIPPETS:
        if s.runnable:
            compile(s.code, s.where, "exec")   # a syntax error fails here, not in the slow run
        else:
            reason = s.code.lstrip().splitlines()[0][len(NOT_RUN):].strip(" :")
            assert reason, f"{s.where}: say why after '{NOT_RUN}:'"
    runnable = {s.page for s in SNIPPETS if s.runnable}
    assert {"README.md", "docs/using_a_trained_run.md", "docs/own_model.md"} <= runnable


def test_flax_restore_recipe_builds_a_with_partitioning_model_with_no_mesh(tmp_path,
                                                                           monkeypatch):
    """The docs' recipe, its model swapped for one annotated with nnx.with_partitioning
    (tests/helpers/flax_native.py), restores what `spmd export` writes; without the
    recipe's `use_eager_sharding(False)` building it abstractly asks for a mesh."""
    import orbax.checkpoint as ocp

    from tests.helpers.flax_native import FlaxLM

    def lm(**_):
        return FlaxLM(64, 32, 8, 64, 1, 16, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match="mesh"):   # the failure the issue reported
        nnx.eval_shape(lambda: lm(rngs=nnx.Rngs(0)))
    with nnx.use_eager_sharding(False):
        model = lm()
    monkeypatch.chdir(tmp_path)
    with ocp.StandardCheckpointer() as checkpointer:     # as spmd export writes OUT/params
        checkpointer.save((tmp_path / "exported" / "params").absolute(), nnx.state(model))
    code = snippet("docs/using_a_trained_run.md", "nnx.use_eager_sharding(False)")
    import_line = "from spmd.models.fno import FNO2d"
    assert import_line in code and ".absolute()" in code
    scope: dict = {"lm": lm}
    exec(compile(code.replace(import_line, "FNO2d = lm"), "flax recipe", "exec"), scope)
    got = jax.tree.leaves(nnx.state(scope["model"]))
    want = jax.tree.leaves(nnx.state(model))
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_plain_orbax_snippet_takes_its_relative_path(tmp_path, monkeypatch):
    """Run verbatim in a directory whose runs/fno_darcy/checkpoints/200/params is an Orbax
    item of a pure dict, as spmd's persistent tier writes it."""
    import orbax.checkpoint as ocp

    params = {"layer": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
                        "bias": np.ones(4, np.float32)}}
    monkeypatch.chdir(tmp_path)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "runs/fno_darcy/checkpoints/200/params", params)
    scope: dict = {}
    exec(compile(snippet("docs/using_a_trained_run.md", "checkpointer.metadata"),
                 "plain orbax", "exec"), scope)
    assert jax.tree.map(np.asarray, scope["params"]).keys() == params.keys()
    np.testing.assert_array_equal(scope["params"]["layer"]["kernel"], params["layer"]["kernel"])
