"""rank 0's coordinator address is never loopback on a multi-node job: a hostname that
resolves to 127.x only (Debian's "127.0.1.1 HOST" line) falls back to the address this host
sends from towards the launch node (SLURM_LAUNCH_NODE_IPADDR), else to the name itself."""

from __future__ import annotations

import subprocess

import pytest

from spmd.launch.coordinator import own_address


def _non_loopback_ipv4() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    addrs = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    addrs = [a for a in addrs if not a.startswith("127.")]
    if not addrs:
        pytest.skip("this host has no non-loopback IPv4 address")
    return addrs[0]


def test_a_loopback_hostname_falls_back_to_the_route_to_the_launch_node():
    addr = _non_loopback_ipv4()
    assert own_address("localhost", {"SLURM_LAUNCH_NODE_IPADDR": addr}) == addr


def test_without_a_routable_launch_node_the_name_is_kept():
    assert own_address("localhost", {}) == "localhost"
    assert own_address("localhost", {"SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}) == "localhost"
