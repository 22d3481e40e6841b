"""The run-directory lease on real files and real processes: acquire, refuse, take over, release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest

from spmd.config.schema import Config
from spmd.launch import resolve_launch_env
from spmd.launch.watchdog import process_alive, process_start_time
from spmd.rundir.lease import (
    LEASE_NAME,
    Holder,
    LeaseHeld,
    RunLease,
    inspect_lease,
    read_lease,
    take,
)
from spmd.rundir.metrics import EventLog, read_jsonl
from tests.helpers.env import REPO, clean_env, run_spmd


def holder(**changes) -> Holder:
    return replace(Holder.me("slurm", "42", 0), **changes)


@pytest.fixture
def sleeper():
    """A real process that this test owns (ended by pid at teardown)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def test_acquire_then_a_second_run_is_refused_naming_the_holder(tmp_path):
    first = holder()
    assert take(tmp_path, first, stale_s=300) is None
    on_disk = json.loads((tmp_path / LEASE_NAME).read_text())
    assert (on_disk["host"], on_disk["pid"], on_disk["job_id"]) == (first.host, os.getpid(), "42")
    assert not list(tmp_path.glob(".*.tmp")), "the temp file of the atomic link is left behind"
    with pytest.raises(LeaseHeld) as refused:
        take(tmp_path, holder(job_id="43"), stale_s=300)  # the holder (this process) is alive
    msg = str(refused.value)
    assert "\n" not in msg and refused.value.exit_code == 2
    assert f"pid {os.getpid()} on {first.host}" in msg and "job 42" in msg
    assert time.strftime("%Y-%m-%d", time.localtime(first.started)) in msg  # since when
    assert read_lease(tmp_path / LEASE_NAME)[0].token == first.token  # untouched


def test_dead_local_holder_is_taken_over_at_once(tmp_path, sleeper):
    dead = holder(pid=sleeper.pid, pid_start=process_start_time(sleeper.pid), job_id="7")
    assert take(tmp_path, dead, stale_s=300) is None
    with pytest.raises(LeaseHeld, match=f"pid {sleeper.pid}"):
        take(tmp_path, holder(job_id="8"), stale_s=300)
    sleeper.kill()
    sleeper.wait()
    assert not process_alive(dead.pid, dead.pid_start)
    me = holder(job_id="8")
    previous, why = take(tmp_path, me, stale_s=300)
    assert previous.token == dead.token and f"pid {sleeper.pid} is no longer running" in why
    assert read_lease(tmp_path / LEASE_NAME)[0].token == me.token


def test_reused_pid_is_not_the_holder(tmp_path):
    start = process_start_time(os.getpid())
    impostor = holder(pid_start=start - 1)  # this pid, but a process that started earlier
    take(tmp_path, impostor, stale_s=300)
    previous, why = take(tmp_path, holder(), stale_s=300)
    assert previous.token == impostor.token and "no longer running" in why


def test_requeued_job_takes_over_its_own_lease_but_not_another_jobs(tmp_path):
    remote = holder(host="nid-elsewhere", pid=1234, job_id="42", restart_count=0)
    take(tmp_path, remote, stale_s=300)  # fresh heartbeat, other host: live to anyone else
    with pytest.raises(LeaseHeld, match="pid 1234 on nid-elsewhere, job 42"):
        take(tmp_path, holder(job_id="43", restart_count=1), stale_s=300)
    with pytest.raises(LeaseHeld):  # the same job, not requeued: a second run inside the job
        take(tmp_path, holder(job_id="42", restart_count=0), stale_s=300)
    previous, why = take(tmp_path, holder(job_id="42", restart_count=1), stale_s=300)
    assert previous.token == remote.token
    assert "same job 42 was requeued (restart 1 > 0)" in why


def test_remote_holder_is_taken_over_only_after_its_heartbeat_goes_stale(tmp_path):
    remote = holder(host="nid-elsewhere", pid=1234)
    take(tmp_path, remote, stale_s=5)
    with pytest.raises(LeaseHeld, match="last heartbeat 0 s ago"):
        take(tmp_path, holder(job_id="9"), stale_s=5)
    old = time.time() - 6
    os.utime(tmp_path / LEASE_NAME, (old, old))
    state = inspect_lease(tmp_path, stale_s=5, environ={})
    assert state.stale and state.heartbeat_age_s >= 6
    previous, why = take(tmp_path, holder(job_id="9"), stale_s=5)
    assert previous.token == remote.token and "no heartbeat for 6 s > run.lease_stale_s=5" in why


def test_heartbeat_refreshes_and_release_removes_only_our_lease(tmp_path):
    env = resolve_launch_env({})
    lease = RunLease.acquire(tmp_path, env, stale_s=0.5)
    events = EventLog(tmp_path / "events.jsonl", 0)
    path = tmp_path / LEASE_NAME
    old = time.time() - 100
    os.utime(path, (old, old))
    lease.start(events)
    time.sleep(0.6)  # heartbeat every 0.1 s
    assert time.time() - path.stat().st_mtime < 1
    lease.release()
    assert not path.exists()
    lease.release()  # idempotent
    again = RunLease.acquire(tmp_path, env, stale_s=300)
    again.release()
    events.close()
    names = [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert names == ["lease_acquired"]


def test_holder_that_loses_its_lease_stops_at_once(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from spmd.launch import resolve_launch_env
        from spmd.rundir.lease import RunLease
        from spmd.rundir.metrics import EventLog
        run_dir = Path({str(tmp_path)!r})
        lease = RunLease.acquire(run_dir, resolve_launch_env({{}}), stale_s=0.5)
        lease.start(EventLog(run_dir / "events.jsonl", 0))
        print("holding", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "holding"
        thief = holder(host="nid-elsewhere", pid=4321, job_id="99")
        tmp = tmp_path / "thief.tmp"
        tmp.write_text(json.dumps(thief.__dict__))
        os.rename(tmp, tmp_path / LEASE_NAME)  # what a take-over does
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 73, err
    assert time.monotonic() - t0 < 5
    assert "lost the lease" in err and "pid 4321 on nid-elsewhere, job 99" in err
    assert read_lease(tmp_path / LEASE_NAME)[0].token == thief.token  # not removed on the way out


def test_ckpt_ls_shows_the_lease(tmp_path, sleeper):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(Config().to_yaml())
    listed = run_spmd("ckpt", "ls", str(run_dir), timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "lease: " in listed.stdout and "none (no run is writing here)" in listed.stdout
    live = holder(pid=sleeper.pid, pid_start=process_start_time(sleeper.pid))
    take(run_dir, live, stale_s=300)
    listed = run_spmd("ckpt", "ls", str(run_dir), timeout=120)
    assert listed.returncode == 0, listed.stderr
    line = next(x for x in listed.stdout.splitlines() if x.startswith("lease: "))
    assert f"pid {sleeper.pid} on {live.host}" in line and "live:" in line
    sleeper.kill()
    sleeper.wait()
    as_json = json.loads(run_spmd("ckpt", "ls", str(run_dir), "--json", timeout=120).stdout)
    assert as_json["lease"]["stale"] is True
    assert as_json["lease"]["holder"]["pid"] == sleeper.pid
    assert "no longer running" in as_json["lease"]["reason"]
