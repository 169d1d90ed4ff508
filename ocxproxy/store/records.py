"""The index of records (`Records`): by id, in the order they came (`chunks`), by item id
(items.py), the ids of records that went (so a lookup says why it failed), and the records
kept until deleted (pinned: conversations) with their bytes. Store alone changes it, on
put, keep, restore and drop; it reads `by_id` directly on the hot path.

No map of it holds all of 100,000s of records, so none grows, or is rebuilt after deletes,
by copying them all in one step of the event loop (one OrderedDict of every record took
14-22 ms every ~70,000 inserts under `serve` at 100,000 records): `by_id` is `Shards`, and
the order, oldest first, is kept apart in chunks: plain dicts of at most `CHUNK` records
each, by number, oldest first; a record knows its chunk (`Record.chunk`), so it leaves it
at once. Only the newest chunk takes new records; an older one is copied smaller as it
empties (at `CHUNK // 4` records, then at every power of two), and goes once empty. So an
older chunk whose count has not changed holds the very records it held: the checkpoint
copies such a chunk's rows from its previous file (upkeep.encode_checkpoint), unless one of
its records changed otherwise since (`changed`: its response moved by compaction).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Chain, Record, Segment, Turn
from ocxproxy.store.items import ItemIndex
from ocxproxy.store.shards import Shards

REMEMBERED = 10_000  # ids of records that went, kept to answer why a lookup failed
NEVER = 1e18  # the expiry of a record kept until deleted (a conversation)
CHUNK = 4096  # records per chunk of the order (the most one step copies or scans)


class Records:
    __slots__ = (
        "by_id",
        "changed_at",
        "chunks",
        "count",
        "failed",
        "items",
        "newest",
        "pinned",
        "pinned_bytes",
        "tombstones",
    )

    def __init__(self) -> None:
        self.by_id: Shards[str, Record] = Shards()
        # chunk number -> its records, oldest first; the newest (`newest`) is always there
        self.chunks: dict[int, dict[str, Record]] = {0: {}}
        self.newest = 0
        self.count = 0
        # chunk number -> when (the caller's clock: the keydir's capture number) a record
        # of it last changed its checkpoint row in place (`changed`)
        self.changed_at: dict[int, int] = {}
        self.items = ItemIndex()
        self.tombstones: OrderedDict[str, FailureReason] = OrderedDict()
        self.failed: OrderedDict[str, StoreFailure] = OrderedDict()  # ids whose commit failed
        self.pinned: Shards[str, int] = Shards()  # id -> bytes of each record kept until deleted
        self.pinned_bytes = 0  # their sum

    def __len__(self) -> int:
        return self.count

    def _place(self, record: Record) -> None:
        """Put `record` last in the order."""
        chunk = self.chunks[self.newest]
        if len(chunk) >= CHUNK:
            self.newest += 1
            chunk = self.chunks[self.newest] = {}
        chunk[record.id] = record
        record.chunk = self.newest

    def unknown(self, record_id: str, *, found: bool) -> StoreFailure:
        """Why a lookup found no record of the caller's: the reason its record went, or
        unknown (another scope's record, `found`, is unknown too)."""
        reason = self.tombstones.get(record_id) if not found else None
        return StoreFailure(reason if reason is not None else FailureReason.UNKNOWN)

    def add(self, record: Record, pinned: int | None = None) -> None:
        """Index `record` (its id free), pinned with `pinned` bytes unless None."""
        self.by_id[record.id] = record
        self._place(record)
        self.count += 1
        self.items.add(record)
        if pinned is not None:
            self.pinned[record.id] = pinned
            self.pinned_bytes += pinned
        self.tombstones.pop(record.id, None)
        self.failed.pop(record.id, None)

    def restore(self, records: Iterable[Record], missing: Iterable[str]) -> None:
        """Start-up's records, oldest first, and the ids of those that could not be (a
        segment gone: missing)."""
        for rid in missing:
            self.tombstone(rid, FailureReason.MISSING)
        records = list(records)
        by_id, tombstones, failed, place = self.by_id, self.tombstones, self.failed, self._place
        for record in records:  # add()'s work, in one loop (100,000s of records)
            by_id[record.id] = record
            place(record)
            if record.expires_at >= NEVER:
                kept = {s.digest: s.size for s in record.segments}
                self.pinned[record.id] = size = sum(kept.values()) + record.response_size
                self.pinned_bytes += size
            if tombstones or failed:
                tombstones.pop(record.id, None)
                failed.pop(record.id, None)
        self.count += len(records)
        self.items.add_all(records)

    def remove(self, record: Record, reason: FailureReason | None) -> None:
        """Take `record` out; with a `reason`, a lookup of its id answers with it."""
        del self.by_id[record.id]
        self.count -= 1
        number = record.chunk
        chunk = self.chunks[number]
        del chunk[record.id]
        left = len(chunk)
        if number != self.newest and left <= CHUNK // 4 and not left & (left - 1):
            if left:  # a copy holds only what is left (a dict never shrinks by deletes)
                self.chunks[number] = dict(chunk)
            else:
                del self.chunks[number]
                self.changed_at.pop(number, None)
        self.pinned_bytes -= self.pinned.pop(record.id, 0)
        self.items.remove(record)
        if reason is not None:
            self.tombstone(record.id, reason)

    def tombstone(self, record_id: str, reason: FailureReason) -> None:
        self.tombstones[record_id] = reason
        if len(self.tombstones) > REMEMBERED:
            self.tombstones.popitem(last=False)

    def fail(self, record_id: str, failure: StoreFailure) -> None:
        """`commit` of this id answers `failure` (its record went: never acknowledged)."""
        self.failed[record_id] = failure
        if len(self.failed) > REMEMBERED:
            self.failed.popitem(last=False)

    def __iter__(self) -> Iterator[Record]:
        """Every record, oldest first (change none while iterating)."""
        for chunk in self.chunks.values():
            yield from chunk.values()

    def oldest(self) -> list[Record]:
        """Every record, oldest first, as a list (a copy from C: ~1 ms at 100,000)."""
        out: list[Record] = []
        for chunk in self.chunks.values():
            out += chunk.values()
        return out

    def layout(self) -> list[tuple[int, int]]:
        """Each chunk's number and count, oldest first (`oldest()` is their records)."""
        return [(number, len(chunk)) for number, chunk in self.chunks.items()]

    def unchanged(self, number: int, count: int, since: int) -> bool:
        """Chunk `number` holds `count` records and none changed its row (`changed`) at or
        after `since`: when it was an older chunk of `count` records then, the same ones."""
        chunk = self.chunks.get(number)
        return chunk is not None and len(chunk) == count and self.changed_at.get(number, -1) < since

    def changed(self, record: Record, when: int) -> None:
        """`record` (indexed) changed its checkpoint row in place at `when`."""
        self.changed_at[record.chunk] = when

    def oldest_unpinned(self) -> Record | None:
        return next((r for r in self if r.expires_at < NEVER), None)

    def numbers(self) -> list[int]:
        """The chunks' numbers, oldest first."""
        return list(self.chunks)

    def expired(self, number: int, now: float) -> list[Record]:
        """The records of chunk `number` (if it is still there) expired at `now`."""
        chunk = self.chunks.get(number, {})
        return [r for r in chunk.values() if r.expires_at <= now]

    def problems(self) -> list[str]:
        """Drift between `by_id`, the order, the count and the pins (for check.py)."""
        out: list[str] = []
        in_order = len(self.oldest())
        if not len(self.by_id) == in_order == self.count:
            out.append(f"{len(self.by_id)} records by id, {in_order} in order, {self.count}")
        if list(self.chunks) != sorted(self.chunks) or self.newest != max(self.chunks):
            out.append(f"chunks out of order: {list(self.chunks)}, newest {self.newest}")
        for number, chunk in self.chunks.items():
            if len(chunk) > CHUNK:
                out.append(f"chunk {number} holds {len(chunk)} records")
            for record in chunk.values():
                if record.chunk != number or self.by_id.get(record.id) is not record:
                    out.append(f"{record.id} in chunk {number} (its own {record.chunk}), not by id")
        for record in self:
            if (record.expires_at >= NEVER) != (record.id in self.pinned):
                out.append(
                    f"{record.id} pinned {record.id in self.pinned}, expires {record.expires_at}"
                )
        if sum(self.pinned.values()) != self.pinned_bytes or len(self.pinned) > self.count:
            out.append("pinned bytes drifted")
        return out

    def holder(
        self, scope: str, item_id: str, now: float, *, unstored: bool
    ) -> tuple[Record | None, list[Record]]:
        """The newest live record of `scope` whose turn added an item with this id and can
        serve it (one a client did not ask to store only with `unstored`), and the expired
        records met on the way (for the store to drop)."""
        expired: list[Record] = []
        for record in self.items.newest(scope, item_id):
            own = record.segments[-1]
            if record.expires_at <= now:
                expired.append(record)
            elif (record.stored or unstored) and (own.data is not None or own.on_disk):
                return record, expired  # (a holder whose bytes were dropped cannot serve it)
        return None, expired

    def shared(self, record_id: str, chain: Sequence[Segment], durable: bool) -> int:
        """How many leading segments of `chain` the present record `record_id` holds too,
        the same objects: an append keeps them."""
        old = self.by_id.get(record_id)
        if (
            old is None
            or old.durable != durable
            or tuple(chain[: len(old.segments)]) != old.segments
        ):
            return 0
        return len(old.segments)

    def pinned_size(
        self, record_id: str, chain: Sequence[Segment], shared: int, meta: int, entry: int = 0
    ) -> int:
        """The bytes record `record_id` pins once rewritten with `chain`, whose first
        `shared` segments its present version holds, and `meta` bytes of metadata; with
        `entry` more for each segment (in memory: what the resident tier counts)."""
        old = self.by_id.get(record_id)
        if old is not None and shared and record_id in self.pinned:
            size = self.pinned[record_id] - old.response_size  # its entry: the new meta's
            return size + sum(s.size + entry for s in chain[shared:]) + meta
        unique = {s.digest: s for s in chain}.values()
        return sum(s.size + entry for s in unique) + meta + entry

    def fits(self, record_id: str, size: int, cap: float, max_entries: int) -> bool:
        """Can pinned record `record_id` (or a new one) take `size` bytes with no cap
        having to drop pinned records: pinned bytes against `cap`, their number against
        `max_entries`?"""
        if record_id not in self.pinned and len(self.pinned) >= max_entries:
            return False
        return self.pinned_bytes - self.pinned.get(record_id, 0) + size <= cap


R = TypeVar("R", bound=Record)


def own_segment(turn: Turn, *, durable: bool) -> Segment:
    """A turn's own segment: its items, the bytes the backend was sent."""
    return Segment(turn.items, turn.n_items, turn.call_ids, durable=durable, item_ids=turn.item_ids)


def turn_record(
    kind: type[R],
    turn: Turn,
    parent: Record | None,
    *,
    now: float,
    ttl: float,
    durable: bool,
    links: Chain,
    segments: tuple[Segment, ...],
    response: Segment | bytes,
    output_at: tuple[int, int] | None,
) -> R:
    """A finished turn's record on top of `parent`'s chain (`segments`, its own last),
    expiring `ttl` after `now`: as each store's `put` builds it."""
    return kind(
        id=turn.response_id,
        scope=sys.intern(turn.scope),  # (each request's is a new string of its own)
        created_at=now,
        expires_at=now + ttl,
        durable=durable,
        links=links,
        response=response,
        backend=turn.backend,
        affinity_key=turn.affinity_key,
        n_items=(parent.n_items if parent else 0) + turn.n_items,
        output_at=output_at,
        stored=turn.stored,
        built=segments,
    )
