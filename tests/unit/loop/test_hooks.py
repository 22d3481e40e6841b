"""Hooks: called every N steps and at the last; a hook stops the run by returning a `Stop`.

`StepInfo` carries no back-reference (trainer, runtime): a hook tells the trainer things only
by what it returns, and the trainer alone turns a stop into the exit status and event.
"""

from __future__ import annotations

import dataclasses

import pytest

from spmd.api import train
from spmd.config.schema import Config
from spmd.errors import ExitCode
from spmd.loop.builtin_hooks import PreemptionHook
from spmd.loop.hooks import Hook, StepInfo, Stop
from spmd.loop.trainer import Stopped, Trainer
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")




def test_step_info_holds_no_back_reference_and_is_read_only():
    fields = {f.name for f in dataclasses.fields(StepInfo)}
    assert fields == {"step", "state", "metrics", "final", "_host"}
    info = StepInfo(step=1, state=None, metrics={})
    assert not hasattr(info, "trainer") and not hasattr(info, "runtime")
    assert not hasattr(info, "stop_reason")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.final = True  # type: ignore[misc]


def test_a_hook_with_every_n_runs_every_n_steps_and_at_the_final_step(run_dir):
    seen: list[tuple[int, bool, float]] = []

    def every_four(info: StepInfo) -> None:
        seen.append((info.step, info.final, info.values["loss"]))

    code = train(mlp_config(run_dir), hooks=[(every_four, 4), (lambda info: 42, 1)])
    assert code == ExitCode.OK == 0
    assert [(step, final) for step, final, _ in seen] == [(4, False), (6, True)]
    losses = {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]  # a return value that is no Stop is ignored
    assert [loss for *_, loss in seen] == [losses[4], losses[6]]
    assert read_jsonl(run_dir / "events.jsonl")[-1]["event"] == "finished"


def test_a_hook_that_returns_stop_ends_the_run_cleanly_and_it_resumes(run_dir):
    before: list[tuple[int, bool]] = []
    after: list[tuple[int, bool]] = []

    def watch_before(info: StepInfo) -> None:
        before.append((info.step, info.final))

    def enough(info: StepInfo) -> Stop | None:
        return Stop("enough at step 3") if info.step == 3 else None

    def watch_after(info: StepInfo) -> None:  # every 5: due at step 3 only because it is final
        after.append((info.step, info.final))

    config = mlp_config(run_dir)
    config["checkpoint"] = {"every": 100}  # no step of the run is on the schedule
    code = train(config, hooks=[(watch_before, 1), (enough, 1), (watch_after, 5)])
    assert code == ExitCode.OK
    assert before == [(1, False), (2, False), (3, False)]  # before the request: not final
    assert after == [(3, True)]                             # after it: final
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    events = read_jsonl(run_dir / "events.jsonl")
    last = events[-1]
    assert (last["event"], last["step"], last["hook"], last["reason"], last["exit_code"]) == (
        "stopped", 3, "enough", "enough at step 3", 0)
    assert not any(e["event"] in ("finished", "preempted") for e in events)
    assert {e["step"] for e in events if e["event"] == "saved"} == {3}  # forced by the stop

    assert train(config) == ExitCode.OK  # the same run again: resumes and finishes
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "restored"] == [3]
    assert events[-1]["event"] == "finished" and events[-1]["step"] == 6


def test_the_first_stop_of_a_step_makes_it_final_for_the_hooks_after_it():
    calls: list[tuple[str, bool]] = []

    def recorder(name: str, result: object = None):
        def fn(info: StepInfo) -> object:
            calls.append((name, info.final))
            return result
        return fn

    hooks = [Hook(recorder("a"), 1, "a"), Hook(recorder("b", Stop("b says")), 1, "b"),
             Hook(recorder("c", Stop("c says", preempted=True)), 1, "c"),
             Hook(recorder("d"), 7, "d")]
    info, stopped = Trainer(Config())._after_update(StepInfo(step=2, state=None, metrics={}),
                                                    hooks)
    assert calls == [("a", False), ("b", False), ("c", True), ("d", True)]
    assert info.final and info.step == 2
    assert stopped is not None and stopped.hook == "b" and stopped.request == Stop("b says")


class Events:
    def __init__(self) -> None:
        self.emitted: list[dict] = []

    def emit(self, event: str, **fields: object) -> None:
        self.emitted.append({"event": event, **fields})


@pytest.mark.parametrize("stop, code, event", [
    (None, ExitCode.OK, {"event": "finished", "step": 5}),
    (("preemption", Stop("SIGTERM received", preempted=True)), ExitCode.PREEMPTED,
     {"event": "preempted", "step": 5, "reason": "SIGTERM received", "exit_code": 75}),
    (("mine", Stop("converged")), ExitCode.OK,
     {"event": "stopped", "step": 5, "hook": "mine", "reason": "converged", "exit_code": 0}),
])
def test_the_trainer_alone_turns_a_stop_into_the_exit_status(stop, code, event):
    events = Events()
    assert Trainer._end(5, Stopped(*stop) if stop else None, events) == code
    assert events.emitted == [event]


def test_the_preemption_hook_asks_for_a_preempted_stop_once_the_source_says_so():
    class Source:
        reason: str | None = None

        def should_stop(self, step: int) -> bool:
            if step >= 2:
                self.reason = "halt file found"
            return step >= 2

    hook = PreemptionHook(Source())
    assert hook(StepInfo(step=1, state=None, metrics={})) is None and hook.stop is None
    stop = Stop("halt file found", preempted=True)
    assert hook(StepInfo(step=2, state=None, metrics={})) == stop == hook.stop


def test_a_plot_that_fails_is_logged_and_the_last_save_still_commits(run_dir, caplog):
    """The plots close before the checkpoint (they are drawn while the last save is written):
    a figure that cannot be written must not cost that save."""
    run_dir.mkdir(parents=True)
    (run_dir / "plots").write_text("a file where the plots directory goes")
    config = mlp_config(run_dir, run={"plots": True}, checkpoint={"persistent_every": 6})
    with caplog.at_level("WARNING", logger="spmd.loop.trainer"):
        code = train(config)
    assert code == ExitCode.OK
    assert any("plots in" in r.getMessage() and "failed" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    events = read_jsonl(run_dir / "events.jsonl")
    assert not [e for e in events if e["event"] == "plotted"]
    assert [e["step"] for e in events if e["event"] == "saved"
            and e.get("tier") == "persistent"] == [6]
    assert events[-1]["event"] == "finished"
