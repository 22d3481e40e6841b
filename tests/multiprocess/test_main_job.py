"""The README's main command, run as a new user would, in a fresh clone of this repo."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.env import REPO, clean_env

README = (REPO / "README.md").read_text()


def readme_main_command() -> list[str]:
    """The first command under 'Run the main job', split at its `&&`."""
    block = README.split("Run the main job", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", block, re.S).group(1).strip()
    return [part.strip() for part in command.split("&&")]


def readme_claim() -> tuple[float, float, int]:
    """(initial, final, steps) from the README's stated test error."""
    text = " ".join(README.split())
    m = re.search(r"test relative L2 error falls from ([\d.]+) at step 0 to ([\d.]+) "
                  r"after (\d+) steps", text)
    assert m, "README must state the measured test error of the main job"
    return float(m.group(1)), float(m.group(2)), int(m.group(3))


@pytest.mark.slow
def test_readme_main_command_in_a_fresh_clone(tmp_path):
    install, *rest = readme_main_command()
    assert install.startswith("pip install -e '.[local"), install  # done by the test runner
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = clean_env(PYTHONPATH=str(clone))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    for command in rest:
        r = subprocess.run(shlex.split(command), cwd=clone, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, f"{command}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    run_dir = clone / "runs" / "fno_darcy"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evals = [r for r in records if "test_rel_l2" in r]
    train = [r for r in records if "loss" in r]
    claimed_initial, claimed_final, steps = readme_claim()
    assert train[-1]["step"] == steps
    assert evals[0]["step"] == 0 and evals[-1]["step"] == steps
    initial, final = evals[0]["test_rel_l2"], evals[-1]["test_rel_l2"]
    assert final <= initial / 2, (initial, final)  # falls by at least half
    assert final <= claimed_final * 1.5, (final, claimed_final)
    assert abs(initial - claimed_initial) <= 0.25 * claimed_initial
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    assert any(e["event"] == "saved" and e.get("tier") == "persistent" for e in events)
    for png in ("loss.png", "test_error.png", "throughput.png", "samples.png"):
        assert (run_dir / "plots" / png).stat().st_size > 5000, png
    assert "ETA" in r.stderr or "step " in r.stderr  # rank-0 progress
