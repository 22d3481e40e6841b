"""spmd.comm in one process: the stop vote's rules, and its key-value path with ranks as threads."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import replace

import pytest

from spmd.checkpoint.coordination import CheckpointCoordinator, CheckpointTimeout
from spmd.comm import RankGroup, StopVote, Vote
from spmd.comm import rank_group as rank_group_module
from spmd.launch import LaunchError, PreemptionWatcher, resolve_launch_env


class FakeStore:
    """The jax.distributed client's key-value calls, shared by threads that play ranks."""

    def __init__(self, size: int):
        self.data: dict[str, str] = {}
        self.cond = threading.Condition()
        self.barrier = threading.Barrier(size)

    def key_value_set(self, key: str, value: str) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.data[key]

    def wait_at_barrier(self, barrier_id: str, timeout_ms: int) -> None:
        try:
            self.barrier.wait(timeout_ms / 1000)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {barrier_id}") from None

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.cond:
            return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]

    def key_value_delete(self, key: str) -> None:
        with self.cond:
            self.data.pop(key, None)


def envs(size: int):
    one = resolve_launch_env({})
    return [replace(one, rank=r, size=size) for r in range(size)]


@pytest.fixture
def store(monkeypatch):
    fake = FakeStore(2)
    monkeypatch.setattr(rank_group_module.mpi, "world", lambda environ=None: None)
    monkeypatch.setattr(rank_group_module, "kv_client", lambda: fake)
    return fake


def on_ranks(fn, size: int = 2) -> list:
    """fn(rank) on `size` threads; their results (or exceptions) by rank."""
    out: list = [None] * size

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_one_rank_stops_on_its_own_request(tmp_path):
    env = resolve_launch_env({})
    watcher = PreemptionWatcher(env, tmp_path / "HALT")
    vote = StopVote(watcher, RankGroup(env, 5, "launch.barrier_timeout_s", "preempt"))
    assert not vote.should_stop(0) and vote.reason is None
    vote.deadline = time.time() - 1
    assert watcher.deadline == vote.deadline
    assert vote.should_stop(1) and "wall-time deadline" in vote.reason
    assert vote.should_stop(2) and vote.stop_step == 1  # once True, always True


def test_request_priority_signal_over_halt_over_deadline(tmp_path):
    env = resolve_launch_env({})
    watcher = PreemptionWatcher(env, tmp_path / "HALT")
    watcher.deadline = time.time() - 1
    deadline = watcher.request()[0]
    (tmp_path / "HALT").touch()
    halt = watcher.request()[0]
    watcher._on_signal(signal.SIGTERM, None)
    sigterm, text = watcher.request()
    assert 0 < deadline < halt < sigterm and text.startswith("SIGTERM received by rank 0 on ")


def test_ranks_agree_over_the_key_value_store(tmp_path, store):
    (tmp_path / "HALT").touch()  # seen by rank 0; rank 1's signal outranks it

    def rank(r: int) -> tuple[list[bool], str | None]:
        env = envs(2)[r]
        watcher = PreemptionWatcher(env, tmp_path / "HALT" if r == 0 else None)
        vote = StopVote(watcher, RankGroup(env, 5, "launch.barrier_timeout_s", "preempt"))
        stops = []
        for step in range(3):
            if r == 1 and step == 2:
                watcher._on_signal(signal.SIGUSR1, None)
            stops.append(vote.should_stop(step))
        return stops, vote.reason

    (s0, reason0), (s1, reason1) = on_ranks(rank)
    assert s0 == s1 == [True, True, True]
    assert reason0 == reason1 and "halt file" in reason0  # decided at step 0: the halt file

    store.data.clear()
    (tmp_path / "HALT").unlink()
    (s0, reason0), (s1, reason1) = on_ranks(rank)
    assert s0 == s1 == [False, False, True]
    assert reason0 == reason1 and reason0.startswith("SIGUSR1 received by rank 1 on ")


def test_ranks_at_different_steps_fail_on_every_rank(store):
    def rank(r: int) -> bool:
        env = envs(2)[r]
        vote = StopVote(PreemptionWatcher(env, None),
                        RankGroup(env, 5, "launch.barrier_timeout_s", "preempt"))
        return vote.should_stop(3 + r)

    errors = on_ranks(rank)
    assert all(isinstance(e, LaunchError) and "different steps (3..4)" in str(e) for e in errors)


def test_a_missing_rank_times_out_naming_rank_and_key(store):
    group = RankGroup(envs(2)[1], 0.2, "launch.barrier_timeout_s", "lease")
    with pytest.raises(LaunchError, match=r"rank 1 on .*: could not learn .* within 0 s "
                                          r"\(launch.barrier_timeout_s\)"):
        group.broadcast_str("ok", 0, "learn what rank 0 decided")


def test_checkpoint_agreement_keeps_its_errors(monkeypatch):
    monkeypatch.setattr("spmd.comm.agreement.kv_client", lambda: None)
    coord = CheckpointCoordinator(0, 2, 1.0, "main")
    with pytest.raises(Exception, match="checkpoint agreement needs jax.distributed") as e:
        coord.agree("commit step 1", Vote())
    assert type(e.value).__name__ == "CheckpointError"
    assert issubclass(CheckpointTimeout, type(e.value))
