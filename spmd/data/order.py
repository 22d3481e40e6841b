"""The record order of a split: grain's epoch-wise seeded shuffle, computed for many
positions at once.

Training reads position `p` of an endless stream; `EpochOrder(count, seed)[p]` is the record
it reads. The order is exactly `grain.MapDataset.range(count).shuffle(seed).repeat()`: in
epoch `e = p // count`, the position `p % count` goes through grain's `index_shuffle`
(a Simon-cipher Feistel network over a block of `B = max(16, even(ceil(log2(count-1))))`
bits, 4 rounds, round keys from C++'s `std::seed_seq{(seed + e) mod 2**32}`, cycle-walking
until the result is below `count`). This module computes the same numbers with NumPy, for
a whole block of positions in a few array operations (0.5 µs per position where grain
costs 5-9 µs from Python; the rare long cycle-walks of a split much smaller than 2**16
records go to grain's compiled function). tests/unit/data/test_order.py checks the equality
with grain over sizes, seeds and epochs.

Invariants:
- `records(positions)` is a pure function of (count, seed, shuffle, positions): the same on
  every process and for any process count; a resumed run reads the same records.
- It equals grain's order element for element: runs made before this module read the
  same batches.
- `shuffle=False` is file order repeated: `p % count`.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["AUTO_BLOCK_BYTES", "FULL_SHUFFLE", "BlockOrder", "EpochOrder", "auto_block",
           "index_shuffle", "make_order", "seed_seq_words"]

ROUNDS = 4                  # grain's ShuffleMapDataset uses 4 rounds
MIN_BLOCK_BITS = 16         # grain's smallest cipher block
VECTOR_WALKS = 256          # most cycle-walk steps done with NumPy ...
FEW_LEFT = 32               # ... while more than this many indices still walk
_M32 = 0xFFFFFFFF
# data.shuffle_block: auto: blocks of about this many bytes of records (all fields), so
# that the readahead reads each field's stretch of a block in long reads (with blocks this
# size a cold split of 16 KiB records reads as fast as whole files here: docs/performance.md
# section 7); at most AUTO_BLOCK_MAX records (a group's index: mix x 64 K x 8 bytes).
AUTO_BLOCK_BYTES = 4 << 20
AUTO_BLOCK_MAX = 1 << 16
FULL_SHUFFLE = (None, "full", 1)   # the data.shuffle_block values of grain's full shuffle


@functools.lru_cache(maxsize=64)
def seed_seq_words(seed: int, n: int) -> tuple[int, ...]:
    """The `n` words C++'s `std::seed_seq{seed}.generate()` yields (C++11 [rand.util.seedseq]
    with one seed word): the cipher's round keys."""
    v = [seed & _M32]
    s = len(v)
    out = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def tangle(x: int) -> int:
        return x ^ (x >> 27)

    for k in range(m):
        r1 = (1664525 * tangle(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & _M32
        r2 = (r1 + (s if k == 0 else (k % n + v[k - 1]) if k <= s else k % n)) & _M32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & _M32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & _M32
        out[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * tangle((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _M32)) \
            & _M32
        r4 = (r3 - k % n) & _M32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return tuple(out)


def _block_bits(max_index: int) -> int:
    bits = math.ceil(math.log2(max_index))     # as grain computes it (in floating point)
    return max(bits + bits % 2, MIN_BLOCK_BITS)


def index_shuffle(index: np.ndarray, max_index: int, seed: int,
                  rounds: int = ROUNDS) -> np.ndarray:
    """grain's `index_shuffle(index, max_index, seed, rounds)` for an array of indices in
    [0, max_index]: each one's position in a seeded permutation of [0, max_index]."""
    index = np.asarray(index, dtype=np.uint64)
    if max_index == 0:
        return np.zeros_like(index)
    w = _block_bits(max_index) // 2
    mask = np.uint64((1 << w) - 1)
    keys = [np.uint64(k & ((1 << w) - 1)) for k in seed_seq_words(seed & _M32, rounds)]
    one, two, eight = np.uint64(1), np.uint64(2), np.uint64(8)
    wide = np.uint64(w)

    def rotl(x: np.ndarray, r: np.uint64) -> np.ndarray:
        return ((x << r) | (x >> (wide - r))) & mask

    def f(x: np.ndarray) -> np.ndarray:
        return (rotl(x, one) & rotl(x, eight)) ^ rotl(x, two)

    def encrypt(value: np.ndarray) -> np.ndarray:
        left, right = (value >> wide) & mask, value & mask
        for i in range(0, rounds, 2):
            left = left ^ f(right) ^ keys[i]
            right = right ^ f(left) ^ keys[i + 1]
        return (left << wide) | right

    out = encrypt(index)
    todo = np.flatnonzero(out > np.uint64(max_index))
    for _ in range(VECTOR_WALKS):             # cycle-walk back into [0, max_index]
        if todo.size <= FEW_LEFT:
            break
        out[todo] = encrypt(out[todo])
        todo = todo[out[todo] > np.uint64(max_index)]
    # Long walks (a split far smaller than the cipher's 2**16 block): grain's compiled
    # function, from the start, for the few indices left.
    from grain.experimental import index_shuffle as compiled

    for i in todo.tolist():
        out[i] = compiled(int(index[i]), max_index, seed & _M32, rounds)
    return out


class _Recent:
    """The last `size` values computed by key (thread safe; a value is computed outside the
    lock, so two threads may compute the same one: the values are pure functions of the
    key)."""

    def __init__(self, size: int):
        self.size = size
        self._values: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = make()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value


class EpochOrder:
    """Position in the endless stream -> record: `count` records, epoch by epoch.

    The shuffled order is computed in blocks of `BLOCK` consecutive positions of one epoch
    (a few NumPy operations for all of them) and the last `CACHED` blocks are kept:
    consecutive steps read consecutive positions, so a step costs a lookup."""

    BLOCK = 8192
    CACHED = 8

    def __init__(self, count: int, seed: int = 0, shuffle: bool = True):
        if count <= 0:
            raise ValueError(f"EpochOrder: count must be positive (got {count})")
        if not 0 <= seed < 2**32:
            raise ValueError(f"EpochOrder: seed must lie in [0, 2**32) (got {seed})")
        self.count, self.seed, self.shuffle = int(count), int(seed), bool(shuffle)
        self._blocks = _Recent(self.CACHED)

    def _block(self, epoch: int, block: int) -> np.ndarray:
        def make() -> np.ndarray:
            lo = block * self.BLOCK
            within = np.arange(lo, min(lo + self.BLOCK, self.count), dtype=np.uint64)
            return index_shuffle(within, self.count - 1,
                                 (self.seed + epoch) % 2**32).astype(np.int64)

        return self._blocks.get((epoch, block), make)

    def records(self, positions: np.ndarray | range) -> np.ndarray:
        """The records (int64) read at `positions` (non-negative)."""
        if isinstance(positions, range) and positions.step == 1 and len(positions) \
                and positions.start >= 0:          # a step's rows: one slice, no NumPy pass
            (epoch, lo), (last_epoch, hi) = (divmod(positions.start, self.count),
                                             divmod(positions.stop - 1, self.count))
            if epoch == last_epoch:
                if not self.shuffle:
                    return np.arange(lo, hi + 1, dtype=np.int64)
                (block, lo), (last_block, hi) = divmod(lo, self.BLOCK), divmod(hi, self.BLOCK)
                if block == last_block:
                    return self._block(epoch, block)[lo:hi + 1].copy()
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and positions.min() < 0:
            raise ValueError(f"EpochOrder: positions must be non-negative "
                             f"(got {int(positions.min())})")
        epoch, within = np.divmod(positions, self.count)
        if not self.shuffle:
            return within
        block, offset = np.divmod(within, self.BLOCK)
        keys = epoch * (self.count // self.BLOCK + 1) + block
        first, last = keys.min(initial=0), keys.max(initial=0)
        if first == last:                          # the common case: one block
            if not positions.size:
                return within
            return self._block(int(epoch.flat[0]), int(block.flat[0]))[offset]
        out = np.empty_like(within)
        for key in np.unique(keys):
            at = keys == key
            i = int(np.argmax(at))
            out[at] = self._block(int(epoch[i]), int(block[i]))[offset[at]]
        return out

    def __getitem__(self, position: int) -> int:
        return int(self.records(np.array([position]))[0])

    def describe(self) -> str:
        """The order in words, for the log and `spmd data info`."""
        if not self.shuffle:
            return f"file order, {self.count:,} records"
        return f"a full shuffle of the {self.count:,} records every epoch (grain's order)"


def _mix(*words: int) -> int:
    """A 32-bit seed from several integers (splitmix64 steps): the seed of one block's
    shuffle, from (seed, epoch, block)."""
    x = 0
    for w in words:
        x = (x + (w & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & _M32


class BlockOrder:
    """Position -> record for `data.shuffle_block` / `data.shuffle_mix`: the split is cut
    into blocks of `block` consecutive records (the last one shorter); every epoch visits
    the blocks in a shuffled order, `mix` at a time (a group), and reads the records of a
    group's blocks in a shuffled order. A stretch of steps therefore reads `mix` stretches
    of the files, which the readahead fetches whole (long reads on a cold cache or a
    parallel file system), while each batch draws from `mix` places of the split: the
    shards-and-interleave shuffle of WebDataset, tf.data's `interleave(cycle_length=mix)`
    and MosaicML Streaming's block shuffle.

    Both shuffles sort indices by a splitmix64 hash (`_shuffle`; no NumPy generator, whose
    streams may change between versions): the blocks' with seed `(seed + epoch) mod 2**32`,
    each group's records with a seed mixed from (seed, epoch, the group's blocks).
    Invariants: each epoch reads every record once; `records` is a pure function of (count,
    block, mix, seed, positions); `mix=1` is the order of spmd's first block shuffle (each
    block's records shuffled on their own), so runs made with it resume on the same
    batches."""

    CACHED = 4                  # group shuffles kept (a step touches one or two groups)

    def __init__(self, count: int, block: int, seed: int = 0, mix: int = 1):
        if count <= 0 or block <= 0 or mix <= 0:
            raise ValueError(f"BlockOrder: count, block and mix must be positive (got "
                             f"{count}, {block}, {mix})")
        if not 0 <= seed < 2**32:
            raise ValueError(f"BlockOrder: seed must lie in [0, 2**32) (got {seed})")
        self.count, self.block, self.seed = int(count), int(block), int(seed)
        self.mix = int(mix)
        self.blocks = -(-self.count // self.block)
        self._visits = _Recent(2)                    # this epoch's and the next one's
        self._groups = _Recent(self.CACHED)

    @staticmethod
    def _shuffle(n: int, seed: int) -> np.ndarray:
        """A permutation of range(n): the indices sorted by a 64-bit hash of (seed, index)
        (splitmix64 in NumPy: the same numbers on every machine and NumPy version; unlike
        a cipher over a power-of-two domain it costs the same for any n)."""
        x = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + \
            np.uint64((seed * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return np.argsort(x, kind="stable").astype(np.int64)

    def size(self, block: int) -> int:
        """Records in `block`."""
        return min(self.block, self.count - block * self.block)

    def visits(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch `epoch`'s blocks in visiting order (group `g` holds entries
        `g * mix .. g * mix + mix - 1`), and the position (within the epoch) where each
        group's visit starts (one more entry: the epoch's end)."""
        def make() -> tuple[np.ndarray, np.ndarray]:
            order = self._shuffle(self.blocks, (self.seed + epoch) % 2**32)
            sizes = np.where(order == self.blocks - 1, self.size(self.blocks - 1), self.block)
            sums = np.add.reduceat(sizes, np.arange(0, self.blocks, self.mix))
            return order, np.concatenate([[0], np.cumsum(sums)])

        return self._visits.get(epoch, make)

    def group_end(self, position: int) -> int:
        """The position where the group that reads `position` ends (the next group's
        first position, in this epoch or the next)."""
        epoch, within = divmod(int(position), self.count)
        starts = self.visits(epoch)[1]
        return epoch * self.count + int(starts[bisect.bisect_right(starts, within)])

    def _group(self, epoch: int, group: int) -> np.ndarray:
        """The records of epoch `epoch`'s group `group`, in the order they are read."""
        def make() -> np.ndarray:
            blocks = self.visits(epoch)[0][group * self.mix:(group + 1) * self.mix].tolist()
            members = np.concatenate([np.arange(b * self.block, b * self.block + self.size(b),
                                                dtype=np.int64) for b in blocks])
            return members[self._shuffle(members.size, _mix(self.seed, epoch, *blocks))]

        return self._groups.get((epoch, group), make)

    def records(self, positions: np.ndarray | range) -> np.ndarray:
        """The records (int64) read at `positions` (non-negative)."""
        if isinstance(positions, range) and positions.step == 1 and len(positions) \
                and positions.start >= 0:          # a step's rows: mostly one group's slice
            (epoch, lo), (last_epoch, hi) = (divmod(positions.start, self.count),
                                             divmod(positions.stop - 1, self.count))
            if epoch == last_epoch:
                starts = self.visits(epoch)[1]
                group = bisect.bisect_right(starts, lo) - 1
                if hi < starts[group + 1]:
                    first = int(starts[group])
                    return self._group(epoch, group)[lo - first:hi - first + 1].copy()
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and positions.min() < 0:
            raise ValueError(f"BlockOrder: positions must be non-negative "
                             f"(got {int(positions.min())})")
        epoch, within = np.divmod(positions, self.count)
        out = np.empty_like(within)
        for e in np.unique(epoch).tolist():
            at = np.flatnonzero(epoch == e)
            starts = self.visits(e)[1]
            groups = np.searchsorted(starts, within[at], side="right") - 1
            for g in np.unique(groups).tolist():
                these = at[groups == g]
                out[these] = self._group(e, g)[within[these] - starts[g]]
        return out

    def __getitem__(self, position: int) -> int:
        return int(self.records(np.array([position]))[0])

    def describe(self) -> str:
        """The order in words, for the log and `spmd data info`."""
        groups = -(-self.blocks // self.mix)
        return (f"blocks of {self.block:,} consecutive records, {self.mix} at a time with "
                f"their records shuffled together: {groups:,} group(s) of up to "
                f"{self.block * self.mix:,} records per epoch of {self.count:,}")


def auto_block(record_bytes: int) -> int:
    """The block `data.shuffle_block: auto` takes for records of `record_bytes` bytes: 1
    (a full shuffle) for records of AUTO_BLOCK_BYTES or more, each read long already."""
    return int(min(AUTO_BLOCK_MAX, max(1, AUTO_BLOCK_BYTES // max(1, int(record_bytes)))))


def make_order(count: int, seed: int, *, shuffle: bool = True, block: int | str | None = None,
               mix: int = 1, record_bytes: int = 0) -> EpochOrder | BlockOrder:
    """The order of a split as `data.shuffle_block` (`block`: "full", None or 1: grain's
    full shuffle; N: blocks of N records; "auto": `auto_block(record_bytes)`) and
    `data.shuffle_mix` (`mix`: blocks read at a time) say. An unshuffled split (eval) is
    file order whatever they say."""
    if block == "auto":
        block = auto_block(record_bytes)
    if not shuffle or block in FULL_SHUFFLE:
        return EpochOrder(count, seed, shuffle)
    return BlockOrder(count, int(block), seed, mix)
