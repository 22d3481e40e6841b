"""run.trackers: TensorBoard event files that TensorBoard itself reads back, the scalars a
tracker receives, and the one-line error for a tracker whose extra is not installed."""

from __future__ import annotations

import builtins

import pytest

from spmd.errors import SpmdError
from spmd.rundir.trackers import TensorBoardTracker, create_trackers, flatten, scalars_of


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


@pytest.mark.parametrize("name,extra", [("wandb", "spmd-hpc[wandb]"),
                                        ("mlflow", "spmd-hpc[mlflow]")])
def test_missing_extra_is_one_error_naming_the_key_and_the_extra(tmp_path, monkeypatch, name,
                                                                 extra):
    real_import = builtins.__import__

    def no_extra(module, *args, **kwargs):
        if module.split(".")[0] == name:
            raise ImportError(f"No module named {module!r}")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_extra)
    with pytest.raises(SpmdError, match=rf"run.trackers lists '{name}'.*pip install '"
                                        rf"{extra.replace('[', '.').replace(']', '.')}'"):
        create_trackers([name], tmp_path, {})


def test_unknown_tracker_names_the_choices(tmp_path):
    with pytest.raises(SpmdError, match="run.trackers: unknown tracker"):
        create_trackers(["neptune"], tmp_path, {})
