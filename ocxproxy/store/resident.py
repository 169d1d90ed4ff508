"""The resident tier: segment bytes in memory, least recently used first out, byte-capped.

Pure bookkeeping: no I/O, no asyncio. `admit`/`touch` never drop anything themselves;
`evict_over_budget()` takes the oldest out and returns them; the caller decides whether
their bytes just go (the journal holds them) or the segment is lost.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from operator import attrgetter

from ocxproxy.model import Segment


class ResidentTier:
    def __init__(self, max_bytes: int, *, by_digest: bool = False) -> None:
        """Segments by key (hex), or `by_digest` (32 bytes: half the memory per entry)."""
        self.max_bytes = max_bytes
        self.bytes = 0
        self._name = attrgetter("digest" if by_digest else "key")
        self._lru: OrderedDict[object, Segment] = OrderedDict()

    def __repr__(self) -> str:
        return f"<ResidentTier {len(self._lru)} segments {self.bytes}/{self.max_bytes}B>"

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, name: object) -> bool:
        return name in self._lru

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._lru.values())

    def get(self, name: object) -> Segment | None:
        return self._lru.get(name)

    def get_all(self, keys: Sequence[object]) -> list[Segment | None]:
        """get() of each key (one C-level pass: a chain's worth per continuation)."""
        return list(map(self._lru.get, keys))

    def admit(self, segment: Segment) -> None:
        name = self._name(segment)
        if name in self._lru:
            self._lru.move_to_end(name)
            return
        self._lru[name] = segment
        self.bytes += segment.size

    def touch_all(self, segments: Sequence[Segment]) -> None:
        """Mark a whole chain recently used (the hot path: one C-level pass)."""
        lru = self._lru
        keys = list(map(self._name, segments))
        try:
            deque(map(lru.move_to_end, keys), maxlen=0)
        except KeyError:  # some segment is not resident: the slow, checking way
            for key in keys:
                if key in lru:
                    lru.move_to_end(key)

    def remove(self, segment: Segment) -> None:
        if self._lru.pop(self._name(segment), None) is not None:
            self.bytes -= segment.size

    def evict_over_budget(self) -> list[Segment]:
        """Take the oldest segments out until the tier fits its budget; those taken."""
        excess = self.bytes - self.max_bytes
        victims: list[Segment] = []
        if excess <= 0:
            return victims
        for segment in self._lru.values():
            victims.append(segment)
            excess -= segment.size
            if excess <= 0:
                break
        for segment in victims:
            self.remove(segment)
        return victims
