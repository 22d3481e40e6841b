"""benchmarks/gpu_check.py (issue 39): every GPU figure from one command. On CPU, its
`--cpu-smoke` runs every part through the same code at tiny sizes and writes the same keys;
the time budget and the isolation of a failing part are checked with stand-in parts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.env import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402

FIGURES = {   # what each part must report for the GPU figures of issue 39
    "devices": {"backend", "devices", "device_kind", "device_count", "versions", "xla_flags"},
    "main_job": {"samples_per_s_median", "test_rel_l2_first", "test_rel_l2_last"},
    "mfu_1.3b": {"mfu", "step_s", "plain_step_s", "ratio", "compile_s", "peak_bytes",
                 "measured_peak_bytes", "plan_over_measured", "fits"},
    "mfu_3.3b-w4096": {"mfu", "step_s", "plain_step_s", "ratio", "compile_s", "peak_bytes",
                       "measured_peak_bytes", "plan_over_measured", "fits"},
    "remat_2.7b": {"fits", "mfu", "remat", "peak_bytes"},
    "checkpoint": {"state_bytes", "modes"},
    "features": {"attention_cudnn", "snapshot_pinned", "plan_system"},
}


@pytest.mark.slow
def test_cpu_smoke_runs_every_part_and_writes_the_json_and_the_table(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"),
                           "--out", str(tmp_path), "--cpu-smoke"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["mode"] == "cpu-smoke" and tuple(record["parts"]) == gpu_check.PARTS
    for name, keys in FIGURES.items():
        part = record["parts"][name]
        assert part["status"] == "ok", (name, part)
        assert keys <= set(part["figures"]), (name, sorted(part["figures"]))
        # on CPU both MFU parts are the same tiny command: it runs once (in mfu_1.3b), and
        # the other part reports that run, in no time of its own
        reused = part.get("same_run_as") is not None
        assert (0 <= part["seconds"] if reused else 0 < part["seconds"]), (name, part)
        assert part["seconds"] <= part["limit_s"] + 5, (name, part)
    figures = {n: record["parts"][n]["figures"] for n in FIGURES}
    assert record["parts"]["mfu_3.3b-w4096"]["same_run_as"] == "mfu_1.3b"
    assert figures["mfu_3.3b-w4096"] == figures["mfu_1.3b"]
    assert [n for n in FIGURES if "same_run_as" in record["parts"][n]] == ["mfu_3.3b-w4096"]
    assert figures["devices"]["backend"] == "cpu"
    assert 0 < figures["main_job"]["test_rel_l2_last"] < 2
    assert figures["main_job"]["samples_per_s_median"] > 0
    assert figures["mfu_1.3b"]["step_s"]["median"] > 0 and figures["mfu_1.3b"]["ratio"]
    # gpu_mfu.py without --compare (the remat part): its code path on CPU, GPU flags applied
    remat = figures["remat_2.7b"]
    assert remat["tokens_per_s"] > 0 and remat["mfu"] is not None
    assert remat["model_flops_per_step"] > 0 and remat["fits"] and remat["remat"] == "dots"
    assert any("latency_hiding_scheduler" in f for f in remat["xla_flags"]), remat["xla_flags"]
    modes = figures["checkpoint"]["modes"]
    assert set(modes) == set(gpu_check.CHECKPOINT_MODES)
    for mode in modes.values():
        assert mode["local_blocking_s"] > 0 and mode["orbax_blocking_s"] > 0
        assert mode["restored"] == [2, "local"] and mode["local_restore_s"] > 0
    assert all(figures["features"][k]["pass"] for k in FIGURES["features"])
    assert set(record["targets"]) == set(gpu_check.verdicts({}))
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} | ok |" in table for name in gpu_check.PARTS), table


def test_a_failing_part_does_not_stop_the_others_and_its_error_is_kept(tmp_path, monkeypatch):
    ran = []

    def part(name, smoke, out, limit_s):
        ran.append(name)
        if name == "mfu_1.3b":
            raise RuntimeError("the plain-JAX step ran out of memory")
        if name == "checkpoint":
            return {"status": "timeout", "error": "ran past its 100 s"}
        return {"status": "ok", "figures": {}}

    monkeypatch.setattr(gpu_check, "run_part", part)
    assert gpu_check.main(["--out", str(tmp_path), "--cpu-smoke"]) == 1
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert ran == list(gpu_check.PARTS)
    parts = record["parts"]
    assert parts["mfu_1.3b"]["status"] == "failed"
    assert "ran out of memory" in parts["mfu_1.3b"]["error"]
    assert parts["checkpoint"]["status"] == "timeout" and parts["features"]["status"] == "ok"
    assert "ran out of memory" in (tmp_path / "gpu_check.md").read_text()


def test_parts_past_the_budget_are_skipped_with_the_reason(tmp_path, monkeypatch):
    clock = {"now": 0.0}
    ran = []

    def part(name, smoke, out, limit_s):
        ran.append(name)
        clock["now"] += 0.97 * 1000 if name == "devices" else 1.0   # it overran its limit
        return {"status": "ok", "figures": {}}

    monkeypatch.setattr(gpu_check, "run_part", part)
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock["now"])
    assert gpu_check.main(["--out", str(tmp_path), "--budget-s", "1000"]) == 0
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert ran == ["devices"]          # 30 s left: under half of every later part's share
    for name in gpu_check.PARTS[1:]:
        assert parts[name]["status"] == "skipped", (name, parts[name])
        assert "used 970 s of the 1000 s budget; 30 s left" in parts[name]["reason"], \
            parts[name]["reason"]


def test_a_part_may_use_what_the_parts_before_it_left(tmp_path, monkeypatch):
    limits = {}

    def part(name, smoke, out, limit_s):
        limits[name] = limit_s
        return {"status": "ok", "figures": {}}

    monkeypatch.setattr(gpu_check, "run_part", part)
    gpu_check.main(["--out", str(tmp_path), "--budget-s", "1000"])
    shares = [gpu_check.SHARES[n] * 1000 for n in gpu_check.PARTS]
    assert limits["devices"] == pytest.approx(shares[0], abs=1)
    # nothing used: each later part may take its own share and all the earlier ones'
    assert limits["features"] == pytest.approx(sum(shares), abs=2)
