"""The namespace cluster itself (tests/helpers/netns_cluster.py): what srun starts on a node
sees that node's hostname, address and /local; no address outside the cluster's namespaces
is reachable from a node (its only route is the cluster's subnet); it starts in under 30 s;
kill_node and stop leave no process, namespace or directory."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time

from tests.helpers.netns_cluster import (
    NETNS_DIR,
    pids_in_netns,
    start_netns_cluster,
)
from tests.helpers.netns_cluster import netns_cluster as netns_cluster  # noqa: F401

PROBE = r"""
import json, os, socket, subprocess
out = {"host": socket.gethostname(), "local": sorted(os.listdir("/local"))}
out["addr"] = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True,
                             text=True).stdout.split()[3].split("/")[0]
out["routes"] = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout.split("\n")
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("1.1.1.1", 80)); out["outside"] = "connected"
except OSError as e:
    out["outside"] = e.errno
open("/local/mark-" + out["host"], "w").close()
print(json.dumps(out))
"""


def test_each_node_has_its_own_hostname_address_and_local(netns_cluster):  # noqa: F811
    c = netns_cluster
    r = c.run("srun", f"--nodes={len(c.nodes)}", "--ntasks-per-node=1", sys.executable, "-c",
              PROBE, timeout=120)
    seen = {d["host"]: d for d in (json.loads(x) for x in r.stdout.splitlines() if x.strip())}
    assert sorted(seen) == sorted(c.nodes)
    for node, d in seen.items():
        assert d["addr"] == c.addr[node]
        assert [x.strip() for x in d["routes"] if x.strip()] == [
            f"10.231.0.0/24 dev eth0 proto kernel scope link src {c.addr[node]}"], d["routes"]
        assert d["outside"] == errno.ENETUNREACH, d
        assert not any(n.startswith("mark-") for n in d["local"])  # nobody else's mark
        assert (c.local(node) / f"mark-{node}").is_file()
        assert [p.name for p in c.local(node).iterdir() if p.name.startswith("mark-")] == [
            f"mark-{node}"]
        (c.local(node) / f"mark-{node}").unlink()
    assert c.exec_on("node2", "hostname").stdout.strip() == "node2"


def test_stop_leaves_no_namespace_process_or_directory():
    began = time.monotonic()
    c = start_netns_cluster(2)
    assert time.monotonic() - began < 30, "the cluster took 30 s or more to start"
    names, root = list(c.namespaces), c.root
    pid = c.slurmd["node1"].pid
    killed = c.kill_node("node2")
    assert killed and not c.node_pids("node2") and not c.local("node2").exists()
    c.stop()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert not any((NETNS_DIR / n).exists() for n in names)
    assert not any(pids_in_netns(n) for n in names)
    assert c.slurmd == {} and subprocess.run(["kill", "-0", str(pid)],
                                             capture_output=True).returncode != 0
    assert not root.exists()
