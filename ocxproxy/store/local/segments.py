"""The segments records share, and every change to their state (`SegmentTable`).

A segment is interned by digest (its content address) and counted by the records that hold
it; a segment may reach disk while, and only while, a durable record holds it
(`durable_refs`). Its bytes are in the resident tier, or in the journal at the place the
keydir records, or both, or lost. Store calls this table for every segment a record takes
or lets go; the table queues the journal's SEG entries and applies what the committer
reports for them. Nothing else writes a Segment's fields or the keydir.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import NO_ITEMS, Record, Segment
from ocxproxy.store.local import codec
from ocxproxy.store.local.codec import SEG, Loaded
from ocxproxy.store.local.committer import Committer, Offload, Outcome
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.keydir import Keydir
from ocxproxy.store.local.restore import rebuild
from ocxproxy.store.local.segment_files import FILES
from ocxproxy.store.resident import ResidentTier
from ocxproxy.store.shards import Shards

log = logging.getLogger("ocxproxy.store")

GHOSTS = 10_000  # remembered places of forgotten segments an in-flight child may adopt


class SegmentTable:
    def __init__(self, resident: ResidentTier, metrics: Metrics, offload: Offload) -> None:
        self.resident = resident
        self.metrics = metrics
        self.offload = offload
        self.by_key: Shards[bytes, Segment] = Shards()  # by digest; 100,000s: sharded
        self.keydir = Keydir()
        self.unwritten: dict[bytes, Segment] = {}  # queued, not yet committed
        self.sid = 0  # the last segment id given out
        # Set once the journal is open: where SEG entries go and bytes are read back.
        self.committer: Committer | None = None
        self.journal: Journal | None = None
        # Places of forgotten segments an in-flight child may take back (`adopt`): those
        # forgotten since the last checkpoint's capture, while none was being encoded.
        self._ghosts: OrderedDict[bytes, tuple[int, int, int, int]] = OrderedDict()
        self._encoding = False  # a checkpoint captured and not yet encoded

    def __len__(self) -> int:
        return len(self.by_key)

    def restore(self, loaded: Loaded, now: float) -> tuple[list[Record], list[str]]:
        """Start-up: the segments `loaded` describes, indexed and located; its live
        records, and the ids of those that need a segment that is gone (restore.py)."""
        self.sid = max(loaded.next_sid, 1) - 1
        found: dict[bytes, Segment] = {}
        records, missing = rebuild(loaded, now, found, self.keydir)
        self.by_key.absorb(found)
        self.keydir.sizes.update(loaded.sizes)
        return records, missing

    # -- records take and let go of segments ---------------------------------------------

    def intern(self, segment: Segment) -> Segment:
        """The table's segment with this content: `segment` itself when new."""
        existing = self.by_key.get(segment.digest)
        if existing is None:
            self.by_key[segment.digest] = segment
            self._admit(segment)
            return segment
        if existing.data is None:  # in the journal only, or lost: take the fresh bytes back
            existing.data = segment.data
            existing.lost = None
        if existing.ids is NO_ITEMS and segment.ids is not NO_ITEMS:
            existing.item_ids = segment.item_ids
            self.keydir.changed(existing)  # (a checkpoint's copy of its row is stale)
        self._admit(existing)
        return existing

    def adopt(self, segment: Segment, durable: bool, *, evicted: bool = False) -> Segment:
        """This table's segment for a segment object it does not index, for a record that
        is `durable` or not. Bytes it forgot but the journal still holds are taken back
        where they are (a ghost) while the durable index still names that place: no
        checkpoint captured since it forgot them, nor being encoded then (one leaves out
        a segment no record it names holds any more). So the new record's entry loads
        after a crash, and no checkpoint removes the file meanwhile (its removals are of
        files left before its capture). Otherwise, or when the record that held it was
        `evicted` here (what no live record holds stays gone, or eviction would not free
        it), the bytes are lost: EVICTED."""
        mine = self.by_key.get(segment.digest)
        if mine is segment:
            return mine
        if mine is not None:
            if mine.data is None and segment.data is not None and not evicted:
                mine.data, mine.lost = segment.data, None
                self._admit(mine)
            return mine
        copy = Segment.restore(
            segment.key,
            segment.size,
            segment.n_items,
            segment.call_ids,
            durable=False,
            data=None if evicted else segment.data,
            item_ids=segment.item_ids,
        )
        self.by_key[copy.digest] = copy
        if copy.data is not None:
            self._admit(copy)
            return copy
        ghost = None if evicted else self._ghosts.pop(copy.digest, None)
        if durable and ghost is not None and self._still_there(copy.key, ghost[0]):
            copy.sid = ghost[3]
            self.keydir.locate(copy, *ghost[:3])
        else:
            copy.lost = str(FailureReason.EVICTED)
        return copy

    def _still_there(self, key: str, pack: int) -> bool:
        """Are a forgotten segment's bytes still where they were (file `pack`)?"""
        return key in self.keydir.gone if pack == FILES else pack in self.keydir.sizes

    def take(self, segment: Segment, durable: bool) -> Segment:
        """`segment` for a new record: interned when it is new (or was forgotten)."""
        if segment.refs == 0 and segment.data is not None:  # new, or forgotten meanwhile
            return self.intern(segment)
        return self.adopt(segment, durable)

    def hold(self, segments: Sequence[Segment], *, durable: bool) -> None:
        """A record takes each segment. A segment may reach disk while, and only while, a
        durable record holds it: store:false content shared by a store:true turn (the
        same bytes, content-addressed) stops being durable when that turn goes."""
        if not durable:
            for segment in segments:
                segment.refs += 1
            return
        for segment in segments:  # (one loop per case: this runs over a whole chain a turn)
            segment.refs += 1
            segment.durable_refs += 1
            segment.durable = True

    def release(self, segments: Sequence[Segment], *, durable: bool) -> None:
        """A record lets go of each segment; one no record holds is forgotten."""
        for segment in segments:
            segment.refs -= 1
            if durable:
                segment.durable_refs -= 1
                if segment.durable_refs <= 0:
                    segment.durable = False
                    if segment.refs > 0:
                        self._undurable(segment)
            if segment.refs <= 0:
                self._forget(segment)

    def _undurable(self, segment: Segment) -> None:
        """Only records that may not reach disk still hold the segment: the journal's copy
        no longer counts (compaction drops it); bytes only there go with it."""
        if segment.on_disk:
            self.keydir.unlocate(segment)
            if segment.data is None:
                segment.lost = str(FailureReason.EVICTED)

    def _forget(self, segment: Segment) -> None:
        # The object keeps its bytes for anyone still holding it (an in-flight exchange's
        # parent record); put() adopts them back.
        del self.by_key[segment.digest]
        self.resident.remove(segment)
        if segment.pack >= 0 and not self._encoding:  # an in-flight child may need it (adopt)
            self._ghosts[segment.digest] = (
                segment.pack,
                segment.offset,
                segment.length,
                segment.sid,
            )
            if len(self._ghosts) > GHOSTS:
                self._ghosts.popitem(last=False)
        self.keydir.unlocate(segment)

    def _admit(self, segment: Segment) -> None:
        if segment.size:
            self.resident.admit(segment)

    def shed(self) -> None:
        """The resident tier back under its budget: bytes the journal holds just go,
        durable ones not yet written are queued for it, store:false content is lost."""
        for segment in self.resident.evict_over_budget():
            if segment.on_disk:
                segment.data = None  # the journal holds it: just release the bytes
            elif segment.digest in self.unwritten:
                pass  # released when its commit lands
            elif segment.durable and self.committer is not None:
                self.queue(segment)  # (a failed commit's) bytes: write them now
            else:  # store:false content, or no journal: gone
                segment.data = None
                segment.lost = str(FailureReason.EVICTED)
                self.metrics.store_evictions.labels(reason="resident_bytes").inc()

    # -- bytes ---------------------------------------------------------------------------

    async def fetch(self, segments: Sequence[Segment]) -> list[bytes]:
        """Bytes of each segment, reading the non-resident ones from the journal in a
        thread and taking them back into the resident tier."""
        datas = [s.data for s in segments]
        cold = list({id(s): s for s, d in zip(segments, datas, strict=True) if d is None}.values())
        for segment in cold:
            if segment.lost is not None:
                raise StoreFailure(FailureReason(segment.lost), segment.key)
            if not segment.on_disk or self.journal is None:
                raise StoreFailure(FailureReason.EVICTED, segment.key)
        results: list[Any] = []
        if cold:
            assert self.journal is not None
            jobs = [(s.key, s.size, s.pack, s.offset, s.length) for s in cold]
            results = await self.offload(self.journal.read_many, jobs)
        got: dict[int, bytes] = {}
        failure: StoreFailure | None = None
        for segment, result in zip(cold, results, strict=True):
            live = self.by_key.get(segment.digest) is segment
            if isinstance(result, bytes):
                self.metrics.spill_reads.inc()
                got[id(segment)] = result
                if live and segment.data is None:
                    segment.data = result
                    self._admit(segment)
                continue
            self.metrics.spill_failures.labels(reason=str(result.reason)).inc()
            log.warning("journal read failed for segment %s: %s", segment.key[:12], result)
            if live and result.reason != FailureReason.READ_FAILED and segment.data is None:
                self.keydir.lost(segment)
                segment.lost = segment.lost or str(result.reason)
            failure = failure or StoreFailure(FailureReason(segment.lost or result.reason))
        if failure is not None:
            raise failure
        if got:
            self.shed()
        return [d if d is not None else got[id(s)] for s, d in zip(segments, datas, strict=True)]

    async def response_bytes(self, record: Record) -> bytes:
        """A record's stored response object, its output items put back when they were cut,
        and the members the envelope filled in when they are a segment of their own."""
        response, cut, fill = record.response, record.output_at, record.fill
        wanted = [] if cut is None else [record.segments[-1]]
        if fill is not None:
            wanted.append(fill)
        if isinstance(response, Segment):
            skeleton, *got = await self.fetch((response, *wanted))
        else:
            skeleton = response if isinstance(response, bytes) else await self._read(response)
            got = await self.fetch(wanted) if wanted else []
        if cut is not None:
            offset, length = cut
            own = got[0]
            skeleton = b"".join((skeleton[:offset], own[len(own) - length :], skeleton[offset:]))
        if fill is not None:
            at = len(skeleton) - record.fill_at
            skeleton = b"".join((skeleton[:at], got[-1], skeleton[at:]))
        return skeleton

    async def _read(self, at: int) -> bytes:
        """A response's bytes from its record's journal entry (`model.place`)."""
        if self.journal is None:
            raise StoreFailure(FailureReason.EVICTED)
        try:
            data: bytes = await self.offload(self.journal.read_response, at)
        except StoreFailure as failure:
            self.metrics.spill_failures.labels(reason=str(failure.reason)).inc()
            log.warning("journal read failed for a response: %s", failure)
            raise
        self.metrics.spill_reads.inc()
        return data

    async def item_bytes(self, found: Sequence[tuple[Record, str]]) -> list[bytes]:
        """Each (record, item id)'s item, as the bytes its record's own segment holds."""
        segments = [record.segments[-1] for record, _ in found]
        datas = await self.fetch(segments)
        self.resident.touch_all(segments)
        result = []
        for segment, data, (_, item_id) in zip(segments, datas, found, strict=True):
            span = segment.item_ids.span(item_id)
            if span is None:  # cannot happen: the index holds only ids of own segments
                raise StoreFailure(FailureReason.UNKNOWN)
            result.append(data[span[0] : span[1]])
        return result

    # -- the journal's SEG entries -------------------------------------------------------

    def queue_missing(self, segments: Sequence[Segment]) -> None:
        """Queue each of a record's segments the journal neither holds nor awaits."""
        for segment in segments:
            # Queued means this very object: a record deleted before its commit can leave
            # its forgotten segment queued under the same key, with another sid.
            if segment.pack < 0 and self.unwritten.get(segment.digest) is not segment:
                self.queue(segment)

    def queue(self, segment: Segment, blob: bytes | None = None) -> None:
        """Queue a segment's bytes (`blob`: already compressed, moved by compaction)."""
        assert self.committer is not None
        data = segment.data if blob is None else None
        if blob is None and data is None:
            return  # lost: a row names it UNWRITTEN; start-up's chain answers EVICTED too
        if not segment.sid:
            self.sid += 1
            segment.sid = self.sid
        row = codec.segment_row(segment)
        size = len(blob) if blob is not None else segment.size
        self.committer.submit(SEG, (row, data, blob), segment, size)
        self.unwritten[segment.digest] = segment

    def committed(self, outcome: Outcome) -> None:
        """A commit's SEG entries: each segment is where it landed (pack, offset, length)."""
        assert outcome.places is not None
        self.keydir.sizes[outcome.pack] = outcome.size
        segment: Segment
        jobs = zip(outcome.jobs, outcome.subjects, outcome.places, strict=True)
        for (kind, _), segment, place in jobs:
            if kind != SEG:
                continue
            if self.unwritten.get(segment.digest) is segment:
                del self.unwritten[segment.digest]
            self.metrics.spill_writes.inc()
            if self.by_key.get(segment.digest) is not segment or not segment.durable:
                # Dropped meanwhile: its bytes in the journal are garbage; a file of its
                # own goes the way of any file no segment needs.
                if place[0] == FILES:
                    self.keydir.written_unneeded(segment.key)
                continue
            if segment.pack >= 0:
                self.keydir.unlocate(segment)  # moved by compaction
            self.keydir.locate(segment, *place)
            if segment.digest not in self.resident:  # only held for the write
                if segment.size:
                    segment.data = None
            elif not segment.n_items and segment.size:
                # A response object (no items): only GET /v1/responses/{id} reads it, so
                # once durable it leaves memory to the hot chain segments.
                self.resident.remove(segment)
                segment.data = None

    def not_written(self, segment: Segment) -> None:
        """A SEG entry whose commit failed."""
        if self.unwritten.get(segment.digest) is segment:
            del self.unwritten[segment.digest]
        if segment.digest not in self.resident and segment.pack < 0 and segment.size:
            segment.data = None  # only held for the write: not kept while disk is full
            segment.lost = str(FailureReason.WRITE_FAILED)

    # -- journal files -------------------------------------------------------------------

    def sized(self, pack: int, size: int) -> None:
        """Journal file `pack` is now `size` bytes (0: just opened)."""
        self.keydir.sizes[pack] = size

    def captured(self, pack: int) -> int:
        """A checkpoint captures the index, its journal continuing in new file `pack`:
        the capture's number (`Keydir.removable`). It names no segment forgotten before:
        none is taken back any more (`adopt`), nor one forgotten until it is `encoded`."""
        self.keydir.sizes[pack] = 0
        self.keydir.captures += 1
        self._ghosts.clear()
        self._encoding = True
        return self.keydir.captures

    def encoded(self) -> None:
        """The checkpoint captured last is encoded (or given up): a segment forgotten from
        now on is in it (encoded while still held) or in an entry the journal replays
        after it."""
        self._encoding = False

    def dropped(self, packs: Sequence[int]) -> None:
        """Journal files removed: nothing is located there any more."""
        for pack in packs:
            self.keydir.drop(pack)

    def in_file(self, pack: int, keys: Iterable[bytes]) -> list[Segment]:
        """The segments of digests `keys` (a slice of those the keydir lists for file `pack`) still
        located there and not queued (compaction)."""
        get, unwritten, out = self.by_key.get, self.unwritten, []
        for key in keys:
            segment = get(key)
            if segment is not None and segment.pack == pack and key not in unwritten:
                out.append(segment)
        return out

    def move(self, segment: Segment, blob: bytes | None, pack: int, offset: int) -> None:
        """Compaction read `blob` at (pack, offset): queue it again, unless the segment
        moved, went, or is already queued meanwhile."""
        if blob is None or segment.pack != pack or segment.offset != offset:
            return
        if self.by_key.get(segment.digest) is segment and segment.digest not in self.unwritten:
            self.queue(segment, blob)
