"""The disk tier's files: `spill/ab/<sha256 of the uncompressed bytes>.zst`, zstd-compressed.

The name is the integrity check: a read decompresses (bounded by the expected size) and
verifies the digest. Every call blocks: the store runs them in a thread. OSError and zstd
errors become StoreFailure here and nowhere else.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store import files

LEVEL = 3
WRITERS = 4  # files written (and fsynced) in parallel: the journal commits them together
_KEY = re.compile(r"[0-9a-f]{64}")
_SUFFIX = ".zst"
_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _writers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="ocxproxy-spill")
        return _pool


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


def is_key(text: str) -> bool:
    return _KEY.fullmatch(text) is not None


def compressed_limit(size: int) -> int:
    """The largest file a segment of `size` bytes can have become (zstd's bound + slack)."""
    return size + (size >> 7) + 1024


@dataclass(slots=True)
class Scan:
    """What is under spill/: digest-named files with their sizes, and everything else."""

    files: dict[str, int] = field(default_factory=dict)
    temps: list[Path] = field(default_factory=list)
    unsafe: list[Path] = field(default_factory=list)  # symlinks, stray names, non-regular


class SpillDir:
    def __init__(self, root: Path) -> None:
        self.root = root

    def __repr__(self) -> str:
        return f"<SpillDir {self.root}>"

    def path(self, key: str) -> Path:
        return self.root / key[:2] / (key + _SUFFIX)

    def prepare(self) -> None:
        if files.ensure_dir(self.root):
            files.fsync_dir(self.root.parent)

    # -- writes ------------------------------------------------------------------------

    def write_many(self, jobs: Sequence[tuple[str, bytes]]) -> list[int | StoreFailure]:
        """Write each (key, data) durably; the file size, or why it failed, per job.

        Directories are fsynced once per batch, before any result says "durable".
        """
        dirty: set[Path] = set()

        def write(job: tuple[str, bytes]) -> int | StoreFailure:
            try:
                return self._write(job[0], job[1], dirty)
            except OSError as exc:
                return _write_failure(exc)

        if len(jobs) > 1:
            results = list(_writers().map(write, jobs))
        else:
            results = [write(job) for job in jobs]
        for directory in dirty:
            try:
                files.fsync_dir(directory)
            except OSError as exc:
                failure = _write_failure(exc)
                results = [failure if isinstance(r, int) else r for r in results]
                break
        return results

    def _write(self, key: str, data: bytes, dirty: set[Path]) -> int:
        final = self.path(key)
        if files.ensure_dir(final.parent):  # racing writers of one new shard: both fine
            dirty.add(self.root)
        blob = _compressor().compress(data)
        files.write_atomic(final, blob, sync_dir=False)
        dirty.add(final.parent)
        return len(blob)

    def remove_many(self, keys: Sequence[str]) -> int:
        """Unlink these files (never following links); how many went."""
        removed = 0
        dirs: set[Path] = set()
        for key in keys:
            path = self.path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError:
                continue  # still there; start-up or `state gc` sweeps it as an orphan
            removed += 1
            dirs.add(path.parent)
        for directory in dirs:
            with contextlib.suppress(OSError):
                files.fsync_dir(directory)
        return removed

    # -- reads -------------------------------------------------------------------------

    def read(self, key: str, size: int) -> bytes:
        """The verified bytes of segment `key` (`size` bytes uncompressed), or StoreFailure."""
        try:
            blob = files.read_regular(self.path(key), compressed_limit(size))
        except FileNotFoundError:
            raise StoreFailure(FailureReason.MISSING, key) from None
        except (files.UnsafePath, files.FileTooLarge) as exc:
            raise StoreFailure(FailureReason.CORRUPT, f"{key}: {exc.strerror}") from None
        except OSError as exc:
            raise StoreFailure(FailureReason.READ_FAILED, f"{key}: {exc.strerror}") from None
        return decode(key, size, blob)

    def read_many(self, jobs: Sequence[tuple[str, int]]) -> list[bytes | StoreFailure]:
        results: list[bytes | StoreFailure] = []
        for key, size in jobs:
            try:
                results.append(self.read(key, size))
            except StoreFailure as failure:
                results.append(failure)
        return results

    # -- listing -----------------------------------------------------------------------

    def scan(self) -> Scan:
        """Everything under spill/, without following a symlink or opening a file."""
        result = Scan()
        try:
            tops = list(os.scandir(self.root))
        except FileNotFoundError:
            return result
        for top in tops:
            path = Path(top.path)
            if not (len(top.name) == 2 and top.is_dir(follow_symlinks=False)):
                (result.temps if files.is_temp_name(top.name) else result.unsafe).append(path)
                continue
            for entry in os.scandir(path):
                name, entry_path = entry.name, Path(entry.path)
                if files.is_temp_name(name):
                    result.temps.append(entry_path)
                    continue
                key = name.removesuffix(_SUFFIX)
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if (
                    name.endswith(_SUFFIX)
                    and is_key(key)
                    and key[:2] == top.name
                    and stat.S_ISREG(st.st_mode)
                ):
                    result.files[key] = st.st_size
                else:
                    result.unsafe.append(entry_path)
        return result


def decode(key: str, size: int, blob: bytes) -> bytes:
    """Decompress at most `size` bytes and check they hash to `key`; CORRUPT otherwise."""
    try:
        declared = zstandard.frame_content_size(blob)
        if declared != size:
            raise StoreFailure(FailureReason.CORRUPT, f"{key}: frame declares {declared} bytes")
        data = _decompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: {exc}") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != key:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: digest mismatch")
    return data


def _write_failure(exc: OSError) -> StoreFailure:
    name = errno.errorcode.get(exc.errno or 0, "error")
    return StoreFailure(FailureReason.WRITE_FAILED, f"{name}: {exc.strerror or exc}")
