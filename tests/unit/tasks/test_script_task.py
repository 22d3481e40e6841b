"""A task class defined in a script: recorded so that `spmd train run.dir/config.yaml` resumes.

`python scripts/train_heat.py` runs the script as `__main__`; the run's config.yaml must name
something a later process can import (the script's module path, or its file), or a marker
whose error says to set `task:`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import yaml

from spmd.errors import ConfigError
from spmd.tasks.registry import UNIMPORTABLE, import_task, task_path
from tests.helpers.env import REPO, clean_env, run_spmd
from tests.helpers.records import read_jsonl

SCRIPT = textwrap.dedent('''
    import sys

    import spmd
    from spmd.tasks.regression import RegressionTask

    LOADED = []


    class ScriptTask(RegressionTask):
        """The MLP regression task, subclassed in a user's script."""


    def main(run_dir, steps):
        LOADED.append("main ran")
        config = {"model": {"d_in": 8, "d_hidden": 16, "d_out": 2, "num_layers": 1},
                  "run": {"dir": run_dir, "plots": False, "progress": False},
                  "train": {"steps": steps, "batch_size": 8}}
        return spmd.train(config, task=ScriptTask)

    {guard}
        if sys.argv[1] == "--recorded-as":
            from spmd.tasks.registry import task_path
            print(task_path(ScriptTask))
        else:
            sys.exit(main(sys.argv[1], int(sys.argv[2])))
''')


def write_script(path, guarded: bool = True):
    """The script; unguarded, it also trains at import time (no `__name__` check)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SCRIPT.replace("{guard}", 'if __name__ == "__main__":')
                    + ("" if guarded else 'main("runs/at_import", 1)\n'))
    return path


@pytest.mark.slow
def test_a_run_started_from_a_script_resumes_from_the_cli(tmp_path):
    script = write_script(tmp_path / "scripts" / "train_heat.py")
    env = clean_env(JAX_NUM_CPU_DEVICES="1")
    first = subprocess.run([sys.executable, str(script), "runs/heat", "3"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "heat"
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())["task"]
    assert recorded == "scripts.train_heat:ScriptTask"   # importable from the working directory

    again = run_spmd("train", str(run_dir / "config.yaml"), "train.steps=5", cwd=tmp_path,
                     env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]
    restored = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored"]
    assert [e["step"] for e in restored] == [3]


def test_a_script_outside_the_working_directory_is_recorded_by_its_file(tmp_path):
    script = write_script(tmp_path / "my-scripts" / "train-heat.py")
    out = subprocess.run([sys.executable, str(script), "--recorded-as"], cwd=REPO, text=True,
                         capture_output=True, env=clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    recorded = out.stdout.strip().splitlines()[-1]
    assert recorded == f"{script.resolve()}:ScriptTask"

    cls = import_task(recorded)   # imported by file, without running its __main__ block
    assert cls.__name__ == "ScriptTask" and task_path(cls) != recorded
    assert sys.modules[cls.__module__].LOADED == []
    assert import_task(recorded) is cls   # one module per file, however often resolved


def test_a_script_that_trains_at_import_gets_one_line_naming_the_guard(tmp_path):
    script = write_script(tmp_path / "unguarded.py", guarded=False)
    with pytest.raises(ConfigError) as e:
        import_task(f"{script}:ScriptTask")
    assert "called spmd.train again" in str(e.value) and "__name__" in str(e.value)
    missing = tmp_path / "moved.py"
    with pytest.raises(ConfigError, match="moved.py does not exist"):
        import_task(f"{missing}:ScriptTask")


def test_a_class_no_process_can_import_is_a_marker_and_a_one_line_error():
    from spmd.tasks.regression import RegressionTask

    class LocalTask(RegressionTask):
        pass

    recorded = task_path(LocalTask)
    assert recorded.startswith(f"{UNIMPORTABLE}:")
    with pytest.raises(ConfigError) as e:
        import_task(recorded)
    message = str(e.value)
    assert "\n" not in message and "set task: module:Class" in message
