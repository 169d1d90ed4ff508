"""The journal: append-only log files of framed, checksummed entries (codec.py), and the
checkpoint.

    journal/00000001.log ...   entries, appended in order; a file is also a pack: the
                               compressed bytes of each new segment, and of each
                               record's response, live in its entry, read back later
                               with one pread at a known offset
    checkpoint                 the index at a journal position, written atomically
    segments/<sha256>.zst      a large segment's compressed bytes (segment_files.py)
    format                     the format the dir is written in (stateformat.py)

Every call here blocks: the store runs them in a thread. OSError passes through from the
write side (the store turns it into a failed commit); reads and replay never raise for bad
data, they report it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import unplace
from ocxproxy.store.compression import compress
from ocxproxy.store.local import files, segment_files
from ocxproxy.store.local.codec import (
    FRAME,
    META,
    REC,
    ROW,
    RSP,
    SEG,
    Copied,
    Entry,
    Loaded,
    copied,
    decode,
    decode_response,
    frame,
    good_prefix,
    load_checkpoint,
    response_blob,
)
from ocxproxy.store.local.segment_files import FILES, LARGE

CHECKPOINT = "checkpoint"
FILE_BYTES = 64 * 1024**2  # a journal file is closed (rotated) past this size
PREALLOCATE = 4 * 1024**2  # room the active file grows by (fdatasync then suffices)
CHECKPOINT_SYNC = 1024**2  # checkpoint bytes written between syncs (files.write_atomic)
_NAME = re.compile(r"([0-9]{8})\.log")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Journal:
    """The journal directory and checkpoint of one state dir. Not thread-safe: one writer
    thread appends (the store's committer) while reads may run in others (pread only)."""

    def __init__(self, root: Path, *, large: int = LARGE) -> None:
        self.root = root
        self.large = large  # compressed bytes from which a segment gets its own file
        self.dir = root / "journal"
        self.active = 0  # the file appended to
        self.size = 0  # the end of its entries
        self.allocated = 0  # its size on disk: preallocated room past `size` reads as zeros
        self._fd: int | None = None
        self._readers: dict[int, int] = {}
        self._readers_lock = threading.Lock()
        self._opening = threading.Lock()  # the active file changes (ready_next runs beside)
        self._ready: tuple[int, int] | None = None  # (file, fd) made ahead by ready_next
        self._retired: list[tuple[int, int, int]] = []  # (fd, size, allocated) to seal

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
        for d in (self.dir, segment_files.directory(self.root)):
            if d.is_dir():
                out += [p for p in d.iterdir() if files.is_temp_name(p.name)]
        return out

    # -- start-up ------------------------------------------------------------------------

    def prepare(self) -> None:
        made = files.ensure_dir(self.dir)
        if files.ensure_dir(segment_files.directory(self.root)) or made:
            files.fsync_dir(self.root)

    def load(self, *, repair: bool) -> Loaded:
        """Checkpoint, then every journal entry after it. With `repair`, a torn or corrupt
        tail is cut off its file (truncated), so the next start does not meet it again,
        and what was read is made durable (the files replayed, both directories)."""
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
            if end < len(data) and data.count(0, end) != len(data) - end:  # not just zeros
                loaded.cut += 1
                loaded.cut_at.append((pack, end))
            if repair:
                self._settle(pack, end if end < len(data) else None)
            loaded.sizes[pack] = end
        if repair:  # the checkpoint's name, the files' names: durable as they were read
            files.fsync_dir(self.dir)
            files.fsync_dir(self.root)
        return loaded

    def _settle(self, pack: int, end: int | None) -> None:
        """Cut file `pack` at `end` (a torn or corrupt tail), and sync it either way: a
        process that died between a commit's write and its sync left entries in the page
        cache that this start replays, and new turns will build on them."""
        fd = files.fs.open(self.path(pack), os.O_WRONLY | _NOFOLLOW | _CLOEXEC)
        try:
            if end is not None:
                files.fs.ftruncate(fd, end)
            files.fs.fsync(fd)
        finally:
            files.fs.close(fd)

    def open_next(self) -> None:
        """Start appending to a new file after every existing one."""
        existing = self.existing()
        self._open((existing[-1] if existing else 0) + 1)

    def _open(self, pack: int, *, seal: bool = True) -> None:
        """Append to new file `pack` from now on (the one `ready_next` made, when it is).
        The file before is sealed now, or with `seal=False` kept for `seal_retired`."""
        with self._opening:
            ready, self._ready = self._ready, None
            if ready is not None and ready[0] == pack:
                fd = ready[1]
            else:
                if ready is not None:
                    files.fs.close(ready[1])
                fd = self._create(pack)
            if self._fd is not None:
                self._retired.append((self._fd, self.size, self.allocated))
            self._fd, self.active, self.size, self.allocated = fd, pack, 0, 0
        if seal:
            self.seal_retired()

    def _create(self, pack: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC
        fd = files.fs.open(self.path(pack), flags, files.FILE_MODE)
        try:
            files.fsync_dir(self.dir)
        except OSError:
            files.fs.close(fd)
            with contextlib.suppress(OSError):
                files.fs.unlink(self.path(pack))
            raise
        return fd

    def ready_next(self) -> None:
        """Blocking, while commits go on: create the file `rotate` moves to (durable in its
        directory), so the rotation, made while commits wait, does no I/O. It gets no room
        here: its first commit goes to the fsync helper all the same (`takes`)."""
        with self._opening:
            pack = self.active + 1
            if self._ready is not None:
                if self._ready[0] == pack:
                    return
                files.fs.close(self._ready[1])
                self._ready = None
            self._ready = (pack, self._create(pack))

    def seal_retired(self) -> None:
        """Close the files appended to before, without the preallocated room they did not
        use (blocking)."""
        while self._retired:
            fd, size, allocated = self._retired.pop()
            try:
                if allocated > size:
                    files.fs.ftruncate(fd, size)
                    files.fs.fsync(fd)
            except OSError:
                pass  # zeros past the end read as a clean end
            finally:
                files.fs.close(fd)

    def close(self) -> None:
        with self._opening:
            if self._fd is not None:
                self._retired.append((self._fd, self.size, self.allocated))
                self._fd = None
            if self._ready is not None:
                files.fs.close(self._ready[1])
                self._ready = None
        self.seal_retired()
        with self._readers_lock:
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()

    # -- the write side (the committer's) -----------------------------------------------

    def encode(self, jobs: Sequence[tuple[int, Any]], after: Encoded | None = None) -> Encoded:
        return encode(jobs, self.large, after)

    def append(self, jobs: Sequence[tuple[int, Any]], after: Encoded | None = None) -> list[Any]:
        """encode() (after the commit's first entries, already encoded) and write() one
        commit (blocking: the committer's thread)."""
        return self.write(*self.encode(jobs, after))

    def write(
        self, data: bytes, relative: Sequence[Any], blobs: Sequence[tuple[str, bytes]] = ()
    ) -> list[Any]:
        """Write one commit's encoded entries with one write and one fdatasync (blocking),
        after the files of its large segments (`blobs`), which its entries name.

        `relative` is encode()'s; returns, per job, (pack, offset, length) of a SEG's blob,
        else None. On OSError nothing of the commit counts: the file is cut back to where
        it was (or, when that fails too, abandoned for a new one); segment files it wrote
        are named by no entry (start-up removes them).
        """
        if blobs:
            segment_files.write(self.root, blobs)
        if self._fd is None or self.size >= FILE_BYTES:
            self._open(self.active + 1)
        fd, before = self._fd, self.size
        assert fd is not None
        at = before + len(data)
        try:
            # Writing into room allocated beforehand changes no file size, so fdatasync
            # need not commit the filesystem's metadata: a fraction of fsync's time.
            grown = at > self.allocated
            if grown:
                room = max(PREALLOCATE, at - self.allocated)
                files.fs.posix_fallocate(fd, self.allocated, room)
            files.write_at(fd, data, before)
            if grown:
                files.fs.fsync(fd)
                self.allocated += room
            else:
                files.fs.fdatasync(fd)
        except OSError:
            self.cut_back(before)
            raise
        self.size = at
        return self._placed(before, relative)

    def grow(self, pack: int, at: int) -> None:
        """Blocking, while the fsync helper writes into the room left: allocate the next
        PREALLOCATE bytes of room from `at` in file `pack` (synced), so no commit waits
        for the growth; `at` is the end of the room, or of the entries where they went
        past it (`takes`). Nothing when that file's room or end changed meanwhile. The
        committer never changes the active file or its room while this runs."""
        fd = self._fd
        if fd is None or self.active != pack or self.end() != at or at >= FILE_BYTES:
            return
        files.fs.posix_fallocate(fd, at, PREALLOCATE)
        files.fs.fsync(fd)
        self.allocated = at + PREALLOCATE

    def room(self) -> int:
        """Bytes `claim` takes now: the active file's allocated room, unless the
        file is closed or full (a write that does not fit goes through `write`)."""
        if self._fd is None or self.size >= FILE_BYTES:
            return 0
        return self.allocated - self.size

    def takes(self, length: int) -> bool:
        """Whether `claim` takes a commit of `length` bytes: it fits the allocated room, or
        the active file is empty (a file just rotated to has no room until its first
        commit: room made before would be there in a store that commits nothing after a
        checkpoint, counted against its disk cap). A commit past the allocated end grows
        the file: the helper's fdatasync then syncs its new size too."""
        return length <= self.room() or (self._fd is not None and self.size == 0)

    def end(self) -> int:
        """Where the active file's next room begins: past its room and its entries."""
        return max(self.allocated, self.size)

    def claim(self, data: bytes, relative: Sequence[Any]) -> list[Any]:
        """Take the place for one commit that the fsync helper writes and syncs (`takes`;
        not durable until it answers; on any error the caller cuts it back, `cut_back`).
        As `write`, the places of its SEG blobs."""
        assert self._fd is not None and self.takes(len(data))
        before = self.size
        self.size = before + len(data)
        return self._placed(before, relative)

    def rewrite(self, data: bytes, at: int) -> None:
        """Write a claimed commit's bytes at `at` and sync them (blocking: the helper died)."""
        files.write_at(self.fd, data, at)
        files.fs.fdatasync(self.fd)

    @property
    def fd(self) -> int:
        assert self._fd is not None
        return self._fd

    def cut_back(self, size: int) -> None:
        """A commit from `size` on failed: nothing of it may be read back as entries."""
        fd = self._fd
        self.size = size
        if fd is None:
            return
        try:
            files.fs.ftruncate(fd, size)
            self.allocated = size
        except OSError:
            self._fd = None  # the next commit opens a new file
            files.fs.close(fd)

    def _placed(self, base: int, relative: Sequence[Any]) -> list[Any]:
        return [
            None if not p else (FILES, 0, p[1]) if p[0] < 0 else (self.active, base + p[0], p[1])
            for p in relative
        ]

    def rotate(self) -> tuple[int, int]:
        """Append to a new file from now on (no I/O when `ready_next` made it); the old one
        waits for `seal_retired`. The position after everything written so far."""
        self._open(self.active + 1, seal=False)
        return self.active, 0

    def write_checkpoint(self, entries: Sequence[Entry | Copied]) -> list[tuple[int, int]]:
        """The checkpoint's entries (codec.encode_head, ...), framed here, and entries of
        the previous checkpoint file copied from it, as the new file; each entry's length
        and crc32 there. OSError when a copied entry is not what it was."""
        path = self.root / CHECKPOINT
        written: list[tuple[int, int]] = []
        old: int | None = None

        def chunks() -> Iterator[bytes]:
            for entry in entries:
                if isinstance(entry, Copied):
                    assert old is not None
                    try:
                        data = copied(os.pread(old, entry.length, entry.offset), entry)
                    except ValueError as exc:
                        raise OSError(errno.EIO, str(exc)) from None
                else:
                    data = frame(*entry)
                written.append((len(data), FRAME.unpack_from(data)[1]))
                yield data

        if any(isinstance(entry, Copied) for entry in entries):
            old = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        try:
            files.write_atomic(path, chunks(), sync_every=CHECKPOINT_SYNC)
        finally:
            if old is not None:
                os.close(old)
        return written

    def remove(self, packs: Sequence[int]) -> int:
        removed = 0
        for pack in packs:
            self._forget_reader(pack)
            try:
                files.fs.unlink(self.path(pack))
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
                fd = self._readers[pack] = os.open(
                    self.path(pack), os.O_RDONLY | _NOFOLLOW | _CLOEXEC
                )
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
            if pack == FILES:
                blob = segment_files.read(self.root, key, length)
            else:
                blob = self.read_blob(pack, offset, length)
        except FileNotFoundError:
            raise StoreFailure(FailureReason.MISSING, key) from None
        except OSError as exc:
            raise StoreFailure(FailureReason.READ_FAILED, f"{key}: {exc.strerror}") from None
        return decode(key, size, blob)

    def read_response(self, at: int) -> bytes:
        """The verified bytes of a response kept at `at` (`model.place`), or StoreFailure."""
        pack, offset, length, size = unplace(at)
        try:
            blob = self.read_blob(pack, offset, length)
        except FileNotFoundError:
            raise StoreFailure(FailureReason.MISSING, f"journal {pack}") from None
        except OSError as exc:
            raise StoreFailure(
                FailureReason.READ_FAILED, f"journal {pack}: {exc.strerror}"
            ) from None
        return decode_response(size, blob)

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


Encoded = tuple[bytes, list[Any], list[tuple[str, bytes]]]


def encode(
    jobs: Sequence[tuple[int, Any]], large: int = LARGE, after: Encoded | None = None
) -> Encoded:
    """Frame one commit's entries, compressing a SEG's data when it has no blob yet.

    A job is (SEG, (row, data or None, blob or None)), (REC, (row, response)), (RSP,
    (record id, blob)), (PUT, bytes), (DEL, bytes) or (NOP, b""). Returns the bytes; per
    job, (offset in them, length) of a SEG's, REC's or RSP's blob, (-1, length) of a SEG's
    that goes to its own file (`large` compressed bytes or more), else None; and the
    (key, blob) of those files. With `after` (the encoding of the
    commit's first entries), `jobs` are the entries that follow them, and the result
    is the whole commit's: nothing is compressed twice.
    """
    chunks: list[bytes] = []
    places: list[Any] = []
    own: list[tuple[str, bytes]] = []
    if after is not None:
        chunks.append(after[0])
        places += after[1]
        own += after[2]
    at = len(chunks[0]) if chunks else 0
    for kind, job in jobs:
        if kind == SEG:
            row, data, blob = job
            if blob is None:
                blob = compress(data)
                if len(blob) >= large:
                    own.append((row[1], blob))
                    meta = orjson.dumps([*row, len(blob)])
                    places.append((-1, len(blob)))
                    entry = frame(kind, META.pack(len(meta)) + meta)
                    chunks.append(entry)
                    at += len(entry)
                    continue
            meta = orjson.dumps(row)
            payload = b"".join((META.pack(len(meta)), meta, blob))
            places.append((at + FRAME.size + 2 + len(meta), len(blob)))
        elif kind == REC:
            row, data = job
            blob = response_blob(data)
            payload = b"".join((ROW.pack(len(row)), row, blob))
            places.append((at + FRAME.size + ROW.size + len(row), len(blob)))
        elif kind == RSP:
            name, blob = job
            payload = b"".join((META.pack(len(name)), name, blob))
            places.append((at + FRAME.size + META.size + len(name), len(blob)))
        else:
            payload = job
            places.append(None)
        entry = frame(kind, payload)
        chunks.append(entry)
        at += len(entry)
    return b"".join(chunks), places, own
