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
COMPACT_BELOW = 0.5  # a journal file with less live data than this is compacted
COMPACT_BATCH = 500  # segments moved per commit (its outcome is applied in one step)
COMPACT_BYTES = 32 * 1024**2  # most bytes one checkpoint's compaction moves
MAINTAIN_EVERY = 0.5
DISK_KEEP = 0.6  # share of --max-disk-bytes live segments and the checkpoint may fill


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


async def encode_checkpoint(
    position: tuple[int, int],
    written_at: float,
    next_sid: int,
    placed: Sequence[tuple[int, list[bytes]]],
    by_key: Shards[bytes, Segment],
    records: list[Record],
    uncommitted: Collection[str] = (),
    previous: Mapping[int, FileRows] | None = None,
    unchanged: Callable[[int], bool] = lambda pack: False,
) -> tuple[list[codec.Entry | codec.Copied], int, dict[int, FileRows]]:
    """The checkpoint at journal `position` of the segments located in the files before it
    (`placed`: each file and the digests the keydir lists for it, looked up in `by_key` as
    they are read) and of `records` (the durable ones, but those whose ids are
    `uncommitted`), as entries to write, how many records it names, and its rows of each
    journal file. A record is named by its parent's row when that row is out already; a
    record that needs a segment the journal does not hold is left out.

    A journal file's rows in the `previous` checkpoint (the file being replaced) are
    copied from it, not encoded again, when they would come out the same: the keydir
    lists as many keys for the file as then, and no segment left it or changed its row
    there since that checkpoint's capture (`unchanged`). Files before the position are
    never appended to, so its segments are then the very ones, where they were.

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
    # id(chain link) -> the id of the record whose row is out, sharded: one dict of
    # 100,000 entries grows by copying them all at once (~4 ms). Ints and strings only:
    # the GC does not track the dicts, so no pass meanwhile traverses them.
    named: list[dict[int, str]] = [{} for _ in range(SHARDS)]
    for recs in _taken(records):
        rows = codec.checkpoint_record_rows(recs, uncommitted, named)
        n_recs += len(rows)
        chunks.append(codec.encode_chunk(codec.RECS, rows))
        await pacer.pause()
    for shard in named:  # let go of them in steps too (~3 ms at once at 100,000 records)
        shard.clear()
        await pacer.pause()
    chunks.append(codec.encode_end(n_segs, n_recs))
    return chunks, n_recs, files


T = TypeVar("T")


def _taken(items: list[T]) -> Iterator[list[T]]:
    """`items` in order, CHUNK at a time, each chunk taken out of the list (reversed
    first, so that taking one moves nothing)."""
    items.reverse()
    while items:
        chunk = items[-CHUNK:]
        del items[-CHUNK:]
        chunk.reverse()
        yield chunk
