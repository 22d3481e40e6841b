"""The hang watchdog's clock and report, in one process (the multi-process behaviour, a
stopped rank named and killed, is tests/multiprocess/test_run_health.py)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from spmd.comm import hang_watchdog
from spmd.comm.hang_watchdog import HangReport, StepWatchdog, automatic_timeout, publish_host
from spmd.config.schema import Config
from spmd.errors import ExitCode
from spmd.launch.env import LaunchEnv

ENV = LaunchEnv(rank=0, size=1, local_rank=0, local_size=1, node_id=0, num_nodes=1,
                hostname="nid001", job_id=None, restart_count=0, launcher="single",
                coordinator=None)


class Recording(StepWatchdog):
    """Records expiries instead of ending the process."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.expired: list[tuple[int, float]] = []

    def _expire(self, step: int, waited: float) -> None:
        self.expired.append((step, waited))
        self.stop()


def test_automatic_timeout_is_600_s_or_20_median_steps():
    assert automatic_timeout([]) == 600.0
    assert automatic_timeout([0.1] * 50) == 600.0
    assert automatic_timeout([40.0, 50.0, 60.0]) == 1000.0
    assert Config().launch.step_timeout_s is None   # automatic by default


def test_a_beating_loop_never_expires_and_a_silent_one_does():
    dog = Recording(ENV, 0.5).start(3)
    for step in range(4, 12):
        time.sleep(0.1)
        dog.beat(step)
    assert dog.expired == []
    deadline = time.monotonic() + 5
    while not dog.expired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dog.expired and dog.expired[0][0] == 11 and dog.expired[0][1] >= 0.5


def test_an_excused_save_is_not_a_hung_step_and_restarts_the_clock():
    dog = Recording(ENV, 0.4).start(0)
    with dog.excused():
        time.sleep(1.0)
    time.sleep(0.2)
    assert dog.expired == []
    dog.stop()


def test_zero_turns_it_off_and_automatic_uses_the_steps_after_warm_up():
    assert not StepWatchdog(ENV, 0).enabled
    dog = StepWatchdog(ENV, None)
    for step in range(20):
        dog.beat(step)
    assert dog.enabled and dog.timeout_s == 600.0 and len(dog._times) == 15


@pytest.mark.parametrize("stuck, expected", [
    ({1: "no answer (stopped, dead, or stuck outside Python)"},
     "ranks that did not reach step 8: rank 1: no answer"),
    ({}, "every rank reached step 7 and none completed step 8"),
])
def test_the_report_names_the_ranks_that_did_not_reach_the_step(stuck, expected):
    report = HangReport(reporter=0, step=7, waited_s=12.3, timeout_s=10, stuck=stuck,
                        hosts={0: "nid001"})
    line = report.line()
    assert expected in line
    assert "launch.step_timeout_s=10" in line and f"status {ExitCode.HUNG:d}" in line
    assert report.to_dict()["stuck"] == {str(k): v for k, v in stuck.items()}


class Store:
    """The jax.distributed key-value calls the watchdog makes, in memory; `answers=False`:
    the store is gone (its rank 0 is the stopped one)."""

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.answers = True

    def key_value_set(self, key: str, value: str) -> None:
        if not self.answers:
            raise RuntimeError("UNAVAILABLE: failed to connect")
        if key in self.kv:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if not self.answers:
            raise RuntimeError("UNAVAILABLE: failed to connect")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_a_rank_that_posts_nothing_is_named_with_its_host(monkeypatch):
    """Every rank posts its host at bootstrap; the report names the host of a rank that
    never answers (SIGSTOP), and of rank 0 when the store it serves is gone."""
    store = Store()
    monkeypatch.setattr(hang_watchdog, "kv_client", lambda: store)
    envs = [replace(ENV, rank=r, size=2, hostname=f"nid00{r + 1}") for r in range(2)]
    assert all(publish_host(env) for env in envs)
    dogs = [StepWatchdog(env, 30, grace_s=0).start(7) for env in envs]
    try:
        report = dogs[0]._report(7, 31.0, 30)   # rank 1 is stopped: it posts no step
        assert report is not None and report.stuck == {
            1: "no answer (stopped, dead, or stuck outside Python)"}
        assert "rank 1 on nid002: no answer" in report.line()
        assert report.to_dict()["hosts"]["1"] == "nid002"

        store.answers = False                   # rank 0, which serves the store, is stopped
        report = dogs[1]._report(7, 31.0, 30)
        assert report is not None and list(report.stuck) == [0]
        assert "rank 0 on nid001: the jax.distributed coordination service" in report.line()
    finally:
        for dog in dogs:
            dog.stop()
