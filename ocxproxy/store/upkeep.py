"""The maintenance policy's numbers (disk cap, compaction, checkpoint schedule) and the
checkpoint's encoding, in chunks between which the event loop runs."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

from ocxproxy.model import Record, Segment
from ocxproxy.store import codec

CHECKPOINT_BYTES = 16 * 1024**2  # journal bytes since the last checkpoint that call for one
CHECKPOINT_AGE = 120.0  # seconds a change may wait for a checkpoint (it is durable already)
CHUNK = 500  # records or segments encoded between yields to the event loop
COMPACT_BELOW = 0.5  # a journal file with less live data than this is compacted
COMPACT_BATCH = 1000  # segments moved per commit (the loop runs between)
COMPACT_BYTES = 32 * 1024**2  # most bytes one checkpoint's compaction moves
MAINTAIN_EVERY = 0.5
DISK_KEEP = 0.6  # share of --max-disk-bytes live segments and the checkpoint may fill


async def encode_checkpoint(
    position: tuple[int, int],
    written_at: float,
    next_sid: int,
    segments: Sequence[Segment],
    records: Sequence[Record],
    uncommitted: Collection[str] = (),
) -> tuple[list[bytes], int]:
    """The checkpoint of `segments` and `records` (the durable ones, but those whose ids are
    `uncommitted`) at journal `position`, as chunks to write, and how many records it
    names. A record is named by its parent's row when that row is out already; a segment
    whose bytes the journal does not hold is left out, and so is every record that needs
    one. The caller captures plain copies (no filtering: 100,000 records at once would
    stall the loop); they are filtered here, chunk by chunk."""
    chunks: list[bytes] = [codec.encode_head(position, written_at, next_sid)]
    n_segs = n_recs = 0
    for start in range(0, len(segments), CHUNK):
        rows = [
            [*codec.segment_row(s), s.pack, s.offset, s.length]
            for s in segments[start : start + CHUNK]
            if s.pack >= 0 and s.sid
        ]
        n_segs += len(rows)
        chunks.append(codec.encode_chunk(codec.SEGS, rows))
        await asyncio.sleep(0)
    emitted: dict[int, Record] = {}  # id(chain link) -> the record whose row is out
    for start in range(0, len(records), CHUNK):
        rows = []
        for r in records[start : start + CHUNK]:
            if not r.durable or r.id in uncommitted:
                continue
            link = r.links
            prev = link.prev if link is not None else None
            parent = emitted.get(id(prev)) if prev is not None else None
            # The chain is its parent's + one (a conversation's row, whose ids a parent
            # names only when it is its own previous row, is written whole).
            if link is not None and parent is not None and r.ids is None:
                if link.segment.pack < 0 or r.response.pack < 0:
                    continue
                rows.append(codec.record_row(r, parent.id))
            else:
                if r.response.pack < 0 or not all(s.pack >= 0 for s in r.segments):
                    continue  # evicted bytes: it would be dropped at load
                rows.append(codec.record_row(r))
            emitted[id(link)] = r
        n_recs += len(rows)
        chunks.append(codec.encode_chunk(codec.RECS, rows))
        await asyncio.sleep(0)
    chunks.append(codec.encode_end(n_segs, n_recs))
    return chunks, n_recs
