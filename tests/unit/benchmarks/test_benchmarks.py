"""The benchmarks run in CI in their short modes: they must work, never fail on timing.

step_overhead's three extra cases (stragglers, recipe, tensorboard) run in one process
(`--short --cases stragglers,recipe,tensorboard`, the `step_overhead_cases` fixture) rather
than one each: each test reads its own case's result.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.env import REPO, clean_env

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'


def bench(script: str, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=clean_env(compile_cache=False),
                          timeout=600, cwd=REPO)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    try:
        return proc, json.loads(last)
    except json.JSONDecodeError:
        return proc, None


def test_step_overhead_short():
    proc, record = bench("step_overhead.py", "--short")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record is not None and record["mode"] == "short" and record["verdict"] is None
    cases = {r["case"]: r for r in record["results"]}
    assert set(cases) == {"dispatch-1dev", "compute"}
    for r in cases.values():
        assert r["spmd_ms"]["median"] > 0 and r["plain_ms"]["median"] > 0
        assert r["paired_ratio"]["median"] > 0
    assert cases["dispatch-1dev"]["devices"] == 1 and cases["compute"]["devices"] == 8
    assert "added us/step" in proc.stdout


def test_gpu_mfu_skips_without_a_gpu():
    proc, _ = bench("gpu_mfu.py")
    assert proc.returncode == 0, proc.stderr
    assert "no GPU: skipped" in proc.stdout


def test_gpu_mfu_tiny_compare_reports_ratio_mfu_and_compile_times():
    """--size tiny runs on CPU: spmd against the plain-JAX step, interleaved, in one process."""
    proc, record = bench("gpu_mfu.py", "--size", "tiny", "--compare", "--remat",
                         "save_attention", "--loss-chunk", "16", "--steps", "1", "--reps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record["compare"] is True and record["backend"] == "cpu" and record["verdict"] is None
    (r,) = record["results"]
    assert r["size"] == "tiny" and r["fits"] and r["scan_layers"] is True
    assert (r["remat"], r["attention"], r["loss_chunk"]) == ("save_attention", "xla", 16)
    assert r["first_loss"]["spmd"] == pytest.approx(r["first_loss"]["plain"], rel=2e-2)
    assert r["compile_s"] > 0 and r["plain_compile_s"] > 0
    assert r["step_s"]["median"] > 0 and r["plain_step_s"]["median"] > 0
    assert r["ratio"]["median"] > 0 and r["ratio"]["n"] == 2 and len(r["ratio_ci95"]) == 2
    assert r["mfu"] is not None and r["plain_mfu"] is not None
    assert "spmd/plain" in proc.stdout


@pytest.mark.slow
def test_pipeline_bubble_short_reports_the_model_and_1f1b_memory():
    proc, out = bench("pipeline_bubble.py", "--short")
    assert proc.returncode == 0 and out is not None, proc.stdout + proc.stderr
    assert out["benchmark"] == "pipeline_bubble" and out["stages"] == 4
    assert 1.5 < out["backward_cost"] < 3.0             # XLA: backward ~ 2 x forward FLOPs
    by = {(r["schedule"], r["microbatches"]): r for r in out["results"]}
    assert set(by) == {(s, m) for s in ("gpipe", "1f1b") for m in (1, 2)}
    assert out["fits"]["gpipe"]["k_model"] == out["fits"]["1f1b"]["k_model"] == 3.0
    b = out["backward_cost"]
    assert out["recompute"]["model"] == pytest.approx((3 + b) / (1 + b))
    for (_, m), r in by.items():
        assert r["batch_size"] == 8 * m                 # fixed microbatch size, M varies
        assert r["bubble_model"] == pytest.approx(3 / (m + 3))  # (p - 1) / (M + p - 1)
        # a timing smoke test: a noisy fit may make no sense (then it says so with None)
        assert r["step_s"] > 0 and (r["bubble_measured"] is None or r["bubble_measured"] <= 1)
    # 1F1B keeps a ring of stage inputs, not every tick's residuals: fewer temporaries, and
    # they grow less from M = 1 to 2 (GPipe adds a tick's residuals per microbatch).
    gp, ofob = ([by[(s, m)]["temp_bytes"] for m in (1, 2)] for s in ("gpipe", "1f1b"))
    assert ofob[0] < gp[0] and ofob[1] < gp[1]
    assert ofob[1] - ofob[0] < gp[1] - gp[0]


@pytest.fixture(scope="module")
def step_overhead_cases():
    """step_overhead --short with the stragglers, recipe and tensorboard cases, one process:
    (process, case name -> its result)."""
    proc, record = bench("step_overhead.py", "--short", "--cases", "stragglers,recipe,tensorboard")
    assert proc.returncode == 0 and record is not None, proc.stdout + proc.stderr
    cases = {r["case"]: r for r in record["results"]}
    assert len(cases) == len(record["results"]) == 3, record["results"]
    return proc, cases


def test_step_overhead_stragglers_short_measures_monitor_and_finite_checks_against_off(
        step_overhead_cases):
    """The straggler gather + the non-finite checks against both off, in one process."""
    proc, cases = step_overhead_cases
    r = cases["stragglers"]
    assert r["case"] == "stragglers" and r["verdict"] is None and r["devices"] == 1
    assert r["is_finite_ops"]["on"] > r["is_finite_ops"]["off"]   # "off" lacks the checks
    assert r["on_ms"]["median"] > 0 and r["off_ms"]["median"] > 0
    assert r["paired_ratio"]["median"] > 0 and r["monitor_us_per_step"] > 0
    assert "straggler monitor + finite checks" in proc.stdout


def test_step_overhead_recipe_short_times_spmd_against_the_hand_written_recipe(
        step_overhead_cases):
    """grad_accum + EMA + clipping: spmd's step against the same recipe in plain optax."""
    proc, cases = step_overhead_cases
    r = cases["recipe"]
    assert r["case"] == "recipe" and r["verdict"] is None and r["devices"] == 1
    assert r["recipe"]["grad_accum"] == 4 and r["recipe"]["ema_decay"] == 0.999
    assert r["spmd_ms"]["median"] > 0 and r["off_ms"]["median"] > 0
    assert r["paired_ratio"]["median"] > 0
    assert "recipe (grad_accum=4" in proc.stdout


def test_step_overhead_tensorboard_short_measures_the_tracker_against_off(step_overhead_cases):
    """spmd's step + metrics hook with run.trackers=[tensorboard] against trackers off."""
    proc, cases = step_overhead_cases
    r = cases["tensorboard"]
    assert r["case"] == "tensorboard" and r["verdict"] is None and r["devices"] == 1
    assert r["tensorboard_ms"]["median"] > 0 and r["off_ms"]["median"] > 0
    assert r["paired_ratio"]["median"] > 0 and len(r["paired_ratio_ci95"]) == 2
    # every step of the warm-up round and of the 3 repetitions, 5 steps each, was logged
    assert r["scalars_logged_per_tag"] == (1 + r["reps"]) * r["steps_per_rep"] == 20
    assert r["event_files"] == {"off": 0, "tensorboard": 1}   # "off" wrote no events
    assert "TensorBoard tracker" in proc.stdout and "short mode, no target" in proc.stdout
