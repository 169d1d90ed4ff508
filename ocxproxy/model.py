"""Value types shared by the layers: segments, records, and what a turn adds. Stdlib only."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


class Segment:
    """The serialized items one turn added to its chain: comma-joined JSON values.

    Immutable content, named by its SHA-256; shared by every later record of the chain.
    `data` is None while the bytes live only in the disk tier (or were lost).
    """

    __slots__ = ("call_ids", "data", "durable", "key", "n_items", "on_disk", "refs", "size")

    def __init__(
        self, data: bytes, n_items: int, call_ids: frozenset[str], *, durable: bool
    ) -> None:
        self.key = hashlib.sha256(data).hexdigest()
        self.data: bytes | None = data
        self.size = len(data)
        self.n_items = n_items
        self.call_ids = call_ids
        self.durable = durable  # may this reach disk (no store:false content)?
        self.on_disk = False
        self.refs = 0

    def __repr__(self) -> str:
        where = ("mem" if self.data is not None else "") + ("+disk" if self.on_disk else "")
        return f"<Segment {self.key[:12]} {self.size}B {where} refs={self.refs}>"


@dataclass(slots=True)
class Record:
    """One remembered response: its scope, lifetime, and the chain of segments behind it."""

    id: str
    scope: str
    created_at: float
    expires_at: float
    durable: bool  # store:true (may be written to disk)
    segments: tuple[Segment, ...]
    response: Segment  # the response object as JSON, for GET /v1/responses/{id}
    backend: str | None = None
    affinity_key: str | None = None
    n_items: int = field(default=0)

    def has_call_id(self, call_id: str) -> bool:
        return any(call_id in seg.call_ids for seg in self.segments)


@dataclass(frozen=True, slots=True)
class Turn:
    """What one finished turn adds: the new items (input tail + output) and the response."""

    response_id: str
    scope: str
    durable: bool
    items: bytes  # comma-joined serialized items
    n_items: int
    call_ids: frozenset[str]
    response: bytes
    backend: str | None = None
    affinity_key: str | None = None
