"""Straggler detection in one process: the monitor with a made-up clock and group, its gather
over the key-value store with ranks as threads, `spmd report`'s list, and the slow-rank fault."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from spmd.comm import RankGroup
from spmd.launch import resolve_launch_env
from spmd.loop.hooks import StepInfo
from spmd.loop.stragglers import StragglerMonitor
from spmd.rundir.stragglers_report import format_stragglers, stragglers
from tests.helpers.env import REPO, clean_env
from tests.helpers.fault_injection import SLOW_RANK, fault_env
from tests.unit.comm.test_comm import FakeStore, envs, on_ranks, store  # noqa: F401 - a fixture


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Events:
    def __init__(self) -> None:
        self.emitted: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.emitted.append({"event": event, **fields})


class Gathered:
    """A group whose other ranks report the given times (this rank's own is gathered)."""

    def __init__(self, rank: int, others: dict[int, float]):
        self.rank, self.others, self.calls = rank, others, []

    def allgather_str(self, text: str, what: str) -> list[str]:
        self.calls.append(what)
        rows = {r: f"{s} host{r}" for r, s in self.others.items()}
        rows[self.rank] = text
        return [rows[r] for r in sorted(rows)]


def info(step: int) -> StepInfo:
    return StepInfo(step=step, state=None, metrics={})


def drive(monitor: StragglerMonitor, clock: Clock, first: int, last: int, host_s: float,
          vote_s: float = 0.01) -> None:
    """Steps first..last: host work of `host_s`, the hooks (arrive, vote, depart)."""
    for step in range(first, last + 1):
        clock.now += host_s
        monitor.arrive(info(step))
        clock.now += vote_s      # waiting in the preemption vote: not host step time
        monitor.depart(info(step))


def test_one_process_has_the_fields_after_warm_up_and_never_gathers():
    clock = Clock()
    monitor = StragglerMonitor(None, 0, "h0", 5, 1.3, Events(), True, clock=clock)
    drive(monitor, clock, 1, 5, 0.02)
    assert monitor.fields(5) == {}               # the first check: warm-up, skipped
    drive(monitor, clock, 6, 12, 0.02)
    fields = monitor.fields(10)
    assert fields == {"host_step_s_min": pytest.approx(0.02), "host_step_s_median":
                      pytest.approx(0.02), "host_step_s_max": pytest.approx(0.02),
                      "slowest_rank": 0, "slowest_host": "h0"}
    assert monitor.fields(11) == monitor.fields(12) == {} and monitor.fields(9) == {}


def test_a_slow_rank_is_named_once_after_three_checks_in_a_row(caplog):
    clock, events = Clock(), Events()
    group = Gathered(0, {1: 0.1, 2: 0.021})      # rank 1: 5x the others
    monitor = StragglerMonitor(group, 0, "host0", 2, 1.3, events, True, clock=clock)
    with caplog.at_level(logging.WARNING, "spmd.loop.stragglers"):
        drive(monitor, clock, 1, 2, 0.02)        # warm-up check at 2: no gather
        assert group.calls == []
        drive(monitor, clock, 3, 6, 0.02)        # checks at 4, 6: slow twice
        assert events.emitted == []
        drive(monitor, clock, 7, 12, 0.02)       # 8: the third in a row; 10, 12: same streak
    assert group.calls == [f"gather host step times at step {s}" for s in (4, 6, 8, 10, 12)]
    (event,) = events.emitted
    assert event == {"event": "straggler", "step": 8, "rank": 1, "host": "host1",
                     "host_step_s": 0.1, "median_s": pytest.approx(0.021), "factor":
                     pytest.approx(0.1 / 0.021, abs=1e-3), "threshold": 1.3}
    (line,) = [r.getMessage() for r in caplog.records]
    assert "rank 1 on host1" in line and "launch.straggler_factor=1.3" in line
    assert monitor.fields(12) == {"host_step_s_min": pytest.approx(0.02),
                                  "host_step_s_median": pytest.approx(0.021),
                                  "host_step_s_max": 0.1, "slowest_rank": 1,
                                  "slowest_host": "host1"}
    group.others[1] = 0.02                      # recovers: the streak ends ...
    drive(monitor, clock, 13, 14, 0.02)
    group.others[1] = 0.1                       # ... and a new one is named again
    drive(monitor, clock, 15, 20, 0.02)
    assert [e["step"] for e in events.emitted] == [8, 20]


def test_a_rank_that_stalls_is_named_for_it_even_when_its_host_time_is_long_too():
    """Its stalls are why it is slow: the event says so (cause "stalled"), as it does when
    its host time is the others' (seen in CI: a frozen rank also over the factor)."""
    clock, events = Clock(), Events()
    group = Gathered(0, {1: "0.1 0.5"})      # rank 1: 5x the host time, and did not run half
    monitor = StragglerMonitor(group, 0, "host0", 2, 1.3, events, True, clock=clock)
    drive(monitor, clock, 1, 8, 0.02)
    (event,) = events.emitted
    assert (event["rank"], event["step"], event["cause"]) == (1, 8, "stalled"), event
    assert event["stalled_share"] == 0.5 and event["median_stalled_share"] == 0.25
    assert event["factor"] == pytest.approx(0.1 / 0.06, abs=1e-3)


def test_even_ranks_and_sub_millisecond_jitter_name_no_one():
    clock, events = Clock(), Events()
    group = Gathered(1, {0: 0.0003, 2: 0.0004})    # 2x, but only 0.2 ms over the median
    monitor = StragglerMonitor(group, 1, "host1", 1, 1.3, events, False, clock=clock)
    drive(monitor, clock, 1, 20, 0.0006)
    assert events.emitted == [] and monitor.fields(20)["slowest_rank"] == 1
    group.others = {0: 0.02, 2: 0.021}
    drive(monitor, clock, 21, 40, 0.02)
    assert events.emitted == []


def test_only_rank_0_writes_the_event_and_the_slow_rank_warns_itself(caplog):
    clock, events = Clock(), Events()
    group = Gathered(1, {0: 0.01})
    monitor = StragglerMonitor(group, 1, "me", 1, 1.3, events, False, clock=clock)
    with caplog.at_level(logging.WARNING, "spmd.loop.stragglers"):
        drive(monitor, clock, 1, 5, 0.05)
    assert events.emitted == []
    assert any("rank 1 on me" in r.getMessage() for r in caplog.records)


def test_bad_settings_name_the_config_key():
    with pytest.raises(ValueError, match="run.log_every=0"):
        StragglerMonitor(None, 0, "h", 0, 1.3, None, True)
    with pytest.raises(ValueError, match=r"rank 0 on h: launch.straggler_factor=1"):
        StragglerMonitor(None, 0, "h", 1, 1.0, None, True)


# ------------------------------------------------------------------ the gather


def test_allgather_str_in_one_process_is_the_text_cut_as_over_mpi():
    group = RankGroup(resolve_launch_env({}), 5, "launch.barrier_timeout_s", "stragglers")
    assert group.channel == "single"
    assert group.allgather_str("abc", "gather") == ["abc"]
    assert group.allgather_str("x" * 600, "gather") == ["x" * 512]


def test_allgather_str_over_the_key_value_store_in_rank_order_cleans_up(store):  # noqa: F811
    def rank(r: int) -> list[list[str]]:
        group = RankGroup(envs(2)[r], 5, "launch.barrier_timeout_s", "stragglers")
        out = []
        for call in range(4):
            out.append(group.allgather_str(f"r{r}c{call}", "gather host step times"))
            assert group.allreduce_max([r, call], "mix with a reduce") == [1, call]
        return out

    a, b = on_ranks(rank)
    assert a == b == [[f"r0c{c}", f"r1c{c}"] for c in range(4)]
    # each rank deleted every entry but its last: at most one left per rank
    assert sorted(store.data) == ["spmd/stragglers/8/max/0", "spmd/stragglers/8/max/1"]


def test_a_missing_rank_makes_the_gather_time_out_naming_rank_and_key(store):  # noqa: F811
    group = RankGroup(envs(2)[1], 0.2, "launch.barrier_timeout_s", "stragglers")
    with pytest.raises(Exception, match=r"rank 1 on .*: could not gather host step times at "
                                        r"step 5 .*\(launch.barrier_timeout_s\)"):
        group.allgather_str("x", "gather host step times at step 5")


def test_two_ranks_over_the_key_value_store_agree_on_the_straggler(store):  # noqa: F811
    def rank(r: int) -> tuple[dict, list[dict]]:
        clock, events = Clock(), Events()
        group = RankGroup(envs(2)[r], 5, "launch.barrier_timeout_s", "stragglers")
        monitor = StragglerMonitor(group, r, f"node{r}", 2, 1.3, events, r == 0, clock=clock)
        drive(monitor, clock, 1, 10, 0.06 if r == 1 else 0.01)
        return monitor.fields(10), events.emitted

    (f0, e0), (f1, e1) = on_ranks(rank)
    assert f0 == f1 and f0["slowest_rank"] == 1 and f0["slowest_host"] == "node1"
    assert f0["host_step_s_min"] == pytest.approx(0.01)
    assert f0["host_step_s_median"] == pytest.approx(0.035)
    assert [(e["rank"], e["host"], e["step"]) for e in e0] == [(1, "node1", 8)] and e1 == []


# ------------------------------------------------------------------ spmd report


def test_report_lists_stragglers_by_rank(tmp_path, capsys):
    from spmd.cli.main import main

    def straggler(step: int, rank: int, factor: float) -> dict:
        return {"event": "straggler", "time": 100 + step, "rank": rank, "host": f"n{rank}",
                "step": step, "host_step_s": 0.05 * factor, "median_s": 0.05,
                "factor": factor, "threshold": 1.3}

    events = [{"event": "started", "time": 100, "rank": 0, "host": "n0", "size": 3,
               "process_start": 99},
              straggler(30, 2, 1.6), straggler(15, 1, 2.0), straggler(60, 2, 1.9),
              {"event": "finished", "time": 200, "rank": 0, "host": "n0", "step": 60}]
    found = stragglers(events)
    assert [(s.rank, s.host, s.steps, s.factor_max) for s in found] == [
        (1, "n1", [15], 2.0), (2, "n2", [30, 60], 1.9)]
    assert "none named" in format_stragglers([])
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 2 on n2: named 2 time(s) at step(s) 30, 60; up to 1.90x the median" in out
    assert main(["report", str(tmp_path), "--json"]) == 0
    ledger = json.loads(capsys.readouterr().out)
    assert [s["rank"] for s in ledger["stragglers"]] == [1, 2]


# ------------------------------------------------------------------ the test-only fault

PROBE = """
import time
from types import SimpleNamespace as NS
import spmd.data.loader.feed as feed
began = time.perf_counter()
assert feed.BatchFeed.global_batch(NS(fields={}), None, 0) == {}
print(getattr(feed.BatchFeed.global_batch, "fault", None), time.perf_counter() - began)
"""


@pytest.mark.parametrize("rank, slowed", [(0, True), (1, False)])
def test_the_slow_rank_fault_sleeps_in_that_rank_s_batches_only(rank, slowed):
    env = fault_env(slow_rank=f"{rank}:0.5")
    assert env[SLOW_RANK] == f"{rank}:0.5"
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO,
                       env=clean_env(**env), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    name, seconds = r.stdout.split()
    assert name == SLOW_RANK and (float(seconds) >= 0.5) == slowed
    with pytest.raises(ValueError, match=f"{SLOW_RANK}='1' is not RANK:SECONDS"):
        fault_env(slow_rank="1")
