"""A node's disk after its ranks were renumbered (a node was lost, the ranks after it moved up):
`LocalTier.copies` of a rank with no directory of its own for a step offers what the node's
other rank directories hold; a rank with its own directory sees only that, as before.

The layout on "node4" after node3 died (4 nodes x 2 ranks, partner = next node's rank):
rank00006/ (own pieces of 6, partner copy of 4), rank00007/ (own of 7, partner of 5).
"""

from __future__ import annotations

import json
import socket

from spmd.checkpoint.local import DATA, INDEX, MARKER, LocalTier


def _rank_dir(root, step: int, rank: int, partners: list[int], signature: str = "sig") -> None:
    d = root / str(step) / f"rank{rank:05d}"
    d.mkdir(parents=True)
    files = {INDEX: "00000000"}
    (d / DATA).write_bytes(b"")
    (d / INDEX).write_text("{}")
    for q in partners:
        (d / f"partner-rank{q:05d}.bin").write_bytes(b"")
        (d / f"partner-rank{q:05d}.json").write_text("{}")
        files[f"partner-rank{q:05d}.json"] = "00000000"
    (d / MARKER).write_text(json.dumps({"step": step, "rank": rank, "signature": signature,
                                        "num_processes": 8, "files": files,
                                        "partners": partners, "host": "node4"}))


def test_a_moved_rank_finds_the_copies_on_its_new_node(tmp_path):
    _rank_dir(tmp_path, 3, 6, [4])
    _rank_dir(tmp_path, 3, 7, [5])
    # new rank 4 now runs on this node: its own pieces are node3's partner copy held by 6
    own, held, notes = LocalTier(tmp_path, 4, 8, {}).copies("sig")
    assert not notes
    assert own[3].owner == 4 and own[3].data.name == "partner-rank00004.bin"
    assert sorted(held) == [(3, 5), (3, 6), (3, 7)]
    assert held[(3, 6)].data == tmp_path / "3" / "rank00006" / DATA
    assert held[(3, 5)].data.parent.name == "rank00007"


def test_a_rank_with_its_own_directory_reads_only_that(tmp_path):
    _rank_dir(tmp_path, 3, 6, [4])
    _rank_dir(tmp_path, 3, 7, [5])
    own, held, _ = LocalTier(tmp_path, 6, 8, {}).copies("sig")
    assert own[3].data == tmp_path / "3" / "rank00006" / DATA
    assert sorted(held) == [(3, 4)]


def test_other_layouts_are_skipped_with_a_note(tmp_path):
    _rank_dir(tmp_path, 3, 6, [4], signature="other")
    own, held, notes = LocalTier(tmp_path, 4, 8, {}).copies("sig")
    assert not own and not held and "another layout" in notes[0]


def test_the_commit_marker_names_the_host(tmp_path):
    from spmd.checkpoint.layout import SaveLayout

    class Layout:  # the two attributes `commit` reads
        signature, num_processes = "sig", 1

    tier = LocalTier(tmp_path, 0, 1, {})
    tier.rank_dir(2).mkdir(parents=True)
    layout: SaveLayout = Layout()  # type: ignore[assignment]
    tier.commit(2, layout, {INDEX: "00000000"})
    assert tier.marker(2)["host"] == socket.gethostname()
