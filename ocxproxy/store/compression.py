"""The store's plain zstd set-up (level 1, the content size in each frame, one per
thread), for both implementations: the local journal's, packs' and spill files' segments
(local/codec.py), the shared tier's Idempotency-Key values (shared/frame.py, whose other
values use the tier's dictionary set-up instead).

Level 1, not zstd's default 3: every durable turn compresses its segments on the event
loop, and on turns' JSON level 1 takes less time for compressed sizes close to level
3's. Below SMALL bytes (a short message, a tool's one-line output) data is not
compressed at all (`compress`): it is framed as zstd's raw block, which any zstd decoder
reads back, since compressing it costs more than it saves, most of it building the
frame's Huffman table, for a few dozen bytes."""

from __future__ import annotations

import threading

import zstandard

LEVEL = 1
SMALL = 256  # bytes below which `compress` stores data as it is
_RAW = b"\x28\xb5\x2f\xfd\x20"  # zstd's magic; a single segment with a 1-byte content size
_local = threading.local()


def compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def compress(data: bytes) -> bytes:
    """`data` as one zstd frame with its content size: compressed, or, below SMALL bytes,
    as one raw (stored) block."""
    n = len(data)
    if n >= SMALL:
        return compressor().compress(data)
    # The content size (1 byte), then the block's header: its size, raw, and the last one.
    return b"".join((_RAW, bytes((n, (n << 3 | 1) & 0xFF, n >> 5, 0)), data))


def decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d
