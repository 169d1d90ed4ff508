"""The maintenance policy's numbers (disk cap, compaction, checkpoint schedule) and the
checkpoint's encoding, in steps between which the event loop runs.

A step ends once it has worked `STEP` seconds (`Pacer`), so no step of a checkpoint keeps
the loop long at any store size, and the next begins `GAP` seconds later, not at the
loop's next pass: a turn takes several passes (its request, the backend's answer, its
commit, its answer), and with a step in every pass it would wait a step at each; a
checkpoint takes about twice the wall time for the same CPU (docs/BENCHMARKS.md, the
latency window's checkpoint row). The encoding also keeps the cyclic GC quiet: rows are
dumped `CHUNK` at a time (fewer live lists than a generation-0 collection waits for,
each freed before the next chunk), and its bookkeeping holds only ints and strings (which
the GC does not track): at 100,000 records the old encoding set off ~800 collections, 6
of them full passes of 10-16 ms each, with the loop stopped.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ocxproxy.model import Record, Segment
from ocxproxy.store.local import codec
from ocxproxy.store.local.segment_files import FILES
from ocxproxy.store.shards import SHARDS, Shards

CHECKPOINT_BYTES = 16 * 1024**2  # journal bytes since the last checkpoint that call for one
CHECKPOINT_AGE = 120.0  # seconds a change may wait for a checkpoint (it is durable already)
STEP = 0.001  # seconds a checkpoint or compaction works before it yields to the event loop
GAP = 0.001  # seconds it then leaves the loop to the rest (so it takes at most about half)
CHUNK = 160  # rows per checkpoint chunk: dumped, and their ~500 lists freed, at once
SCAN = 1024  # segments compaction's scan looks at between checks of the step's time (~1 ms)
LINKS = 1024  # a copied chunk's records whose chain links are mapped in one step (Named)
COMPACT_BELOW = 0.5  # a journal file with less live data than this is compacted
COMPACT_BATCH = 500  # segments moved per commit (its outcome is applied in one step)
COMPACT_BYTES = 32 * 1024**2  # most bytes one checkpoint's compaction moves
MAINTAIN_EVERY = 0.5
DISK_KEEP = 0.6  # share of --max-disk-bytes live segments and the checkpoint may fill
DISK_LOW = 0.5  # share the disk cap's eviction takes them down to, below DISK_KEEP
CAP_GAP = 5.0  # least seconds between two checkpoints the disk cap calls for
CAP_BACKOFF = 60.0  # most, doubling from CAP_GAP while each leaves the store over


class Pacer:
    """Yields to the event loop for `GAP` seconds once the current step has worked `STEP`
    seconds."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since = time.perf_counter()

    async def pause(self) -> None:
        if time.perf_counter() - self.since >= STEP:
            await asyncio.sleep(GAP)
            self.since = time.perf_counter()


@dataclass(slots=True)
class FileRows:
    """A journal file's segment rows in a checkpoint: how many keys the keydir listed for
    it, the rows, the SEGS entries holding them (their indexes among the checkpoint's
    entries) and, once the file is written, where those are in it (`copies`)."""

    keys: int
    rows: int = 0
    at: list[int] = field(default_factory=list)
    copies: list[codec.Copied] = field(default_factory=list)

    def written(self, places: Sequence[tuple[int, int, int]]) -> None:
        """The checkpoint is written: each entry's (offset, length, crc32) in its file."""
        self.copies = [codec.Copied(*places[i]) for i in self.at]


@dataclass(slots=True)
class ChunkRows(FileRows):
    """A chunk of the records' order's rows in a checkpoint (`keys`: its records then,
    each with a row), and what else those rows depend on: the parent rows they named in
    other chunks (`after`: that chunk's number and the id of the parent's chain link, in
    pairs; 16 bytes each, kept until the next checkpoint), and whether one lists its whole
    chain though a link precedes its own (`loose`: no row before it was out with that
    link)."""

    after: array[int] = field(default_factory=lambda: array("q"))
    loose: bool = False


class Named:
    """id(chain link) -> the id of the record whose row is out with it, one map per chunk
    of the records' order, in order (no map grows past a chunk: one of 100,000 entries
    grows by copying them all at once, ~4 ms). A copied chunk's map is filled only when a
    lookup reaches it, in steps (`reach`): one that finds no parent (its record deleted,
    or a conversation's turn, whose parent record was rewritten) reaches every chunk
    before its own, ~40 ms of mapping at 100,000 records. Ints and strings only: the GC
    does not track the maps."""

    __slots__ = ("at", "found", "here", "maps", "missed", "numbers", "unfilled")

    def __init__(self) -> None:
        self.maps: list[dict[int, str]] = []
        self.numbers: list[int] = []
        self.at: dict[int, int] = {}  # chunk number -> its map's index
        self.unfilled: list[list[Record] | None] = []
        self.here: dict[int, str] = {}  # the chunk being encoded
        self.found = array("q")  # the parents its rows named in other chunks (ChunkRows)
        self.missed = False  # a lookup found no parent

    def begin(self, number: int, copied: list[Record] | None = None) -> None:
        """The next chunk: its rows are encoded (filling `here`), or they were `copied`,
        every one of these records with a row."""
        self.here = {}
        self.at[number] = len(self.maps)
        self.maps.append(self.here)
        self.numbers.append(number)
        self.unfilled.append(copied)
        self.found, self.missed = array("q"), False

    def earlier(self, key: int) -> str | None:
        """The record named by link id `key` in an earlier chunk, the latest first."""
        maps, unfilled = self.maps, self.unfilled
        for i in range(len(maps) - 2, -1, -1):
            records = unfilled[i]
            if records is not None:  # (`reach` filled those its rows' lookups reach)
                unfilled[i] = None
                self._map(i, records)
            parent = maps[i].get(key)
            if parent is not None:
                self.found += array("q", (self.numbers[i], key))
                return parent
        self.missed = True
        return None

    async def reach(self, records: list[Record], pacer: Pacer) -> None:
        """Fill, LINKS records a step, the maps of copied chunks that the parent lookups of
        `records` (the next rows of the chunk being encoded) will reach: a parent neither
        in this chunk nor in a filled map is looked for in the chunks before, the latest
        first. (A parent in this chunk whose row is left out, one of its segments lost, is
        looked for by `earlier`, all at once: that is rare.)"""
        maps, unfilled, here = self.maps, self.unfilled, self.here
        if not any(u is not None for u in unfilled):
            return
        own = {id(r.links) for r in records}
        for r in records:
            link = r.links
            if link is None or link.prev is None or r.ids is not None or not r.durable:
                continue
            key = id(link.prev)
            if key in here or key in own:
                continue
            for i in range(len(maps) - 2, -1, -1):
                copied = unfilled[i]
                if copied is not None:
                    unfilled[i] = None
                    for start in range(0, len(copied), LINKS):
                        self._map(i, copied[start : start + LINKS])
                        await pacer.pause()
                if key in maps[i]:
                    break

    def _map(self, i: int, records: list[Record]) -> None:
        """Map these records' chain links in the map of chunk `i` (a copied chunk's: each
        of them has a row)."""
        named = self.maps[i]
        for r in records:
            link = r.links
            if link is not None:
                named[id(link)] = r.id

    def still(self, after: array[int], copied: set[int]) -> bool:
        """Is each of these parent rows out again? (Each chain link is one record's, whose
        id never changes: a chunk copied holds it as before; one encoded has its link in
        its map if its row is out. The links are alive: the records copied hold them.)"""
        for n in range(0, len(after), 2):
            number = after[n]
            if number not in copied:
                at = self.at.get(number)
                if at is None or after[n + 1] not in self.maps[at]:
                    return False
        return True


async def encode_checkpoint(
    position: tuple[int, int],
    written_at: float,
    next_sid: int,
    placed: Sequence[tuple[int, list[bytes]]],
    by_key: Shards[bytes, Segment],
    records: list[Record],
    layout: Sequence[tuple[int, int]],
    uncommitted: Collection[str] = (),
    previous: Mapping[int, FileRows] | None = None,
    unchanged: Callable[[int], bool] = lambda pack: False,
    chunks_before: Mapping[int, ChunkRows] | None = None,
    chunk_unchanged: Callable[[int, int], bool] = lambda number, count: False,
) -> tuple[list[codec.Entry | codec.Copied], int, dict[int, FileRows], dict[int, ChunkRows]]:
    """The checkpoint at journal `position` of the segments located in the files before it
    (`placed`: each file and the digests the keydir lists for it, looked up in `by_key` as
    they are read) and of `records` (the durable ones, but those whose ids are
    `uncommitted`; `layout`: the number and count of each chunk of the store's order they
    are, records.Records), as entries to write, how many records it names, and its rows of
    each journal file and of each chunk. A record is named by its parent's row when that
    row is out already; a record that needs a segment the journal does not hold is left
    out. Each chunk's rows are entries of their own.

    A journal file's rows in the `previous` checkpoint (the file being replaced) are
    copied from it, not encoded again, when they would come out the same: the keydir
    lists as many keys for the file as then, and no segment left it or changed its row
    there since that checkpoint's capture (`unchanged`). Files before the position are
    never appended to, so its segments are then the very ones, where they were.

    So are a chunk's rows (`chunks_before`), when they would come out the same: it was an
    older chunk then, each of its records had a row, it holds as many now, none changed
    its row in place since nor lost a segment (`chunk_unchanged`), and the parent rows its
    rows named in other chunks are out again (copied, or encoded with the same link). A
    row that listed its whole chain though a link preceded its own names no parent again
    if every record before it had a row then: that link's record is none of them, and
    records only join the order at its end.

    Nothing is filtered at the capture (100,000 records at once would stall the loop):
    the records' list is read here chunk by chunk, and emptied as it is read (letting go
    of 100,000 objects at the end would be one long step), and the segments are read
    where they are now. A segment located before `position` at the capture is still
    there unless no record holds it any more, and then each record captured that held
    it was dropped since (its DEL, expiry or new PUT follows `position`)."""
    chunks: list[codec.Entry | codec.Copied] = [codec.encode_head(position, written_at, next_sid)]
    pacer = Pacer()
    n_segs = n_recs = 0
    files: dict[int, FileRows] = {}
    shards = by_key.shards  # (looked up here: Shards.get is a Python call a segment)
    for pack, keys in placed:
        rows_of = FileRows(len(keys))
        was = previous.get(pack) if previous and pack != FILES else None
        if was is not None and was.keys == len(keys) and unchanged(pack):
            rows_of.rows, rows_of.at = was.rows, list(range(len(chunks), len(chunks) + len(was.at)))
            chunks += was.copies
            n_segs += was.rows
            files[pack] = rows_of
            continue
        for start in range(0, len(keys), CHUNK):
            found = [shards[hash(k) % SHARDS].get(k) for k in keys[start : start + CHUNK]]
            rows = codec.checkpoint_segment_rows(found, pack)
            if rows:
                rows_of.rows += len(rows)
                rows_of.at.append(len(chunks))
                chunks.append(codec.encode_chunk(codec.SEGS, rows))
            await pacer.pause()
        n_segs += rows_of.rows
        if pack != FILES:  # (a file of segment files, whose keys come and go: never copied)
            files[pack] = rows_of
    named = Named()
    kept: dict[int, ChunkRows] = {}
    copied: set[int] = set()
    whole_so_far = True  # every record of the chunks so far has a row
    newest = len(layout) - 1  # (the chunk that takes new records)
    for n, ((number, count), recs) in enumerate(zip(layout, _split(records, layout), strict=True)):
        was = chunks_before.get(number) if chunks_before else None
        if (
            was is not None and was.keys == count and chunk_unchanged(number, count)
            and named.still(was.after, copied)
        ):  # fmt: skip
            rows_of = ChunkRows(count, was.rows, after=was.after, loose=was.loose)
            rows_of.at = list(range(len(chunks), len(chunks) + len(was.copies)))
            chunks += was.copies
            n_recs += was.rows
            copied.add(number)
            named.begin(number, recs)
            if whole_so_far or not was.loose:
                kept[number] = rows_of
            await pacer.pause()
            continue
        named.begin(number)
        rows_of = ChunkRows(count)
        for start in range(0, count, CHUNK):
            part = recs[start : start + CHUNK]
            await named.reach(part, pacer)
            rows = codec.checkpoint_record_rows(part, uncommitted, named.here, named.earlier)
            rows_of.rows += len(rows)
            rows_of.at.append(len(chunks))
            chunks.append(codec.encode_chunk(codec.RECS, rows))
            await pacer.pause()
        del recs
        whole = rows_of.rows == count
        if whole and n != newest and (whole_so_far or not named.missed):
            rows_of.after, rows_of.loose = named.found, named.missed
            kept[number] = rows_of
        n_recs += rows_of.rows
        whole_so_far = whole_so_far and whole
    for n in range(len(named.maps)):  # let go of them in steps too (~3 ms at once)
        named.maps[n].clear()
        named.unfilled[n] = None
        await pacer.pause()
    chunks.append(codec.encode_end(n_segs, n_recs))
    return chunks, n_recs, files, kept


T = TypeVar("T")


def _split(items: list[T], layout: Sequence[tuple[int, int]]) -> Iterator[list[T]]:
    """`items` in order, as many at a time as each count of `layout` says, each part
    taken out of the list (reversed first, so that taking one moves nothing)."""
    items.reverse()
    for _, count in layout:
        at = len(items) - count
        part = items[at:]
        del items[at:]
        part.reverse()
        yield part
