"""Digest-named segment files: a large segment's compressed bytes in a file of its own,
`segments/<sha256>.zst`, whose name is the SHA-256 of the segment's bytes (so
`zstd -dc F | sha256sum` checks a file by hand). Written once and read with a digest check,
never copied by the journal's compaction or the checkpoint (WiscKey keeps large values out
of its log the same way).

A commit writes its large segments' files (each to a temp file, fsynced, renamed; then the
directory fsynced once) before its journal entries, which name them: a SEG entry then holds
the segment's metadata and the file's length instead of the bytes. So every file an entry
names is durable before the entry is. A file no segment needs any more is removed once a
checkpoint that no longer names it is durable (`Keydir.gone`); start-up removes the files
no entry names (a power loss between a file and its entry, or before a removal).

Every call blocks: the store runs them in a thread. OSError passes through.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store.local import files

FILES = 0  # a segment's `pack` when its bytes are in its own file (journal files count from 1)
LARGE = 8 * 1024  # compressed bytes from which a segment gets a file of its own (default)
DIR = "segments"
SUFFIX = ".zst"
_NAME = re.compile(r"([0-9a-f]{64})\.zst")


def directory(root: Path) -> Path:
    return root / DIR


def path(root: Path, key: str) -> Path:
    return root / DIR / f"{key}{SUFFIX}"


def write(root: Path, blobs: Sequence[tuple[str, bytes]]) -> None:
    """Each (key, compressed bytes) durably in its file, the directory synced once."""
    for key, blob in blobs:
        files.write_atomic(path(root, key), (blob,), sync_dir=False)
    files.fsync_dir(directory(root))


def read(root: Path, key: str, length: int) -> bytes:
    """The compressed bytes of segment `key` (StoreFailure: MISSING, CORRUPT); the caller
    checks them against the digest."""
    try:
        blob = files.read_regular(path(root, key), length)
    except FileNotFoundError:
        raise StoreFailure(FailureReason.MISSING, key) from None
    except files.FileTooLarge:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: file longer than indexed") from None
    if len(blob) != length:
        raise StoreFailure(FailureReason.CORRUPT, f"{key}: file shorter than indexed")
    return blob


def on_disk(root: Path) -> list[str]:
    """The keys whose files are there."""
    try:
        names = [p.name for p in directory(root).iterdir()]
    except FileNotFoundError:
        return []
    return [m[1] for n in names if (m := _NAME.fullmatch(n))]


def remove(root: Path, keys: Iterable[str]) -> list[str]:
    """Unlink each key's file (the directory synced once); the keys whose file is gone."""
    gone: list[str] = []
    for key in keys:
        try:
            files.fs.unlink(path(root, key))
        except FileNotFoundError:
            pass
        except OSError:
            continue  # kept: retried after the next checkpoint
        gone.append(key)
    if gone:
        with contextlib.suppress(OSError):
            files.fsync_dir(directory(root))
    return gone
