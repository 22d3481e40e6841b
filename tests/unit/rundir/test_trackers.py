"""run.trackers: TensorBoard event files that TensorBoard itself reads back (scalars and the
config in the hparams plugin), an offline W&B run and an MLflow file store read back with
their own formats and clients, and the one-line errors for a tracker whose extra is not
installed or that fails to start.

W&B and MLflow come with the `dev` extra (wandb, mlflow-skinny): on CI these tests run
(tests.helpers.env.require fails there instead of skipping)."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spmd.errors import SpmdError
from spmd.rundir.trackers import (
    MLFLOW_FILE_STORE_VAR,
    TensorBoardTracker,
    create_trackers,
    flatten,
    scalars_of,
    stable_id,
)
from tests.helpers.env import require

CONFIG = {"train": {"lr": 0.1, "steps": 3, "compile": True}, "model": {"name": "mlp"},
          "mesh": {"rules": {"a": None}}, "run": {"trackers": ["tensorboard"]}}


def tensorboard_hparams(logdir: Path) -> dict[str, Any]:
    """The hyper-parameters of the hparams plugin's session_start_info in `logdir`'s events,
    as Python values (numbers as floats)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    info = metadata.parse_session_start_info_plugin_data(content)
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def unset(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Remove environment variables for one test, and whatever the test sets them to after."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_scalars_leave_out_coordinates_and_non_numbers():
    record = {"step": 3, "time": 1.7e9, "loss": 0.5, "lr": 1e-3, "ok": True, "note": "x"}
    assert scalars_of(record) == {"loss": 0.5, "lr": 1e-3}


def test_flatten_makes_dotted_scalar_hyperparameters():
    config = {"train": {"lr": 1e-3, "steps": 10}, "mesh": {"axes": {}, "rules": {"a": None}},
              "run": {"trackers": ["tensorboard"]}}
    assert flatten(config) == {"train.lr": 1e-3, "train.steps": 10, "mesh.rules.a": "None",
                               "run.trackers": "['tensorboard']"}


def test_tensorboard_files_load_in_event_accumulator(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tracker,) = create_trackers(["tensorboard"], tmp_path, {"train": {"lr": 0.1}}, "train: {}")
    assert isinstance(tracker, TensorBoardTracker)
    for step in (1, 2, 3):
        tracker.log(scalars_of({"step": step, "loss": 1.0 / step, "lr": 0.1 * step}), step)
    tracker.log({"eval_loss": 0.25}, 3)
    tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"loss", "lr", "eval_loss"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.step for e in acc.Scalars("eval_loss")] == [3]
    assert "config/text_summary" in acc.Tags()["tensors"]
    # one file per writing process: two in the same second on one host never share a name
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    assert events.name.endswith(f".{os.getpid()}")


def test_tensorboard_gets_the_resolved_config_as_hyperparameters(tmp_path):
    tracker = TensorBoardTracker(tmp_path, flatten(CONFIG))
    tracker.log({"loss": 1.0}, 1)
    tracker.close()
    assert tensorboard_hparams(tmp_path / "tensorboard") == {
        "train.lr": 0.1, "train.steps": 3.0, "train.compile": True, "model.name": "mlp",
        "mesh.rules.a": "None", "run.trackers": "['tensorboard']"}


# ------------------------------------------------------------------ W&B (offline)

WANDB_BLOCK = 32768   # the .wandb transaction log: LevelDB's log format, 32 KiB blocks


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's .wandb file (header ":W&B" + magic +
    version, then LevelDB log records: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:     # a block's tail too short for a header
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):   # zero padding, or still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                           # FULL or LAST: a whole record
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def wandb_logs(run_dir: Path, jobs: int, timeout: float = 60) -> list[list]:
    """The records of the `jobs` offline runs under run_dir/wandb, once each is complete.

    W&B's service process (wandb-core) writes the log: run.finish() may return before the
    last records reach the file, so this waits for every run's `exit` record."""
    deadline = time.monotonic() + timeout
    while True:
        logs = [wandb_records(p) for p in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")]
        done = [any(r.WhichOneof("record_type") == "exit" for r in log) for log in logs]
        if len(logs) == jobs and all(done):
            return logs
        assert time.monotonic() < deadline, (
            f"{jobs} complete W&B offline runs expected in {run_dir / 'wandb'}, found "
            f"{len(logs)} ({sum(done)} complete) after {timeout} s")
        time.sleep(0.1)


def wandb_runs(run_dir: Path, jobs: int) -> list[dict]:
    """Each offline run under run_dir/wandb, in the order of their steps: its id, project,
    config and history ({key: {step: value}})."""
    runs = []
    for log in wandb_logs(run_dir, jobs):
        run: dict = {"history": {}}
        for record in log:
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["project"] = record.run.run_id, record.run.project
                config = {}
                for item in record.run.config.update:
                    value = json.loads(item.value_json)
                    if isinstance(value, dict) and "value" in value:   # older wandb
                        value = value["value"]
                    config[item.key or ".".join(item.nested_key)] = value
                config.pop("_wandb", None)
                run["config"] = config
            elif kind == "history":
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or ".".join(item.nested_key)
                    if not key.startswith("_"):
                        run["history"].setdefault(key, {})[step] = json.loads(item.value_json)
        runs.append(run)
    return sorted(runs, key=lambda r: min(min(h) for h in r["history"].values()))


def test_wandb_offline_run_gets_the_scalars_at_their_steps_and_the_config(tmp_path,
                                                                         monkeypatch):
    require(importlib.util.find_spec("wandb") is not None,
            "wandb (pip install -e '.[dev]' or 'spmd-hpc[wandb]')")
    unset(monkeypatch, "WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):   # not in $HOME
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for steps in ((1, 2, 3), (4, 5)):   # a job, then its requeue: the same W&B run id
        (tracker,) = create_trackers(["wandb"], run_dir, CONFIG)
        for step in steps:
            tracker.log(scalars_of({"step": step, "loss": 1.0 / step, "lr": 0.1 * step}), step)
        tracker.log({"eval_loss": 0.25}, steps[-1])
        tracker.close()

    first, second = wandb_runs(run_dir, jobs=2)
    assert first["id"] == second["id"] == stable_id(run_dir) and first["project"] == "spmd"
    assert first["config"] == second["config"] == flatten(CONFIG)
    assert first["history"]["loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    assert first["history"]["lr"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert first["history"]["eval_loss"] == {3: 0.25}
    assert second["history"]["loss"] == pytest.approx({4: 0.25, 5: 0.2})
    assert second["history"]["eval_loss"] == {5: 0.25}


# ------------------------------------------------------------------ MLflow (file store)


def need_mlflow() -> None:
    require(importlib.util.find_spec("mlflow") is not None,
            "mlflow (pip install -e '.[dev]' for mlflow-skinny, or 'spmd-hpc[mlflow]')")


def test_mlflow_file_store_gets_the_scalars_at_their_steps_and_the_config(tmp_path,
                                                                          monkeypatch):
    """With nothing set, as on a compute node: MLflow 3 refuses its file store unless
    MLFLOW_ALLOW_FILE_STORE=true, which the tracker sets for the process."""
    need_mlflow()
    unset(monkeypatch, MLFLOW_FILE_STORE_VAR, "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for steps in ((1, 2, 3), (4,)):   # a job, then its requeue: one MLflow run each
        (tracker,) = create_trackers(["mlflow"], run_dir, CONFIG)
        for step in steps:
            tracker.log(scalars_of({"step": step, "loss": 1.0 / step, "lr": 0.1 * step}), step)
        tracker.log({"eval_loss": 0.25, "grad_norm": float("nan")}, steps[-1])
        tracker.close()
    assert os.environ[MLFLOW_FILE_STORE_VAR] == "true"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("spmd")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time"])
    assert len(runs) == 2
    first = runs[0]
    assert first.info.run_name == "run" and first.info.status == "FINISHED"
    assert first.data.params == {k: str(v) for k, v in flatten(CONFIG).items()}

    def history(run, key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    assert history(first, "loss") == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    assert history(first, "lr") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert history(first, "eval_loss") == {3: 0.25}
    assert history(first, "grad_norm") == {}   # non-finite values are left out
    assert history(runs[1], "loss") == {4: 0.25}


def test_a_users_mlflow_allow_file_store_is_kept_and_a_refusal_is_one_line(tmp_path,
                                                                           monkeypatch):
    need_mlflow()
    import mlflow

    require(int(mlflow.__version__.split(".")[0]) >= 3,
            f"MLflow 3 (its file store refusal); found {mlflow.__version__}")
    unset(monkeypatch, "MLFLOW_TRACKING_URI")
    monkeypatch.setenv(MLFLOW_FILE_STORE_VAR, "false")
    with pytest.raises(SpmdError, match=r"^run\.trackers: the mlflow tracker did not start "
                                        r"\(MlflowException: .*MLFLOW_ALLOW_FILE_STORE=true") as e:
        create_trackers(["mlflow"], tmp_path, CONFIG)
    assert "\n" not in str(e.value)
    assert os.environ[MLFLOW_FILE_STORE_VAR] == "false"


def test_a_tracker_that_fails_to_start_is_one_error_and_closes_those_started(tmp_path,
                                                                             monkeypatch):
    need_mlflow()
    closed = []
    monkeypatch.setattr(TensorBoardTracker, "close", lambda self: closed.append(self))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    with pytest.raises(SpmdError, match=r"^run\.trackers: the mlflow tracker did not start "
                                        r"\(.*MLFLOW_TRACKING_URI") as e:
        create_trackers(["tensorboard", "mlflow"], tmp_path, CONFIG)
    assert "\n" not in str(e.value)
    assert len(closed) == 1 and isinstance(closed[0], TensorBoardTracker)


@pytest.mark.parametrize("name,extra", [("wandb", "spmd-hpc[wandb]"),
                                        ("mlflow", "spmd-hpc[mlflow]")])
def test_missing_extra_is_one_error_naming_the_key_and_the_extra(tmp_path, monkeypatch, name,
                                                                 extra):
    # None in sys.modules: importing it raises ImportError, even where it is installed (dev)
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SpmdError, match=rf"run.trackers lists '{name}'.*pip install '"
                                        rf"{extra.replace('[', '.').replace(']', '.')}'"):
        create_trackers([name], tmp_path, {})


def test_unknown_tracker_names_the_choices(tmp_path):
    with pytest.raises(SpmdError, match="run.trackers: unknown tracker"):
        create_trackers(["neptune"], tmp_path, {})
