"""Which members (stores) of a dataset are open, and for whom: leases.

A mixin of spmd.data.sources.arrays.ArraySource: it uses the source's `files` (the dataset's
members), `_where`, `_lock`, `_stores` (member -> open Store, least recently used first),
`_busy` (member -> leases held), `opened_files` and `max_open`.

Invariants:
- A member is opened when first leased and stays open while any lease on it is held
  (several threads read at once: the feed's background reads, the readahead).
- At most `max_open` members stay open: the least recently used idle ones are closed
  beyond that; a member leased again is opened again.
- `_members([i, ...])` takes the leases of a whole call under one lock acquisition.
"""

from __future__ import annotations

from typing import Any

from spmd.data.formats.stores import Store

__all__ = ["MemberLeases"]


class MemberLeases:
    """Open members on demand, closed least recently used beyond `max_open`."""

    def _member(self, i: int) -> _Lease:
        return _Lease(self, [i], single=True)

    def _members(self, members: list[int]) -> _Lease:
        """`with source._members([i, ...]) as stores:` {i: store}, leased with one lock."""
        return _Lease(self, members, single=False)

    def _acquire(self, members: list[int]) -> dict[int, Store]:
        with self._lock:
            stores = {}
            try:
                for i in members:
                    store = self._stores.get(i)
                    if store is None:
                        member = self.files.members[i]
                        store = Store(member.path, self._where(i), member.format)
                        self._stores[i] = store
                        self.opened_files.append(str(member.path))
                    self._stores.move_to_end(i)
                    self._busy[i] += 1
                    stores[i] = store
            except BaseException:
                self._release(list(stores))
                raise
            self._evict()
            return stores

    def _release(self, members: list[int]) -> None:
        with self._lock:
            for i in members:
                self._busy[i] -= 1
            self._evict()

    def _evict(self) -> None:
        """Close the least recently used idle members beyond `max_open`."""
        excess = len(self._stores) - self.max_open
        if excess <= 0:
            return
        for j in [j for j in self._stores if self._busy[j] <= 0][:max(excess, 0)]:
            self._stores.pop(j).close()


class _Lease:
    """`with source._member(i) as store:` the member open, and not closed while in use
    (`_members([i, ...])`: {i: store} for several members)."""

    def __init__(self, source: MemberLeases, members: list[int], single: bool):
        self.source, self.members, self.single = source, members, single

    def __enter__(self) -> Any:
        stores = self.source._acquire(self.members)
        return stores[self.members[0]] if self.single else stores

    def __exit__(self, *exc: Any) -> None:
        self.source._release(self.members)
