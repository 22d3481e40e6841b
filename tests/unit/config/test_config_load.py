"""Loading a config: an error names the key and where it was set, the YAML file or the
command line (with the override as given)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spmd.config import load_config
from spmd.config.load import load_run_sections
from spmd.errors import ConfigError
from tests.helpers.env import REPO, clean_env

FNO = REPO / "configs" / "fno_darcy.yaml"


@pytest.mark.parametrize(("override", "message"), [
    ("train.steps=abc", "Input should be a valid integer"),
    ("model.modes=many", "Input should be a valid integer"),            # the task's section
    ("train.stepz=3", "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    ("run.profile.steps=[5, 2]", "1 <= start <= stop"),                # a section's validator
    ("train={steps: abc}", "Input should be a valid integer"),         # a whole section
])
def test_an_override_is_blamed_on_the_command_line_with_its_value(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(FNO, [override])
    text = str(e.value)
    assert text.startswith(f"command line: {override}: "), text
    assert message in text
    assert str(FNO) not in text


def test_an_error_in_the_file_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: abc\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["train.batch_size=4"])   # a good override is not blamed
    assert str(e.value).startswith(f"{path}: train.steps: Input should be a valid integer")
    assert "command line" not in str(e.value)


def test_errors_from_both_places_are_each_blamed_on_their_own(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: abc\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["train.batch_size=0"])
    text = str(e.value)
    assert f"{path}: train.steps: Input should be a valid integer" in text
    assert "command line: train.batch_size=0: Input should be greater than or equal to 1" in text


def test_an_unknown_key_in_the_file_names_the_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml: unknown config key 'train\.stpes'"):
        load_config(path, ["train.steps=4"])


@pytest.mark.parametrize(("override", "message"), [
    ("checkpoint.every=abc", "Input should be a valid integer"),
    ("chekpoint.every=3", "unknown config key 'chekpoint'"),
    ("train.stepz=3", "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
])
def test_run_sections_check_every_section_but_the_tasks_as_load_config_does(override, message):
    """`spmd run` and `spmd ckpt` read run/checkpoint/launch without the task: the other
    sections are still checked, and blamed on where they were set; `model:` is the ranks'."""
    with pytest.raises(ConfigError) as e:
        load_run_sections(FNO, [override])
    assert str(e.value).startswith(f"command line: {override}: ") and message in str(e.value)
    sections = load_run_sections(FNO, ["model.widht=3", "task=nowhere:Nothing",
                                       "launch.kill_wait_s=7"])
    assert sections.launch.kill_wait_s == 7 and str(sections.run.dir) == "runs/fno_darcy"
    assert sections.checkpoint == load_config(FNO).checkpoint


def test_reading_the_run_sections_imports_neither_jax_nor_the_task():
    """What `spmd run` costs before its ranks start: no JAX import (about 2 s of CPU)."""
    code = ("import sys\n"
            "from spmd.config.load import load_run_sections\n"
            f"s = load_run_sections({str(FNO)!r}, ['run.dir=/tmp/elsewhere'])\n"
            "print(s.run.dir, s.checkpoint.every, sorted(m for m in ('jax', 'flax', 'optax')\n"
            "      if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=clean_env(), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["/tmp/elsewhere", "50", "[]"], r.stdout


def test_sections_are_importable_from_spmd_config_and_spmd():
    """User code keeps `from spmd.config import XConfig` (and spmd.Config, spmd.ModelConfig),
    each section now defined next to its component."""
    import spmd
    import spmd.config as config

    assert config.CheckpointConfig.__module__ == "spmd.checkpoint.policy"
    assert config.TrainConfig.__module__ == "spmd.engine.engine_config"
    assert config.LaunchConfig.__module__ == "spmd.launch.launch_config"
    assert config.DataConfig.__module__ == "spmd.data.data_config"
    assert config.RunConfig.__module__ == "spmd.rundir.run_config"
    assert spmd.ModelConfig is config.ModelConfig
    assert spmd.Config().train == config.TrainConfig()


def test_spmd_train_blames_a_bad_override_on_the_command_line(tmp_path):
    """The issue's case, as a user runs it: one line, no traceback, the override echoed."""
    from tests.helpers.env import clean_env, run_spmd

    r = run_spmd("train", str(FNO), "train.steps=abc", f"run.dir={tmp_path / 'run'}",
                 env=clean_env())
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert "command line: train.steps=abc: Input should be a valid integer" in r.stderr
    assert f"{FNO}: train.steps" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_overrides_of_a_dict_config_are_blamed_on_the_overrides():
    from spmd.api import as_config

    with pytest.raises(ConfigError) as e:
        as_config({"model": {"name": "mlp"}}, ["train.batch_size=big"])
    assert str(e.value).startswith("command line: train.batch_size=big: "), str(e.value)
    with pytest.raises(ConfigError, match=r"^<dict>: train\.steps: "):
        as_config({"model": {"name": "mlp"}, "train": {"steps": "many"}}, ["train.seed=1"])


WEATHER = REPO / "configs" / "weather_era5.yaml"


def test_split_times_as_yaml_writes_them_and_impossible_dates(tmp_path):
    """YAML reads `2016-12-31T18:00:00` as a datetime and `2016-12-31` as a date: both are
    split times, and so is a year. A date no calendar has, or another number, fails in one
    line naming where; a day only another calendar has (2018-02-30) is kept as written."""
    cfg = load_config(WEATHER, ["data.splits.train.end=2016-12-31T18:00:00",
                                "data.splits.test.start=2018-01-01 06:00:00+02:00"])
    assert cfg.data.splits["train"].end == "2016-12-31T18:00:00"
    assert cfg.data.splits["test"].start == "2018-01-01T04:00:00"       # taken in UTC
    assert cfg.data.splits["train"].start == "2010-01-01"               # a YAML date
    assert load_config(WEATHER, ["data.splits.test.start=2018"]).data.splits[
        "test"].start == "2018"                                         # a year, as xarray
    with pytest.raises(ConfigError) as e:
        load_config(WEATHER, ["data.splits.test.start=2018.5"])
    assert "data.splits.test.start" in str(e.value) and "not a date or time" in str(e.value)
    # a day of another calendar (360_day) is kept as written, for the data's calendar
    days360 = tmp_path / "days360.yaml"
    days360.write_text(WEATHER.read_text().replace("start: 2018-01-01", "start: 2018-02-30"))
    assert load_config(days360).data.splits["test"].start == "2018-02-30"
    bad = tmp_path / "bad.yaml"
    bad.write_text(WEATHER.read_text().replace("start: 2018-01-01", "start: 2018-02-31"))
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value).startswith(f"config file {bad}: line ") and "'2018-02-31'" in str(e.value)
    assert "day is out of range" in str(e.value)
    with pytest.raises(ConfigError, match="2018-13-01.*does not parse as YAML"):
        load_config(WEATHER, ["data.splits.test.start=2018-13-01"])
