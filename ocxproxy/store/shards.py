"""A map split over `SHARDS` plain dicts by its keys' hash (`Shards`), for the store's maps
of 100,000s of entries.

A dict grows, or rebuilds itself once deletes have filled it with dummies, by copying every
entry in one step: 10-50 ms with the event loop stopped at a few hundred thousand entries
(the item index's 28 ms, under `serve` at 100,000 records). Spread over SHARDS dicts, one
such step copies a SHARDS-th of them. A lookup costs one Python call more than a dict's;
the order of insertion is kept per shard only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, MutableMapping
from typing import TypeVar, overload

SHARDS = 61  # prime: ids (addresses) are aligned

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")


class Shards(MutableMapping[K, V]):
    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, default: V | D, /) -> V | D: ...
    def get(self, key: K, default: object = None) -> object:
        return self.shards[hash(key) % SHARDS].get(key, default)

    def __getitem__(self, key: K) -> V:
        return self.shards[hash(key) % SHARDS][key]

    def __setitem__(self, key: K, value: V) -> None:
        self.shards[hash(key) % SHARDS][key] = value

    def __delitem__(self, key: K) -> None:
        del self.shards[hash(key) % SHARDS][key]

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) % SHARDS]

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __iter__(self) -> Iterator[K]:
        for shard in self.shards:
            yield from shard

    def absorb(self, entries: dict[K, V]) -> None:
        """Add every entry of `entries` (start-up's 100,000s, in one loop)."""
        shards = self.shards
        for key, value in entries.items():
            shards[hash(key) % SHARDS][key] = value
