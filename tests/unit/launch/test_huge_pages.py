"""spmd.launch.huge_pages: the ranks' GLIBC_TUNABLES gets glibc.malloc.hugetlb=1 unless the
user set that tunable, keeping the user's others; the config key turns it off; `spmd run`
builds the ranks' environment with it (child_env)."""

from __future__ import annotations

import pytest

from spmd.cli.run_cmd import child_env
from spmd.launch.huge_pages import TUNABLES_VAR, malloc_report, with_huge_pages


@pytest.mark.parametrize("users, ranks", [
    (None, "glibc.malloc.hugetlb=1"),
    ("", "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=4", "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),
    ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2",
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"),
], ids=["unset", "empty", "another-kept", "users-own-0", "users-own-2"])
def test_the_ranks_tunables(users, ranks):
    environ = {"PATH": "/bin"} | ({TUNABLES_VAR: users} if users is not None else {})
    env = with_huge_pages(environ)
    assert env[TUNABLES_VAR] == ranks and env["PATH"] == "/bin"
    assert environ.get(TUNABLES_VAR) == users            # the caller's mapping is not changed


def test_off_leaves_the_environment_as_it_is():
    assert with_huge_pages({"PATH": "/bin"}, enabled=False) == {"PATH": "/bin"}


def test_spmd_run_gives_the_ranks_huge_pages_unless_the_config_says_no(monkeypatch):
    monkeypatch.delenv(TUNABLES_VAR, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")                 # an outer launcher's: dropped
    env = child_env(2)
    assert env[TUNABLES_VAR] == "glibc.malloc.hugetlb=1"
    assert env["SPMD_PROCESSES_PER_NODE"] == "2" and "SLURM_PROCID" not in env
    assert TUNABLES_VAR not in child_env(2, huge_pages=False)


def test_doctor_reads_the_kernel_s_transparent_huge_page_mode():
    report = malloc_report({TUNABLES_VAR: "glibc.malloc.hugetlb=1"})
    assert report["glibc_tunables"] == "glibc.malloc.hugetlb=1"
    assert report["transparent_hugepage"] in ("always", "madvise", "never", None)
    assert malloc_report({})["glibc_tunables"] is None
