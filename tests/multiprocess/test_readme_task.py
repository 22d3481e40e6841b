"""The README's "Your own model" task, exactly as printed, trains under `spmd run`."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.env import REPO, clean_env, run_spmd


def readme_blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def test_the_readme_task_is_short_and_complete():
    code = readme_blocks("python")[0]   # heat.py; later blocks are fragments
    assert len(code.strip().splitlines()) <= 40  # the whole file, imports and all
    assert "class HeatTask(spmd.Task)" in code and "mesh" not in code.lower().replace(
        "no mesh axis", "")


@pytest.mark.slow
def test_the_readme_task_trains_on_two_processes(tmp_path):
    code = readme_blocks("python")[0]   # heat.py; later blocks are fragments
    (config,) = readme_blocks("yaml")
    command = readme_blocks("bash")[0]  # the first: the one that trains heat.py
    (tmp_path / "heat.py").write_text(code)
    (tmp_path / "heat.yaml").write_text(config)
    args = command.split()
    assert args[:4] == ["spmd", "run", "-n", "2"]
    r = run_spmd(*args[1:], "train.steps=30", "run.progress=false", cwd=tmp_path,
                 env=clean_env(JAX_NUM_CPU_DEVICES="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "heat"
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0], losses
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["size"] for e in events if e["event"] == "started"} == {2}
    assert any(e["event"] == "saved" and e["step"] == 20 for e in events)
