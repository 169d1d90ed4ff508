"""The maintenance policy's numbers (disk cap, compaction, checkpoint schedule) and the
checkpoint's encoding, in steps between which the event loop runs.

A step ends once it has worked `STEP` seconds (`Pacer`), so no step of a checkpoint keeps
the loop long at any store size. The encoding also keeps the cyclic GC quiet: rows are
dumped `CHUNK` at a time (fewer live lists than a generation-0 collection waits for,
each freed before the next chunk), and its bookkeeping holds only ints and strings (which
the GC does not track): at 100,000 records the old encoding set off ~800 collections, 6
of them full passes of 10-16 ms each, with the loop stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ocxproxy.model import Record, Segment
from ocxproxy.store.local import codec
from ocxproxy.store.shards import Shards

CHECKPOINT_BYTES = 16 * 1024**2  # journal bytes since the last checkpoint that call for one
CHECKPOINT_AGE = 120.0  # seconds a change may wait for a checkpoint (it is durable already)
STEP = 0.001  # seconds a checkpoint or compaction works before it yields to the event loop
CHUNK = 160  # rows per checkpoint chunk: dumped, and their ~500 lists freed, at once
SCAN = 1024  # segments compaction's scan looks at between checks of the step's time (~1 ms)
COMPACT_BELOW = 0.5  # a journal file with less live data than this is compacted
COMPACT_BATCH = 500  # segments moved per commit (its outcome is applied in one step)
COMPACT_BYTES = 32 * 1024**2  # most bytes one checkpoint's compaction moves
MAINTAIN_EVERY = 0.5
DISK_KEEP = 0.6  # share of --max-disk-bytes live segments and the checkpoint may fill


class Pacer:
    """Yields to the event loop once the current step has worked `STEP` seconds."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since = time.perf_counter()

    async def pause(self) -> None:
        if time.perf_counter() - self.since >= STEP:
            await asyncio.sleep(0)
            self.since = time.perf_counter()


async def encode_checkpoint(
    position: tuple[int, int],
    written_at: float,
    next_sid: int,
    placed: Sequence[tuple[int, list[bytes]]],
    by_key: Mapping[bytes, Segment],
    records: list[Record],
    uncommitted: Collection[str] = (),
) -> tuple[list[bytes], int]:
    """The checkpoint at journal `position` of the segments located in the files before it
    (`placed`: each file and the digests the keydir lists for it, looked up in `by_key` as
    they are read) and of `records` (the durable ones, but those whose ids are
    `uncommitted`), as chunks to write, and how many records it names. A record is named
    by its parent's row when that row is out already; a record that needs a segment the
    journal does not hold is left out.

    Nothing is filtered at the capture (100,000 records at once would stall the loop):
    the records' list is read here chunk by chunk, and emptied as it is read (letting go
    of 100,000 objects at the end would be one long step), and the segments are read
    where they are now. A segment located before `position` at the capture is still
    there unless no record holds it any more, and then each record captured that held
    it was dropped since (its DEL, expiry or new PUT follows `position`)."""
    chunks: list[bytes] = [codec.encode_head(position, written_at, next_sid)]
    pacer = Pacer()
    n_segs = n_recs = 0
    get = by_key.get
    for pack, keys in placed:
        for start in range(0, len(keys), CHUNK):
            rows: list[list[Any]] = []
            for key in keys[start : start + CHUNK]:
                s = get(key)
                if s is not None and s.pack == pack and s.sid:
                    row = codec.segment_row(s)
                    row += (pack, s.offset, s.length)
                    rows.append(row)
            if rows:
                n_segs += len(rows)
                chunks.append(codec.encode_chunk(codec.SEGS, rows))
            await pacer.pause()
    # id(chain link) -> the id of the record whose row is out, sharded: one dict of
    # 100,000 entries grows by copying them all at once (~4 ms). Ints and strings only:
    # the GC does not track the dicts, so no pass meanwhile traverses them.
    named: Shards[int, str] = Shards()
    for recs in _taken(records):
        rows = []
        for r in recs:
            if not r.durable or r.id in uncommitted:
                continue
            link = r.links
            prev = link.prev if link is not None else None
            parent = named.get(id(prev)) if prev is not None else None
            # The chain is its parent's + one (a conversation's row, whose ids a parent
            # names only when it is its own previous row, is written whole).
            response = r.response  # a place, or a segment of its own (bytes: not committed)
            if type(response) is bytes or (type(response) is Segment and response.pack < 0):
                continue  # evicted bytes: it would be dropped at load
            if link is not None and parent is not None and r.ids is None:
                if link.segment.pack < 0:
                    continue
                rows.append(codec.record_row(r, parent))
            else:
                if not all(s.pack >= 0 for s in r.segments):
                    continue
                rows.append(codec.record_row(r))
            named[id(link)] = r.id
        n_recs += len(rows)
        chunks.append(codec.encode_chunk(codec.RECS, rows))
        await pacer.pause()
    for shard in named.shards:  # let go of them in steps too (~3 ms at once at 100,000 records)
        shard.clear()
        await pacer.pause()
    chunks.append(codec.encode_end(n_segs, n_recs))
    return chunks, n_recs


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
