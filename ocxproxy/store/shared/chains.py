"""What a replica of the shared tier knows of chains it read or wrote: their digests
(`Chains`), and each record's newest segments (`Newest`), both LRUs. A chain's list only
grows (a sibling forks another chain) and a record's history never changes, so neither
is ever stale: a record deleted or expired meanwhile is what BEGIN still reads."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ocxproxy.model import forget_oldest
from ocxproxy.store.resident import ResidentTier

CHAIN_DIGESTS = 200_000  # digests the chain cache holds (~25 MB), in chains used last
RECORDS = 32_768  # records whose newest digests are held (~7 MB: their strings are shared)
SLACK = 64  # past its limit, Newest lets its oldest go in batches of limit // this


class Chains:
    """The digests (hex) of the chains this replica read or wrote, by chain key: an LRU
    holding at most `limit` digests. A chain's list only grows (a sibling forks another
    chain), so a prefix held here is the server's for as long as the chain lives."""

    def __init__(self, limit: int = CHAIN_DIGESTS) -> None:
        self.limit, self.held = limit, 0
        self._by_key: OrderedDict[bytes, list[str]] = OrderedDict()

    def get(self, key: bytes) -> list[str] | None:
        names = self._by_key.get(key)
        if names is not None:
            self._by_key.move_to_end(key)
        return names

    def put(self, key: bytes, names: list[str]) -> None:
        """Hold `names` (never changed after) as the chain's digests, unless more are held."""
        held = self._by_key.pop(key, None)
        if held is not None:
            self.held -= len(held)
            names = held if len(held) > len(names) else names
        self._by_key[key] = names
        self.held += len(names)
        while self.held > self.limit and len(self._by_key) > 1:
            self.held -= len(self._by_key.popitem(last=False)[1])


class Newest:
    """The newest digests of the records this replica read or wrote, by response id (the
    last `limit` used): when a continuation's parent is one of them and its cache holds
    those segments, BEGIN need not send their values along (a continuation on the
    replica that made its parent, a turn off one parent again: their bytes each time).
    Past `limit` by a 64th, the oldest go down to `limit` at once (`forget_oldest`)."""

    def __init__(self, limit: int = RECORDS) -> None:
        self.limit = limit
        self.most = limit + limit // SLACK  # past this, down to `limit` at once
        self._by_id: dict[str, Sequence[str]] = {}

    def put(self, record_id: str, digests: Sequence[str]) -> None:
        by_id = self._by_id
        by_id.pop(record_id, None)  # (to the end: used last)
        by_id[record_id] = digests
        if len(by_id) > self.most:
            forget_oldest(by_id, self.limit)

    def held(self, record_id: str, cache: ResidentTier) -> bool:
        """Whether the record's newest segments are all in `cache`."""
        digests = self._by_id.get(record_id)
        return digests is not None and all(d in cache for d in digests)
