"""The shared tier's zstd: its values (layout.py) are a payload (its meta's length, the
meta as JSON, the data) after one encoding byte: zstd with the dictionary shipped in
dictionary.py (without the magic number), or raw when that is not smaller. A completed
Idempotency-Key's value is a plain zstd frame (`plain`: the store's one plain set-up,
store/compression.py)."""

from __future__ import annotations

import struct
from typing import Any

import orjson
import zstandard

from ocxproxy.store.compression import compressor, decompressor
from ocxproxy.store.shared import dictionary

ZstdError = zstandard.ZstdError

_dictionary = zstandard.ZstdCompressionDict(dictionary.DICTIONARY)
# Small values (a usual turn) at level 6: a fifth smaller than at 3 for ~5 µs more; large
# ones at 3, where level 6 would cost more time than the dictionary saves bytes.
_SMALL = 4096
_FORMAT = zstandard.FORMAT_ZSTD1_MAGICLESS  # the encoding byte before it says zstd
_compressors = {
    level: zstandard.ZstdCompressor(
        dict_data=_dictionary,
        compression_params=zstandard.ZstdCompressionParameters.from_level(
            level, format=_FORMAT, write_checksum=0, write_dict_id=0
        ),
    )
    for level in (3, 6)
}
_decompressor = zstandard.ZstdDecompressor(dict_data=_dictionary, format=_FORMAT)
_RAW, _ZSTD = b"r", b"d"  # raw, or zstd with the dictionary
_LENGTH = struct.Struct("<I")


def payload(meta: bytes, data: bytes) -> bytes:
    """What a value holds before compression: `meta` (JSON) and `data`."""
    return b"".join((_LENGTH.pack(len(meta)), meta, data))


def frame(meta: bytes, data: bytes) -> bytes:
    """A value: its payload, zstd-compressed with the dictionary when that makes it
    smaller (large or incompressible items may not be)."""
    raw = payload(meta, data)
    compressed = _compressors[6 if len(raw) <= _SMALL else 3].compress(raw)
    return _ZSTD + compressed if len(compressed) < len(raw) else _RAW + raw


def unframe(value: bytes) -> tuple[Any, bytes]:
    """A value's meta (decoded) and data; ValueError when it is not a value of this layout."""
    kind, body = value[:1], value[1:]
    try:
        if kind == _ZSTD:
            body = _decompressor.decompress(body)
        elif kind != _RAW:
            raise ValueError(f"unknown encoding {kind!r}")
        (size,) = _LENGTH.unpack_from(body)
        meta = orjson.loads(body[_LENGTH.size : _LENGTH.size + size])
    except (struct.error, orjson.JSONDecodeError, ZstdError) as exc:
        raise ValueError(str(exc)) from None
    return meta, bytes(body[_LENGTH.size + size :])


def plain(data: bytes) -> bytes:
    """A plain zstd frame (no dictionary, the magic number and size in it)."""
    return compressor().compress(data)


def unplain(blob: bytes) -> bytes:
    """What `plain` compressed; ZstdError when it is not a plain zstd frame."""
    return bytes(decompressor().decompress(blob))
