"""The journal: append-only log files of framed, checksummed entries, and the checkpoint.

    journal/00000001.log ...   entries, appended in order; a file is also a pack: the
                               compressed bytes of each new segment live in its entry,
                               read back later with one pread at a known offset
    checkpoint                 the index at a journal position, written atomically

An entry is `<length u32><crc32 u32><type u8><payload>`; the crc covers the type and the
payload, so a torn or corrupt entry is detected and replay stops at the last good one.

    SEG  <meta length u16><meta JSON><zstd blob>    a segment and its bytes
    PUT  <record row JSON>                          a record (its chain by segment sid)
    DEL  <record id JSON>                           a record dropped
    NOP  (empty)                                    a probe: can the disk take a write?

The checkpoint uses the same framing: HEAD (position to replay from, next sid), SEGS and
RECS chunks (JSON arrays of rows), END. Segment and record rows are built by one function
each (`segment_row`, `record_row`) for the journal and the checkpoint alike.

Every call here blocks: the store runs them in a thread. OSError passes through from the
write side (the store turns it into a failed commit); reads and replay never raise for bad
data, they report it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import zstandard

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import NO_ITEMS, ItemIds, Record, Segment
from ocxproxy.store import files

SEG, PUT, DEL, NOP = 1, 2, 3, 4
HEAD, SEGS, RECS, END = 11, 12, 13, 14
FORMAT = "ocxproxy-checkpoint"
VERSION = 1
CHECKPOINT = "checkpoint"
LEVEL = 3
FILE_BYTES = 64 * 1024**2  # a journal file is closed (rotated) past this size
PREALLOCATE = 4 * 1024**2  # room the active file grows by (fdatasync then suffices)
MAX_ENTRY = 1024**3
_FRAME = struct.Struct("<IIB")
_META = struct.Struct("<H")
_NAME = re.compile(r"([0-9]{8})\.log")
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def frame(kind: int, payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload, kind), kind) + payload


# -- rows: the one encoding of a segment's and a record's metadata ---------------------------


def segment_row(segment: Segment) -> list[Any]:
    """A segment's metadata (without its location): journal SEG entries and checkpoint rows
    alike, so a new field is added here and in `parse_segment`, nowhere else."""
    ids = sorted(segment.call_ids) if segment.call_ids else []
    items = [list(entry) for entry in segment.item_ids] if segment.item_ids else []
    return [segment.sid, segment.key, segment.size, segment.n_items, ids, items]


SEGMENT_FIELDS = 6  # the length of a segment_row


def record_row(record: Record, parent: str | None = None) -> list[Any]:
    """A record as a row: its chain and response by segment sid. With `parent` (a record
    whose chain is this one's but the last segment, named by an earlier row) the chain is
    ["^", parent, last sid]: a row's size does not grow with the chain's depth."""
    segments = record.segments
    chain = ["^", parent, segments[-1].sid] if parent else [s.sid for s in segments]
    return [
        record.id,
        record.scope,
        record.created_at,
        record.expires_at,
        chain,
        record.response.sid,
        record.output_at,
        record.backend,
        record.affinity_key,
        record.n_items,
        record.stored,
    ]


_NO_IDS: frozenset[str] = frozenset()


def parse_segment(row: list[Any], pack: int, offset: int, length: int) -> Segment:
    """A segment row (and where its bytes are) as a Segment whose bytes are not loaded."""
    sid, key, size, n_items, ids, items = row
    if not (isinstance(sid, int) and isinstance(key, str) and len(key) == 64):
        raise ValueError("bad segment row")
    size = int(size)
    spans = [(str(i), int(start), int(end)) for i, start, end in items] if items else ()
    if any(not 0 <= start <= end <= size for _, start, end in spans):
        raise ValueError("item span outside its segment")
    segment = Segment.restore(
        key, size, int(n_items), frozenset(ids) if ids else _NO_IDS, durable=True,
        data=None if size else b"", item_ids=ItemIds(spans) if spans else NO_ITEMS,
    )  # fmt: skip
    segment.sid, segment.pack, segment.offset, segment.length = sid, pack, offset, length
    return segment


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

    def apply(self, kind: int, payload: memoryview, pack: int, offset: int) -> None:
        if kind == SEG:
            (n,) = _META.unpack_from(payload, 0)
            row = orjson.loads(payload[2 : 2 + n])
            start = offset + _FRAME.size + 2 + n
            info = parse_segment(row, pack, start, len(payload) - 2 - n)
            self.segments[info.sid] = info
            self.next_sid = max(self.next_sid, info.sid + 1)
        elif kind == PUT:
            self.put(orjson.loads(payload))
        elif kind == DEL:
            self.records.pop(orjson.loads(payload), None)

    def put(self, row: list[Any]) -> None:
        """A record row. A chain named by its parent becomes (the parent's row, last sid):
        the very row live when it was written, even if that id is deleted or reused later
        (None: no such parent)."""
        chain = row[4]
        if chain and chain[0] == "^":
            parent = self.records.get(chain[1])
            row[4] = None if parent is None else (parent, chain[2])
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


def entries(data: bytes | memoryview, start: int = 0) -> Iterator[tuple[int, memoryview, int]]:
    """(type, payload, offset) of each good entry from `start`; stops at the first bad one
    (check `end` of the last to see where)."""
    view = memoryview(data)
    offset, total = start, len(view)
    while offset + _FRAME.size <= total:
        length, crc, kind = _FRAME.unpack_from(view, offset)
        end = offset + _FRAME.size + length
        if length > MAX_ENTRY or end > total:
            return
        payload = view[offset + _FRAME.size : end]
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
        end = offset + _FRAME.size + len(payload)
    return end


# -- the checkpoint --------------------------------------------------------------------------


def encode_head(replay_from: tuple[int, int], written_at: float, next_sid: int) -> bytes:
    head = {
        "format": FORMAT,
        "version": VERSION,
        "written_at": written_at,
        "replay_from": list(replay_from),
        "next_sid": next_sid,
    }
    return frame(HEAD, orjson.dumps(head))


def encode_chunk(kind: int, rows: list[list[Any]]) -> bytes:
    return frame(kind, orjson.dumps(rows))


def encode_end(n_segments: int, n_records: int) -> bytes:
    return frame(END, orjson.dumps([n_segments, n_records]))


def load_checkpoint(raw: bytes, loaded: Loaded) -> None:
    """Fill `loaded` from a checkpoint file; ValueError when it is not a whole, valid one."""
    view = memoryview(raw)
    seen_head, counts = False, [0, 0]
    end = 0
    for kind, payload, offset in entries(view):
        end = offset + _FRAME.size + len(payload)
        doc = orjson.loads(payload)
        if kind == HEAD:
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise ValueError(f"not a version {VERSION} checkpoint")
            loaded.replay_from = (int(doc["replay_from"][0]), int(doc["replay_from"][1]))
            loaded.checkpoint_at = float(doc["written_at"])
            loaded.next_sid = int(doc["next_sid"])
            seen_head = True
        elif kind == SEGS and seen_head:
            for row in doc:
                n = SEGMENT_FIELDS
                info = parse_segment(row[:n], int(row[n]), int(row[n + 1]), int(row[n + 2]))
                loaded.segments[info.sid] = info
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


# -- the files -------------------------------------------------------------------------------


class Journal:
    """The journal directory and checkpoint of one state dir. Not thread-safe: one writer
    thread appends (the store's committer) while reads may run in others (pread only)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / "journal"
        self.active = 0  # the file appended to
        self.size = 0  # the end of its entries
        self.allocated = 0  # its size on disk: preallocated room past `size` reads as zeros
        self._fd: int | None = None
        self._readers: dict[int, int] = {}
        self._readers_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Journal {self.dir} active={self.active}:{self.size}>"

    def path(self, pack: int) -> Path:
        return self.dir / f"{pack:08d}.log"

    def existing(self) -> list[int]:
        """Journal files, oldest first."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m[1]) for n in names if (m := _NAME.fullmatch(n)))

    def temps(self) -> list[Path]:
        out = [p for p in self.root.iterdir() if files.is_temp_name(p.name)]
        if self.dir.is_dir():
            out += [p for p in self.dir.iterdir() if files.is_temp_name(p.name)]
        return out

    # -- start-up ------------------------------------------------------------------------

    def prepare(self) -> None:
        if files.ensure_dir(self.dir):
            files.fsync_dir(self.root)

    def load(self, *, repair: bool) -> Loaded:
        """Checkpoint, then every journal entry after it. With `repair`, a torn or corrupt
        tail is cut off its file (truncated), so the next start does not meet it again."""
        loaded = Loaded()
        try:
            raw = files.read_regular(self.root / CHECKPOINT, 1 << 40)
        except FileNotFoundError:
            raw = None
        except OSError as exc:
            loaded.error = f"unreadable: {exc}"
            raw = None
        if raw is not None:
            try:
                load_checkpoint(raw, loaded)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
                loaded.error = f"corrupt: {exc}"
                loaded.segments.clear()
                loaded.records.clear()
                loaded.replay_from, loaded.checkpoint_at, loaded.next_sid = (0, 0), None, 1
        first, start = loaded.replay_from
        for pack in self.existing():
            if pack < first:
                loaded.sizes[pack] = self.path(pack).lstat().st_size
                continue
            data = files.read_regular(self.path(pack), 1 << 40)
            begin = start if pack == first else 0
            end = good_prefix(data, min(begin, len(data)), loaded, pack)
            if end < len(data):
                if data.count(0, end) != len(data) - end:  # not just preallocated zeros
                    loaded.cut += 1
                    loaded.cut_at.append((pack, end))
                if repair:
                    with open(self.path(pack), "r+b") as f:
                        f.truncate(end)
                        os.fsync(f.fileno())
            loaded.sizes[pack] = end
        return loaded

    def open_next(self) -> None:
        """Start appending to a new file after every existing one."""
        existing = self.existing()
        self._open((existing[-1] if existing else 0) + 1)

    def _open(self, pack: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = os.open(self.path(pack), flags | getattr(os, "O_CLOEXEC", 0), files.FILE_MODE)
        try:
            files.fsync_dir(self.dir)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path(pack))
            raise
        self._seal()
        self._fd, self.active, self.size, self.allocated = fd, pack, 0, 0

    def _seal(self) -> None:
        """Close the active file, without the preallocated room it did not use."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.allocated > self.size:
                os.ftruncate(fd, self.size)
                os.fsync(fd)
        except OSError:
            pass  # zeros past the end read as a clean end
        finally:
            os.close(fd)

    def close(self) -> None:
        self._seal()
        with self._readers_lock:
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()

    # -- the write side (the committer's thread) -------------------------------------------

    def append(self, jobs: Sequence[tuple[int, Any]]) -> list[Any]:
        """Write the entries of one commit with one write and one fdatasync.

        A job is (SEG, (row, data or None, blob or None)), (PUT, bytes), (DEL, bytes) or
        (NOP, b""). Returns, per job, (pack, offset, length) of a SEG's blob, else None.
        On OSError nothing of the commit counts: the file is cut back to where it was (or,
        when that fails too, abandoned for a new one).
        """
        if self._fd is None or self.size >= FILE_BYTES:
            self._open(self.active + 1)
        chunks: list[bytes] = []
        places: list[Any] = []
        at = self.size
        for kind, job in jobs:
            if kind == SEG:
                row, data, blob = job
                if blob is None:
                    blob = _compressor().compress(data)
                meta = orjson.dumps(row)
                payload = b"".join((_META.pack(len(meta)), meta, blob))
                places.append((self.active, at + _FRAME.size + 2 + len(meta), len(blob)))
            else:
                payload = job
                places.append(None)
            entry = frame(kind, payload)
            chunks.append(entry)
            at += len(entry)
        fd = self._fd
        assert fd is not None
        try:
            # Writing into room allocated beforehand changes no file size, so fdatasync
            # need not commit the filesystem's metadata: a fraction of fsync's time.
            grown = at > self.allocated
            if grown:
                room = max(PREALLOCATE, at - self.allocated)
                os.posix_fallocate(fd, self.allocated, room)
            files.write_at(fd, b"".join(chunks), self.size)
            if grown:
                os.fsync(fd)
                self.allocated += room
            else:
                os.fdatasync(fd)
        except OSError:
            try:  # nothing of a failed commit may be read back as entries
                os.ftruncate(fd, self.size)
                self.allocated = self.size
            except OSError:
                self._fd = None  # the next commit opens a new file
                os.close(fd)
            raise
        self.size = at
        return places

    def rotate(self) -> tuple[int, int]:
        """Close the active file; the next append starts a new one. The position after
        everything written so far."""
        self._open(self.active + 1)
        return self.active, 0

    def write_checkpoint(self, chunks: Sequence[bytes]) -> int:
        data = b"".join(chunks)
        files.write_atomic(self.root / CHECKPOINT, data)
        return len(data)

    def remove(self, packs: Sequence[int]) -> int:
        removed = 0
        for pack in packs:
            self._forget_reader(pack)
            try:
                os.unlink(self.path(pack))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                continue
        if removed:
            with contextlib.suppress(OSError):
                files.fsync_dir(self.dir)
        return removed

    # -- reads (any thread) --------------------------------------------------------------

    def _reader(self, pack: int) -> int:
        with self._readers_lock:
            fd = self._readers.get(pack)
            if fd is None:
                flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                fd = self._readers[pack] = os.open(self.path(pack), flags)
            return fd

    def _forget_reader(self, pack: int) -> None:
        with self._readers_lock:
            fd = self._readers.pop(pack, None)
        if fd is not None:
            os.close(fd)

    def read_blob(self, pack: int, offset: int, length: int) -> bytes:
        blob = os.pread(self._reader(pack), length, offset)
        if len(blob) != length:
            raise StoreFailure(FailureReason.CORRUPT, f"journal {pack} is shorter than indexed")
        return blob

    def read(self, key: str, size: int, pack: int, offset: int, length: int) -> bytes:
        """The verified bytes of a segment, or StoreFailure."""
        try:
            blob = self.read_blob(pack, offset, length)
        except FileNotFoundError:
            raise StoreFailure(FailureReason.MISSING, key) from None
        except OSError as exc:
            raise StoreFailure(FailureReason.READ_FAILED, f"{key}: {exc.strerror}") from None
        return decode(key, size, blob)

    def read_many(self, jobs: Sequence[tuple[str, int, int, int, int]]) -> list[Any]:
        results: list[Any] = []
        for job in jobs:
            try:
                results.append(self.read(*job))
            except StoreFailure as failure:
                results.append(failure)
        return results

    def read_blobs(self, jobs: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        """Raw compressed bytes (compaction copies them as they are); None when unreadable."""
        out: list[bytes | None] = []
        for job in jobs:
            try:
                out.append(self.read_blob(*job))
            except (OSError, StoreFailure):
                out.append(None)
        return out


def decode(key: str, size: int, blob: bytes) -> bytes:
    """Decompress at most `size` bytes and check they hash to `key`; CORRUPT otherwise."""
    try:
        declared = zstandard.frame_content_size(blob)
        if declared != size:
            raise StoreFailure(FailureReason.CORRUPT, f"{key}: frame declares {declared} bytes")
        data = _decompressor().decompress(blob, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: {exc}") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != key:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: digest mismatch")
    return data
