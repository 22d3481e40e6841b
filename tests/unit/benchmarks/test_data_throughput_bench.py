"""benchmarks/data_throughput.py in its quick mode: it works, never fails on timing, and its
figures agree with one another (rates, bytes per sample, the input-wait fraction)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.env import REPO, clean_env

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'

SCRIPT = REPO / "benchmarks" / "data_throughput.py"


def bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--dir", str(tmp_path),
                           "--json", str(out), *args], capture_output=True, text=True,
                          env=clean_env(compile_cache=False), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))   # --json FILE
    assert not list(tmp_path.glob("data-bench-*")), "the benchmark left its files behind"
    return proc, record


def test_input_wait_fraction_is_over_the_steps_after_the_first():
    spec = importlib.util.spec_from_file_location("data_throughput_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    records = [{"step": 3, "step_time_s": 0.1, "input_wait_s": 0.004},
               {"step": 1, "step_time_s": 0.5, "input_wait_s": 0.3},      # compile step
               {"step": 2, "step_time_s": 0.1, "input_wait_s": 0.001},
               {"step": 2, "eval_loss": 1.0}]                              # not a train record
    s = module.input_wait_summary(records)
    assert (s["steps"], s["first_step"]) == (2, 2)
    assert s["fraction"] == pytest.approx(0.005 / 0.2)
    assert s["max_wait_s"] == 0.004 and s["step_time_s"] == pytest.approx(0.2)
    assert module.input_wait_summary(records[1:2]) is None


def test_quick_feed_against_raw_read_in_both_formats(tmp_path):
    proc, r = bench(tmp_path, "--mb", "2", "--train-steps", "0", "--profile", "--gridded", "")
    assert r["benchmark"] == "data_throughput" and r["mode"] == "quick"
    assert r["verdict"] is None and r["train"] is None
    assert set(r["formats"]) == {"hdf5", "zarr"} and r["feed"]["read_threads"] == 1
    per_sample = 2 * 64 * 64 * 4                        # train/u0 + train/u1, float32
    for fmt, f in r["formats"].items():
        assert f["files"] == 8 and f["records"] % 8 == 0 and f["records"] >= 32
        assert f["feed_steps"] == f["records"] // 32
        assert f["disk_files"] >= (8 if fmt == "hdf5" else 8 * 2 * f["records"] // 8)
        assert f["cold_cache_applied"] is hasattr(os, "posix_fadvise")
        for cache in ("cold", "warm"):
            c = f[cache]
            assert c["raw"]["samples_per_s"] > 0 and c["feed"]["samples_per_s"] > 0
            # the feed read exactly its samples' bytes, the raw read every record's, and
            # so did the shuffled-record floor (HDF5 only: it reads the direct layouts)
            names = ("raw", "feed", "feed_sync") + (("shuffled",) if fmt == "hdf5" else ())
            assert c["sync_over_raw"]["median"] == pytest.approx(
                c["feed_sync"]["samples_per_s"] / c["raw"]["samples_per_s"], rel=1e-3)
            assert ("shuffled_over_raw" in c) is (fmt == "hdf5")
            for name in names:
                assert c[name]["MBps"] * 2**20 == pytest.approx(
                    c[name]["samples_per_s"] * per_sample, rel=1e-6)
            assert c["ratio"]["n"] == 1 and c["ratio"]["median"] == pytest.approx(
                c["feed"]["samples_per_s"] / c["raw"]["samples_per_s"], rel=1e-3)
            if fmt == "hdf5":
                assert c["feed_over_shuffled"]["median"] == pytest.approx(
                    c["feed"]["samples_per_s"] / c["shuffled"]["samples_per_s"], rel=1e-3)
        p = f["profile"]
        assert min(p["us_per_sample"].values()) > 0 and p["top_own_time"]
        assert {"index_lookup", "store_reads", "source_rows", "global_batch_sync",
                "global_batch_prefetch_2_threads_1", "global_batch_prefetch_2_threads_4",
                "raw_whole_files"} <= set(p["us_per_sample"])
    assert "feed/raw" in proc.stdout and "quick mode" in proc.stdout


def test_quick_training_run_reports_the_input_wait_fraction(tmp_path):
    tiny = ["model.depth=1", "model.embed=16", "model.mlp=16", "data.num_train=64",
            "data.num_test=16"]
    _, r = bench(tmp_path, "--formats", "hdf5", "--mb", "1", "--no-cold", "--gridded", "",
                 "--config", "examples/vit2d/config.yaml", "--train-steps", "4",
                 *[a for s in tiny for a in ("--set", s)])
    assert set(r["formats"]["hdf5"]) >= {"warm"} and "cold" not in r["formats"]["hdf5"]
    t = r["train"]
    assert t["config"] == "examples/vit2d/config.yaml" and t["batch_size"] == 16
    assert (t["steps"], t["first_step"]) == (3, 2)    # steps 2..4: the first is left out
    assert 0 <= t["fraction"] < 1
    assert t["fraction"] == pytest.approx(t["input_wait_s"] / t["step_time_s"])
    assert t["consumed_samples_per_s"] == pytest.approx(16 * 3 / t["step_time_s"])
    raw = t["raw"]
    assert raw["datasets"] == ["train/f", "train/u"] and raw["samples"] == 64
    assert raw["bytes_per_sample"] == t["feed_bytes_per_sample"] == 2 * 32 * 32 * 4
    assert raw["warm"]["samples_per_s"] > 0 and "cold" not in raw
    assert isinstance(t["raw_outruns_consumption"], bool)
    assert "run.log_every=1" in t["command"] and "train.steps=4" in t["command"]


def test_short_gridded_cases_report_feed_over_plain_read_per_layout(tmp_path):
    """The xarray-written weather layouts (issue 35, packed for issue 49): each reports paired
    feed / plain-read, feed / plain-windows and feed / xarray-loop ratios, cold and warm,
    over the same windows; no target is checked in --short."""
    proc, r = bench(tmp_path, "--formats", "", "--train-steps", "0", "--gridded-steps", "40")
    assert r["formats"] == {} and r["verdict"] is None
    g = r["gridded"]
    assert g["variables"] == ["t2m", "u10", "v10", "msl"] and g["raw_block_steps"] == 256
    assert set(g["layouts"]) == {"nc_plain", "nc_packed", "nc_zlib_default", "nc_zlib_1xy",
                                 "zarr_t4"}
    for name, layout in g["layouts"].items():
        assert layout["windows"] == 2 * 40 - 1          # (t, t+1) across the two files
        assert layout["feed_steps"] == layout["windows"] // 32
        assert isinstance(layout["layout_warnings"], list)
        for cache in ("cold", "warm"):
            c = layout[cache]
            feed, raw = c["feed"]["samples_per_s"], c["raw"]["samples_per_s"]
            assert feed > 0 and raw > 0
            assert c["ratio"]["n"] == 1
            assert c["ratio"]["median"] == pytest.approx(feed / raw, rel=1e-3)
            windows = c["windows"]["samples_per_s"]     # the hand-written loader's windows
            assert c["ratio_plain_windows"]["median"] == pytest.approx(feed / windows, rel=1e-3)
            loop = c["xarray"]["samples_per_s"]         # the xarray loop (issue 49)
            assert loop > 0
            assert c["ratio_xarray_loop"]["median"] == pytest.approx(feed / loop, rel=1e-3)
        assert f"{name} " in proc.stdout
    assert "feed/plain windows" in proc.stdout and "feed/xarray loop" in proc.stdout


def test_full_mode_with_nothing_to_measure_does_not_crash(tmp_path):
    """`--formats ""` once crashed the verdict (min() of no ratio)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--formats", "", "--gridded", "",
                           "--train-steps", "0", "--dir", str(tmp_path)], capture_output=True,
                          text=True, env=clean_env(compile_cache=False), timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: feed/raw (gridded: feed/plain windows) n/a" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1])["verdict"] == "PASS"
