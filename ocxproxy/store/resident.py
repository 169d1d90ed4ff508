"""The resident tier: segment bytes in memory, least recently used first out, byte-capped.

The cap counts what the tier holds, not only the segments' payload: each resident segment
also costs its bytes object's header, malloc's chunk around it and its entry in the ordered
map (`ENTRY_BYTES`; with hex keys, the key string too). With ~1 KB segments that is a
fifth more than their payload, which a payload-only count would let grow past the cap.

Pure bookkeeping: no I/O, no asyncio. `admit`/`touch` never drop anything themselves;
`evict_over_budget()` takes the oldest out (the `hot` one, a fill every turn uses, last)
and returns them; the caller decides whether their bytes just go (the journal holds them)
or the segment is lost.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from operator import attrgetter

from ocxproxy.model import Segment

# Per resident segment beyond its payload: the bytes object's header (33), malloc's chunk
# header and alignment (~16: most segments are past pymalloc's 512 bytes), and the ordered
# map's entry (~155 traced once admits and evictions churn it: its table slots, its
# node and the node table).
ENTRY_BYTES = sys.getsizeof(b"") + 16 + 160
HEX_KEY_BYTES = sys.getsizeof("0" * 64)  # a segment's name as hex: a string of its own


class ResidentTier:
    def __init__(self, max_bytes: int, *, by_digest: bool = False) -> None:
        """Segments by key (hex), or `by_digest` (32 bytes: half the memory per entry)."""
        self.max_bytes = max_bytes
        self.bytes = 0  # what the resident segments hold: held() of each
        self.entry_bytes = ENTRY_BYTES + (0 if by_digest else HEX_KEY_BYTES)
        self._name = attrgetter("digest" if by_digest else "key")
        self._lru: OrderedDict[object, Segment] = OrderedDict()
        # A segment every turn of a client uses (the members the last turn's Response was
        # filled in with): it counts as the most recently used, whatever was used since,
        # so a turn that uses it again has nothing to touch.
        self.hot: Segment | None = None

    def __repr__(self) -> str:
        return f"<ResidentTier {len(self._lru)} segments {self.bytes}/{self.max_bytes}B>"

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, name: object) -> bool:
        return name in self._lru

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._lru.values())

    def held(self, segment: Segment) -> int:
        """The memory a resident `segment` costs: its payload and its entry."""
        return segment.size + self.entry_bytes

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
        self.bytes += self.held(segment)

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
            self.bytes -= self.held(segment)

    def evict_over_budget(self) -> list[Segment]:
        """Take the oldest segments out until the tier fits its budget (the `hot` one
        last); those taken."""
        excess = self.bytes - self.max_bytes
        victims: list[Segment] = []
        if excess <= 0:
            return victims
        hot = self.hot
        for segment in self._lru.values():
            if segment is hot:
                continue
            victims.append(segment)
            excess -= self.held(segment)
            if excess <= 0:
                break
        else:
            if hot is not None and self._lru.get(self._name(hot)) is hot:
                victims.append(hot)
        for segment in victims:
            self.remove(segment)
        return victims
