"""Node layout helpers: Slurm hostlists and tasks-per-node strings, rank -> node maps."""

from __future__ import annotations

import re
from collections.abc import Sequence


def first_host(hostlist: str) -> str:
    """The first host of a Slurm hostlist: "nid[003-004,9],login1" -> "nid003"."""
    depth, end = 0, len(hostlist)
    for i, ch in enumerate(hostlist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    item = hostlist[:end].strip()
    # Replace each bracket group by its first element, keeping zero padding.
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], item)


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse tasks per node {text!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def distribute(counts: Sequence[int], block: int | None) -> tuple[int, ...]:
    """Node of each rank when `counts[n]` ranks sit on node n.

    `block=None` is Slurm's block distribution (fill node 0, then node 1, ...); an integer
    deals ranks round-robin over the nodes in chunks of `block` (cyclic = 1, plane=k = k).
    """
    if block is None:
        return tuple(n for n, c in enumerate(counts) for _ in range(c))
    left = list(counts)
    out: list[int] = []
    while any(left):
        for n in range(len(left)):
            take = min(block, left[n])
            out += [n] * take
            left[n] -= take
    return tuple(out)


def group_by_key(keys: Sequence[str]) -> tuple[int, ...]:
    """Node id of each rank from per-rank keys (hostnames): ids 0.. in order of first rank."""
    ids: dict[str, int] = {}
    return tuple(ids.setdefault(k, len(ids)) for k in keys)


def local_position(node_of_rank: Sequence[int], rank: int) -> tuple[int, int]:
    """(index of `rank` among the ranks of its node, number of ranks on that node)."""
    node = node_of_rank[rank]
    same = [r for r, n in enumerate(node_of_rank) if n == node]
    return same.index(rank), len(same)
