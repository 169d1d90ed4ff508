"""The journal's entries: framing, the rows of segments and records, the checkpoint's
encoding, and decoding all of them into a `Loaded` index. Pure functions of bytes (journal.py
does the file handling).

An entry is `<length u32><crc32 u32><type u8><payload>`; the crc covers the type and the
payload, so a torn or corrupt entry is detected and replay stops at the last good one.

    SEG  <meta length u16><meta JSON><zstd blob>    a segment and its bytes (a large one's
                                                    meta ends with its blob's length, and
                                                    the blob is its own file instead:
                                                    segment_files.py)
    REC  <row length u32><record row JSON><response blob>
                                                    a record and its response object
                                                    (the row's chain by segment sid; a
                                                    conversation's: its item ids too; a
                                                    response's members filled in from
                                                    the request: by segment sid)
    RSP  <id length u16><record id JSON><response blob>
                                                    a record's response, moved here by
                                                    compaction
    PUT  <record row JSON>                          a record whose response is a segment
                                                    of its own (a kept record's, and every
                                                    record of journals written before REC)
    DEL  <record id JSON>                           a record dropped
    NOP  (empty)                                    a probe: can the disk take a write?

A response's blob (`response_blob`) carries a checksum, which `decode_response` checks: it
has no digest to be checked against.

The checkpoint uses the same framing: HEAD (position to replay from, next sid), SEGS and
RECS chunks (JSON arrays of rows), END. A record row names its response by segment sid
(PUT) or, once loaded, by where it is: [file, offset, compressed length, size] (REC).
Segment and record rows are built by one function each (`segment_row`, `record_row`) for
the journal; the checkpoint builds the same rows a chunk at a time
(`checkpoint_segment_rows`, `checkpoint_record_rows`), held equal to those by a test.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import zstandard

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import (
    LENGTH_BITS,
    LENGTH_MAX,
    LONE_MAX,
    NO_CALLS,
    NO_ITEMS,
    OFFSET_MAX,
    PACK_SHIFT,
    SID_SHIFT,
    SIZE_BITS,
    SIZE_MAX,
    SPAN_MAX,
    SPAN_SHIFT,
    ItemIds,
    Record,
    Segment,
    shared,
    unplace,
)
from ocxproxy.store.compression import LEVEL, decompressor
from ocxproxy.store.local.segment_files import FILES

SEG, PUT, DEL, NOP, REC, RSP = 1, 2, 3, 4, 5, 6
HEAD, SEGS, RECS, END = 11, 12, 13, 14
FORMAT = "ocxproxy-checkpoint"
VERSION = 1
MAX_ENTRY = 1024**3
FRAME = struct.Struct("<IIB")
META = struct.Struct("<H")
ROW = struct.Struct("<I")
_checked = threading.local()


def frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(len(payload), zlib.crc32(payload, kind), kind) + payload


# A response's blob: under SMALL_RESPONSE bytes (a turn's Response without its output,
# ~300-700 bytes) its bytes as they are, then their CRC-32; else a zstd frame with its
# checksum. Compressing so few bytes saves little: level 1 saves ~180 bytes for ~32k
# instructions of entropy tables, and zstd's fastest level, which stores them as they
# are, still looks for matches first (several µs of the event loop's time a turn, its
# code cold by then). No JSON begins with zstd's magic number, which tells them apart.
SMALL_RESPONSE = 1024
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CRC = struct.Struct("<I")


def response_blob(data: bytes) -> bytes:
    """A response's blob (one zstd compressor per thread)."""
    if len(data) < SMALL_RESPONSE and not data.startswith(_ZSTD_MAGIC):
        return data + _CRC.pack(zlib.crc32(data))
    compressor: zstandard.ZstdCompressor | None = getattr(_checked, "compressor", None)
    if compressor is None:
        compressor = _checked.compressor = zstandard.ZstdCompressor(
            level=LEVEL, write_content_size=True, write_checksum=True
        )
    return compressor.compress(data)


# -- rows: the one encoding of a segment's and a record's metadata ---------------------------


def segment_row(segment: Segment) -> list[Any]:
    """A segment's metadata (without its location): journal SEG entries and checkpoint rows
    alike, so a new field is added here and in `parse_segment`, nowhere else."""
    ids = sorted(segment.call_ids) if segment.call_ids else []
    items = list(segment.item_ids) if segment.item_ids else []  # (id, start, end) tuples
    return [segment.sid, segment.key, segment.size, segment.n_items, ids, items]


FILE_ROW = 7  # a SEG entry's meta: segment_row() and the length of the segment's own file

IDS = 11  # a record row's field past the 11 every row has: a conversation's item ids
FILL = 12  # the next: [sid, bytes from the end] of the members the envelope filled in
# The sid a record row's chain gives a segment whose bytes were lost before they were
# written (never named: a turn in flight on a chain evicted or dropped meanwhile, which
# answers EVICTED when continued). Start-up keeps its record, which GET still answers,
# and puts `lost_segment()` in its place, so continuing it answers EVICTED too.
UNWRITTEN = 0
# The digest start-up gives that stand-in (no content hashes to 32 zero bytes).
LOST_KEY = "00" * 32


def lost_segment() -> Segment:
    """The stand-in for the segments a restored record's row names UNWRITTEN: no bytes,
    never written (sid 0), lost as EVICTED: a read of that record's chain answers so."""
    segment = Segment.restore(LOST_KEY, 0, 0, NO_CALLS, durable=True)
    segment.lost = str(FailureReason.EVICTED)
    return segment


def unwritten(segment: Segment) -> bool:
    """Lost before it was ever written: a record's row names it UNWRITTEN."""
    return segment.lost is not None and not segment.sid


def record_row(record: Record, parent: str | None = None) -> list[Any]:
    """A record as a row: its chain by segment sid, its response by segment sid, by its
    size (bytes: the REC entry holding them, to be written) or by where it is (the
    checkpoint's [file, offset, length, size]). With `parent` (a record
    whose chain is this one's but the last segment, named by an earlier row) the chain is
    ["^", parent, last sid]: a row's size does not grow with the chain's depth. A
    conversation's row ends with its item ids, one list per segment; named by its parent
    (its own previous row: an append), with the last segment's list only, so a turn's row
    does not grow with the conversation either. A response whose members filled in from
    the request are a segment of their own (Record.fill) ends with [its sid, where they
    go back, in bytes from the end], after the item ids (null for a response)."""
    own = record.own
    named = bool(parent) and own is not None
    if parent and own is not None:
        chain: list[Any] = ["^", parent, own.sid]
    else:
        chain = [s.sid for s in record.segments]
    response = record.response
    if isinstance(response, Segment):
        held: Any = response.sid
    else:  # its size, for the REC entry holding its bytes; the checkpoint's: where it is
        held = len(response) if isinstance(response, bytes) else list(unplace(response))
    row = [
        record.id,
        record.scope,
        record.created_at,
        record.expires_at,
        chain,
        held,
        record.output_at,
        record.backend,
        record.affinity_key,
        record.n_items,
        record.stored,
    ]
    ids, fill = record.ids, record.fill
    if fill is not None:  # (a response's ids are None: the usual turn's row, in one step)
        row += (
            None if ids is None else ids[-1] if named else ids,
            [fill.at >> SID_SHIFT, record.fill_at],
        )
    elif ids is not None:
        row.append(ids[-1] if named else ids)
    return row


# The checkpoint's rows of 100,000s of segments and records: the same rows as
# `segment_row` and `record_row` (a test compares them field by field), built in one loop
# each from the objects' slots, with no call per row (the calls, properties and type
# checks of the two are most of what a row costs them). Rows are tuples (JSON arrays all
# the same): fewer objects for the cyclic GC to count. A change to a row is made in both.


def checkpoint_segment_rows(found: list[Segment | None], pack: int) -> list[tuple[Any, ...]]:
    """`segment_row` and [pack, offset, length] of each segment of `found` located in
    journal file `pack` and named (a sid); the others (None: gone) are left out."""
    rows = []
    for s in found:
        if s is None or s.pack != pack:
            continue
        at = s.at
        sid = at >> SID_SHIFT
        if not sid:
            continue
        calls = s.call_ids
        ids = s.ids
        if type(ids) is str:
            span = at >> SPAN_SHIFT & SPAN_MAX
            items: Any = ((ids, span >> 30, span & LONE_MAX),)
        else:
            items = list(ids) if ids is not NO_ITEMS else ()
        rows.append((
            sid, s.digest.hex(), s.size, s.n_items, sorted(calls) if calls else (), items,
            pack, at >> LENGTH_BITS & OFFSET_MAX, at & LENGTH_MAX,
        ))  # fmt: skip
    return rows


def checkpoint_record_rows(
    records: list[Record],
    uncommitted: Collection[str],
    named: dict[int, str],
    earlier: Callable[[int], str | None],
) -> list[tuple[Any, ...]]:
    """The rows of the durable `records` but those `uncommitted`, those whose response
    is not in the journal (its bytes not committed yet, or evicted), and those with a
    segment not in the journal (but one lost before it was written: UNWRITTEN). `named`
    (id(chain link) -> the id of the record whose row is out with it: those of this
    chunk of the order so far), else `earlier` (the same of the rows out before, by the
    link's id), gives a record's parent row, whose chain is this one's but the last
    link: the row names it instead of the chain (not a conversation's row, written
    whole); each row's link is added to `named`."""
    rows = []
    for r in records:
        if not r.durable:
            continue
        rid = r.id
        if rid in uncommitted:
            continue
        response = r.response
        if type(response) is int:
            held: Any = (
                response >> PACK_SHIFT,
                response >> (LENGTH_BITS + SIZE_BITS) & OFFSET_MAX,
                response >> SIZE_BITS & LENGTH_MAX,
                response & SIZE_MAX,
            )
        elif type(response) is Segment and response.pack >= 0:
            held = response.at >> SID_SHIFT
        else:
            continue  # its bytes: not committed yet, or evicted (it would be dropped at load)
        fill = r.fill
        if fill is not None and fill.pack < 0:
            continue
        link = r.links
        ids = r.ids
        if link is None:
            chain: Any = ()
        else:
            prev = link.prev
            parent = None
            if prev is not None and ids is None:
                key = id(prev)
                parent = named.get(key)
                if parent is None:
                    parent = earlier(key)
            own = link.segment
            if parent is not None:
                if own.pack < 0:
                    continue
                chain = ("^", parent, own.at >> SID_SHIFT)
            else:
                built = r.built
                segments = link.segments() if built is None else built
                chain = [s.at >> SID_SHIFT for s in segments if s.pack >= 0]
                if len(chain) != len(segments):
                    if not all(s.pack >= 0 or unwritten(s) for s in segments):
                        continue
                    chain = [s.at >> SID_SHIFT for s in segments]  # (UNWRITTEN: 0)
            named[id(link)] = rid
        row: tuple[Any, ...] = (
            rid, r.scope, r.created_at, r.expires_at, chain, held, r.output_at, r.backend,
            r.affinity_key, r.n_items, r.stored,
        )  # fmt: skip
        if fill is not None:
            row = (*row, ids, (fill.at >> SID_SHIFT, r.fill_at))
        elif ids is not None:
            row = (*row, ids)
        rows.append(row)
    return rows


def parse_segment(row: list[Any], pack: int, offset: int, length: int) -> Segment:
    """A segment row (and where its bytes are) as a Segment whose bytes are not loaded."""
    sid, key, size, n_items, ids, items = row
    return restore_segment(sid, key, size, n_items, ids, items, pack, offset, length)


_new_segment = Segment.__new__


def restore_segment(
    sid: Any, key: Any, size: Any, n_items: Any, ids: Any, items: Any, pack: Any, offset: Any,
    length: Any,
) -> Segment:  # fmt: skip
    """A segment row's fields (and where its bytes are) as a Segment whose bytes are not
    loaded; ValueError or TypeError for a bad row. Every slot is set here directly, as
    Segment.restore would set them (a test compares the two): start-up builds 100,000s
    of segments, and this is 3x faster than Segment.restore with the checks around it."""
    if not (type(sid) is type(size) is type(n_items) is type(pack) is type(offset) is int):
        if not isinstance(sid, int):
            raise ValueError("bad segment row")
        size, n_items, pack, offset = int(size), int(n_items), int(pack), int(offset)
    if type(key) is not str or len(key) != 64:
        raise ValueError("bad segment row")
    segment = _new_segment(Segment)
    segment.digest = bytes.fromhex(key)  # (ValueError: not hex)
    segment.data = None if size else b""
    segment.size = shared(size)
    segment.n_items = n_items
    segment.call_ids = frozenset(ids) if ids else NO_CALLS
    segment.durable = True
    if type(length) is not int:
        length = int(length)
    if not (0 <= offset <= OFFSET_MAX and 0 <= length <= LENGTH_MAX and sid >= 0):
        raise ValueError("bad segment row")
    segment.at = sid << SID_SHIFT | offset << LENGTH_BITS | length
    segment.item_ids = item_spans(items, size) if items else NO_ITEMS  # (after `at`: its span)
    segment.pack = pack
    segment.lost = None
    segment.refs = segment.durable_refs = 0
    return segment


def item_spans(items: list[Any], size: int) -> ItemIds:
    spans = [(str(i), int(start), int(end)) for i, start, end in items]
    if any(not 0 <= start <= end <= size for _, start, end in spans):
        raise ValueError("item span outside its segment")
    return ItemIds(spans)


# -- what start-up reads -------------------------------------------------------------------


@dataclass(slots=True)
class Loaded:
    """The index as of the end of the journal: checkpoint plus replay."""

    segments: dict[int, Segment] = field(default_factory=dict)  # by sid, not yet indexed
    records: dict[str, list[Any]] = field(default_factory=dict)  # id -> row, oldest first
    replay_from: tuple[int, int] = (0, 0)  # (file, offset) the checkpoint covers up to
    checkpoint_at: float | None = None  # when the checkpoint was written
    next_sid: int = 1
    cut: int = 0  # torn or corrupt entries cut
    cut_at: list[tuple[int, int]] = field(default_factory=list)  # (file, offset) cut there
    error: str | None = None  # the checkpoint could not be used (replayed from the start)
    entries: int = 0  # journal entries replayed
    sizes: dict[int, int] = field(default_factory=dict)  # journal file -> bytes kept
    strings: dict[Any, Any] = field(default_factory=dict)  # one copy of each (put)

    def apply(self, kind: int, payload: memoryview, pack: int, offset: int) -> None:
        if kind == SEG:
            (n,) = META.unpack_from(payload, 0)
            row = orjson.loads(payload[2 : 2 + n])
            if len(row) == FILE_ROW:  # its bytes are in its own file, this long
                info = parse_segment(row[:-1], FILES, 0, row[-1])
            else:
                start = offset + FRAME.size + 2 + n
                info = parse_segment(row, pack, start, len(payload) - 2 - n)
            self.segments[info.sid] = info
            self.next_sid = max(self.next_sid, info.sid + 1)
        elif kind == REC:
            (n,) = ROW.unpack_from(payload, 0)
            row = orjson.loads(payload[4 : 4 + n])
            size = row[5]
            if type(size) is not int or size < 0:
                raise ValueError("bad record row")
            row[5] = [pack, offset + FRAME.size + 4 + n, len(payload) - 4 - n, size]
            self.put(row)
        elif kind == RSP:
            (n,) = META.unpack_from(payload, 0)
            moved = self.records.get(orjson.loads(payload[2 : 2 + n]))
            if moved is not None and type(moved[5]) is list:  # (else dropped since)
                start = offset + FRAME.size + 2 + n
                moved[5] = [pack, start, len(payload) - 2 - n, moved[5][3]]
        elif kind == PUT:
            self.put(orjson.loads(payload))
        elif kind == DEL:
            self.records.pop(orjson.loads(payload), None)

    def put(self, row: list[Any]) -> None:
        """A record row. A chain named by its parent becomes (the parent's row, last sid):
        the very row live when it was written, even if that id is deleted or reused later
        (None: no such parent); its item ids, if any, (the parent's row, last list).
        A scope, backend and chain key are kept as one copy of each, and an output's place
        as the shared pair, as they are read: a copy freed at once leaves its memory to the
        next row, where freed after the index is built it would leave holes among the
        objects the index keeps."""
        if len(row) >= IDS:
            same = self.strings.setdefault
            for field_at in (1, 7, 8):
                row[field_at] = same(row[field_at], row[field_at])
            at = row[6]
            row[6] = shared((at[0], at[1])) if at else None
        chain = row[4]
        if chain and chain[0] == "^":
            parent = self.records.get(chain[1])
            row[4] = None if parent is None else (parent, chain[2])
            if len(row) > IDS and row[IDS] is not None:
                row[IDS] = None if parent is None else (parent, row[IDS])
        self.records.pop(row[0], None)  # a reused id moves to the end
        self.records[row[0]] = row


def chain_sids(row: list[Any]) -> list[int] | None:
    """A loaded row's chain as sids, oldest first (None: a parent was missing)."""
    tail: list[int] = []
    link = row[4]
    while isinstance(link, tuple):
        tail.append(link[1])
        link = link[0][4]
    return None if link is None else [*link, *reversed(tail)]


def conversation_ids(row: list[Any]) -> list[list[str]] | None:
    """A loaded row's item ids per segment, oldest first (a conversation's; None: the row
    keeps none). ValueError when an append's parent kept none (never written so)."""
    if len(row) <= IDS or row[IDS] is None:
        return None
    tail: list[list[str]] = []
    ids = row[IDS]
    while isinstance(ids, tuple):
        parent, last = ids
        tail.append(last)
        ids = parent[IDS] if len(parent) > IDS else None
        if ids is None:
            raise ValueError(f"{row[0]}: an append to a row without item ids")
    if not isinstance(ids, list) or not all(isinstance(i, list) for i in (*ids, *tail)):
        raise ValueError(f"{row[0]}: item ids are not lists")
    return [*ids, *reversed(tail)]


def entries(data: bytes | memoryview, start: int = 0) -> Iterator[tuple[int, memoryview, int]]:
    """(type, payload, offset) of each good entry from `start`; stops at the first bad one
    (check `end` of the last to see where)."""
    view = memoryview(data)
    offset, total = start, len(view)
    while offset + FRAME.size <= total:
        length, crc, kind = FRAME.unpack_from(view, offset)
        end = offset + FRAME.size + length
        if length > MAX_ENTRY or end > total:
            return
        payload = view[offset + FRAME.size : end]
        if kind == 0 or zlib.crc32(payload, kind) != crc:  # 0: preallocated, never written
            return
        yield kind, payload, offset
        offset = end


def good_prefix(data: bytes | memoryview, start: int, loaded: Loaded, pack: int) -> int:
    """Apply every good entry of one journal file from `start`; the offset they end at."""
    end = start
    for kind, payload, offset in entries(data, start):
        try:
            loaded.apply(kind, payload, pack, offset)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error):
            return offset  # well framed but not ours: treated as corrupt from here
        loaded.entries += 1
        end = offset + FRAME.size + len(payload)
    return end


# -- the checkpoint --------------------------------------------------------------------------


# A checkpoint is encoded as entries, each its type and payload, on the event loop; they
# are framed (each payload's crc32 and its copy behind the header: linear in the
# checkpoint's bytes) by the thread that writes them (journal.write_checkpoint).
Entry = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class Copied:
    """An entry of the previous checkpoint file, copied as it is: `length` bytes at
    `offset`, its frame's crc32 `crc` (checked as it is copied)."""

    offset: int
    length: int
    crc: int


def encode_head(replay_from: tuple[int, int], written_at: float, next_sid: int) -> Entry:
    head = {
        "format": FORMAT,
        "version": VERSION,
        "written_at": written_at,
        "replay_from": list(replay_from),
        "next_sid": next_sid,
    }
    return HEAD, orjson.dumps(head)


def encode_chunk(kind: int, rows: Sequence[Sequence[Any]]) -> Entry:
    return kind, orjson.dumps(rows)


def encode_end(n_segments: int, n_records: int) -> Entry:
    return END, orjson.dumps([n_segments, n_records])


def copied(raw: bytes, entry: Copied) -> bytes:
    """The bytes `entry` names, read from the previous checkpoint file (`raw`); ValueError
    unless they are that very entry, whole (a SEGS or RECS chunk, its crc32 as recorded)."""
    if len(raw) != entry.length or entry.length < FRAME.size:
        raise ValueError("checkpoint: a copied entry is short")
    length, crc, kind = FRAME.unpack_from(raw)
    payload = memoryview(raw)[FRAME.size :]
    if (
        kind not in (SEGS, RECS) or crc != entry.crc or length != len(payload)
        or zlib.crc32(payload, kind) != crc
    ):  # fmt: skip
        raise ValueError("checkpoint: a copied entry is not the one written")
    return raw


def load_checkpoint(raw: bytes, loaded: Loaded) -> None:
    """Fill `loaded` from a checkpoint file; ValueError when it is not a whole, valid one."""
    view = memoryview(raw)
    seen_head, counts = False, [0, 0]
    end = 0
    for kind, payload, offset in entries(view):
        end = offset + FRAME.size + len(payload)
        doc = orjson.loads(payload)
        if kind == HEAD:
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise ValueError(f"not a version {VERSION} checkpoint")
            loaded.replay_from = (int(doc["replay_from"][0]), int(doc["replay_from"][1]))
            loaded.checkpoint_at = float(doc["written_at"])
            loaded.next_sid = int(doc["next_sid"])
            seen_head = True
        elif kind == SEGS and seen_head:
            segments = loaded.segments
            for sid, key, size, n_items, ids, items, pack, offset, length in doc:
                segments[sid] = restore_segment(
                    sid, key, size, n_items, ids, items, pack, offset, length
                )
            counts[0] += len(doc)
        elif kind == RECS and seen_head:
            for row in doc:
                loaded.put(row)
            counts[1] += len(doc)
        elif kind == END and seen_head:
            if list(doc) != counts or end != len(raw):
                raise ValueError("checkpoint counts disagree")
            return
        else:
            raise ValueError(f"unexpected checkpoint entry {kind}")
    raise ValueError("checkpoint is truncated")


def decode_response(size: int, blob: bytes) -> bytes:
    """A response's `size` bytes from its blob, its checksum checked; CORRUPT otherwise."""
    if not blob.startswith(_ZSTD_MAGIC):  # (its bytes and their CRC-32)
        data = blob[:-4]
        if len(blob) != size + 4 or _CRC.pack(zlib.crc32(data)) != blob[-4:]:
            raise StoreFailure(FailureReason.CORRUPT, "response: checksum disagrees")
        return data
    try:
        params = zstandard.get_frame_parameters(blob)
        if not params.has_checksum or params.content_size != size:
            raise StoreFailure(FailureReason.CORRUPT, "response: frame header disagrees")
        data = decompressor().decompress(blob, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise StoreFailure(FailureReason.CORRUPT, f"response: {exc}") from None
    if len(data) != size:
        raise StoreFailure(FailureReason.CORRUPT, "response: wrong size")
    return data


def decode(key: str, size: int, blob: bytes) -> bytes:
    """Decompress at most `size` bytes and check they hash to `key`; CORRUPT otherwise."""
    try:
        declared = zstandard.frame_content_size(blob)
        if declared != size:
            raise StoreFailure(FailureReason.CORRUPT, f"{key}: frame declares {declared} bytes")
        data = decompressor().decompress(blob, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: {exc}") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != key:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: digest mismatch")
    return data
