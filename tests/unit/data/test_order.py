"""spmd.data.order: the record order equals grain's seeded epoch shuffle, element for
element."""

from __future__ import annotations

import threading

import grain
import numpy as np
import pytest

from spmd.data.order import (
    AUTO_BLOCK_BYTES,
    BlockOrder,
    EpochOrder,
    auto_block,
    index_shuffle,
    make_order,
)


def grain_order(count: int, seed: int, shuffle: bool = True):
    order = grain.MapDataset.range(count)
    if shuffle:
        order = order.shuffle(seed=seed)
    return order.repeat()


@pytest.mark.parametrize("count", [1, 2, 3, 5, 17, 1000, 8191, 8192, 8193, 65536, 65537,
                                   65538, 262145, 1 << 20, (1 << 20) + 1, 3_000_001])
@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_equals_grain(count: int, seed: int) -> None:
    """Consecutive positions over three epochs (or the first 400) and random positions up
    to the fifth epoch, in one call and one at a time. (Grain itself takes milliseconds per
    position of a tiny split: its cipher walks a 2**16 block.)"""
    rng = np.random.default_rng(count + seed)
    positions = np.concatenate([np.arange(min(3 * count, 400)),
                                rng.integers(0, 5 * count, 200 if count > 100 else 10)])
    theirs = grain_order(count, seed)
    want = np.array([int(theirs[int(p)]) for p in positions])
    order = EpochOrder(count, seed)
    np.testing.assert_array_equal(order.records(positions), want)
    assert [order[int(p)] for p in positions[:50]] == want[:50].tolist()


def test_epochs_are_permutations_and_differ() -> None:
    order = EpochOrder(10_000, seed=3)
    first = order.records(range(10_000))
    second = order.records(range(10_000, 20_000))
    assert sorted(first.tolist()) == list(range(10_000))
    assert sorted(second.tolist()) == list(range(10_000))
    assert (first != second).mean() > 0.9


def test_calls_that_cross_blocks_and_epochs() -> None:
    """A call spanning a block boundary, an epoch boundary, and many epochs of a tiny split
    gives what the positions give one by one."""
    for count, start, stop in [(20_000, 8100, 8300), (20_000, 19_990, 20_010), (3, 0, 40),
                               (20_000, 20_100, 20_132)]:      # the last: one block
        order = EpochOrder(count, seed=11)
        theirs = grain_order(count, 11)
        assert order.records(range(start, stop)).tolist() == \
            [int(theirs[p]) for p in range(start, stop)]


def test_file_order_without_shuffle() -> None:
    order = EpochOrder(7, seed=5, shuffle=False)
    assert order.records(range(20)).tolist() == [p % 7 for p in range(20)]
    theirs = grain_order(7, 5, shuffle=False)
    assert order.records(range(20)).tolist() == [int(theirs[p]) for p in range(20)]
    assert order.records(range(9, 12)).tolist() == [2, 3, 4]


def test_what_a_caller_does_with_the_records_leaves_the_order_as_it_was() -> None:
    order = EpochOrder(100, seed=2)
    first = order.records(range(10, 14))
    want = first.tolist()
    first[:] = -1                                  # a slice of a cached block would show it
    assert order.records(range(10, 14)).tolist() == want


def test_index_shuffle_matches_grain_at_the_block_edges() -> None:
    from grain._src.python.experimental.index_shuffle.python import (
        index_shuffle_module as theirs,
    )

    for max_index in (1, 2, 255, 65535, 65536, 65537, 2**20, 2**31 + 5):
        rows = np.unique(np.linspace(0, max_index, 64).astype(np.uint64))
        mine = index_shuffle(rows, max_index, seed=42).tolist()
        assert mine == [theirs.index_shuffle(int(r), max_index, 42, 4) for r in rows]


def test_threads_agree() -> None:
    order = EpochOrder(50_000, seed=1)
    want = EpochOrder(50_000, seed=1).records(range(0, 50_000))
    errors: list[str] = []

    def work(k: int) -> None:
        for step in range(k, 1500, 4):
            got = order.records(range(step * 32, step * 32 + 32))
            if not np.array_equal(got, want[step * 32:step * 32 + 32]):
                errors.append(f"step {step}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="count must be positive"):
        EpochOrder(0)
    with pytest.raises(ValueError, match="seed must lie"):
        EpochOrder(5, seed=2**32)
    with pytest.raises(ValueError, match="non-negative"):
        EpochOrder(5).records(np.array([-1]))


def test_block_order_reads_every_record_once_a_block_at_a_time() -> None:
    """data.shuffle_block: each epoch is a permutation of the split; the positions of one
    visit all read one block (a short last block included); epochs visit the blocks in
    different orders; a step's slice (the fast path) equals the general computation."""
    count, block = 1000, 64
    order = BlockOrder(count, block, seed=3)
    visits = []
    for epoch in range(3):
        got = order.records(np.arange(epoch * count, (epoch + 1) * count))
        assert sorted(got.tolist()) == list(range(count))
        blocks, starts = order.visits(epoch)
        for k, b in enumerate(blocks.tolist()):
            stretch = got[starts[k]:starts[k + 1]]
            assert set((stretch // block).tolist()) == {b}
            assert len(stretch) == order.size(b)
        visits.append(blocks.tolist())
    assert visits[0] != visits[1] != visits[2]
    by_steps = np.concatenate([order.records(range(p, min(p + 7, 3 * count)))
                               for p in range(0, 3 * count, 7)])
    np.testing.assert_array_equal(by_steps, order.records(np.arange(3 * count)))
    assert BlockOrder(count, block, seed=3).records(range(5, 40)).tolist() == \
        order.records(range(5, 40)).tolist()                 # a pure function
    assert BlockOrder(count, block, seed=4).records(range(64)).tolist() != \
        order.records(range(64)).tolist()


def test_block_order_numbers_are_pinned() -> None:
    """The hash shuffle is plain integer arithmetic: these numbers must never change (a
    change would make resumed runs read other batches)."""
    assert BlockOrder._shuffle(8, 1).tolist() == [7, 4, 1, 3, 0, 6, 2, 5]
    assert BlockOrder(10, 4, 7).records(range(10)).tolist() == \
        [3, 2, 1, 0, 6, 7, 4, 5, 9, 8]


def test_mixed_blocks_read_a_group_of_blocks_shuffled_together() -> None:
    """data.shuffle_mix: an epoch visits the blocks `mix` at a time; the positions of one
    group read exactly the records of its blocks, shuffled together, so that a batch draws
    from several places of the split; each epoch is still a permutation; the fast path
    equals the general computation; mix=1 is the first block shuffle."""
    count, block, mix, batch = 1000, 16, 4, 32
    order = BlockOrder(count, block, seed=5, mix=mix)
    for epoch in range(2):
        got = order.records(np.arange(epoch * count, (epoch + 1) * count))
        assert sorted(got.tolist()) == list(range(count))
        blocks, starts = order.visits(epoch)
        assert len(starts) == -(-order.blocks // mix) + 1
        for g in range(len(starts) - 1):
            stretch = got[starts[g]:starts[g + 1]]
            assert set((stretch // block).tolist()) == set(blocks[g * mix:(g + 1) * mix].tolist())
        spread = [len(set((got[p:p + batch] // block).tolist()))
                  for p in range(0, count - batch, batch)]
        assert np.mean(spread) > 3.5 and min(spread) >= 2, spread   # of 4 blocks per group
    by_steps = np.concatenate([order.records(range(p, min(p + 7, 2 * count)))
                               for p in range(0, 2 * count, 7)])
    np.testing.assert_array_equal(by_steps, order.records(np.arange(2 * count)))
    starts = order.visits(0)[1]
    assert [order.group_end(p) for p in (0, int(starts[1]) - 1, int(starts[1]))] == \
        [starts[1], starts[1], starts[2]]
    assert order.group_end(count - 1) == count                 # the epoch's last group
    assert order.group_end(count) == count + order.visits(1)[1][1]   # the next epoch's first
    assert BlockOrder(count, block, 5, mix).records(range(3, 90)).tolist() == \
        order.records(range(3, 90)).tolist()
    assert BlockOrder(count, block, 5, 1).records(range(200)).tolist() != \
        order.records(range(200)).tolist()
    assert BlockOrder(10, 4, 7, mix=1).records(range(10)).tolist() == \
        [3, 2, 1, 0, 6, 7, 4, 5, 9, 8]                       # the pinned numbers below
    with pytest.raises(ValueError, match="mix must be positive"):
        BlockOrder(10, 4, 7, mix=0)


def test_the_order_follows_shuffle_block_and_shuffle_mix() -> None:
    """auto: blocks of about 4 MiB of records (a full shuffle for records that large);
    full, null and 1: grain's full shuffle; N: blocks of N, `mix` at a time; an unshuffled
    split is file order whatever they say."""
    assert auto_block(16 << 10) == 256 and auto_block(3000) == AUTO_BLOCK_BYTES // 3000
    assert auto_block(AUTO_BLOCK_BYTES) == 1 and auto_block(64 << 20) == 1
    assert auto_block(4) == 1 << 16                          # capped: the index table
    auto = make_order(100_000, 3, block="auto", mix=16, record_bytes=16 << 10)
    assert isinstance(auto, BlockOrder) and (auto.block, auto.mix) == (256, 16)
    want = grain_order(1000, 3)
    for block in ("full", None, 1):
        full = make_order(1000, 3, block=block, mix=16)
        assert isinstance(full, EpochOrder) and full[1234] == want[1234]
    assert isinstance(make_order(1000, 3, block="auto", mix=16, record_bytes=8 << 20),
                      EpochOrder)
    plain = make_order(1000, 3, shuffle=False, block=64, mix=4)
    assert isinstance(plain, EpochOrder) and plain.records(range(5, 9)).tolist() == [5, 6, 7, 8]
    blocks = make_order(1000, 3, block=64, mix=4)
    assert isinstance(blocks, BlockOrder) and (blocks.block, blocks.mix) == (64, 4)
    assert blocks.describe() == ("blocks of 64 consecutive records, 4 at a time with their "
                                 "records shuffled together: 4 group(s) of up to 256 "
                                 "records per epoch of 1,000")
    assert "full shuffle of the 1,000 records" in make_order(1000, 3, block="full").describe()
    assert plain.describe() == "file order, 1,000 records"
