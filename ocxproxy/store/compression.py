"""The store's plain zstd set-up (level 3, the content size in each frame, one per
thread), for both implementations: the local journal's, packs' and spill files' segments
(local/codec.py), the shared tier's Idempotency-Key values (shared/frame.py, whose other
values use the tier's dictionary set-up instead)."""

from __future__ import annotations

import threading

import zstandard

LEVEL = 3
_local = threading.local()


def compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d
