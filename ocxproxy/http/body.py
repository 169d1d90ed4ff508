"""The client's request body, bounded by `--max-body-bytes`: one rule, one message.

A body sent with `Content-Encoding: zstd`, `gzip` or `deflate` (Codex compresses its
requests) is decoded here, for every route, and goes on decoded (the header is not
forwarded: http/headers.py). The limit is on the decoded size, and decoding stops as soon
as it passes it, so a decompression bomb costs at most the limit in memory: the compressed
input is fed to the decoder in slices no larger than the rest of the budget can take at
the format's highest ratio.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Callable, Mapping

import zstandard
from aiohttp import web

from ocxproxy.errors import InvalidRequest, OcxError, PayloadTooLarge

# A compressed body larger than this is decoded off the event loop.
_THREAD_OVER = 256 * 1024
# Bytes out per byte in, at most: a zstd RLE block (4 bytes → 128 KiB); deflate's 1032:1
# is far below it.
_MAX_RATIO = 32768
_MIN_SLICE = 64


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body exceeds {limit} bytes.")


class UnsupportedEncoding(OcxError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


def _corrupt(coding: str) -> InvalidRequest:
    return InvalidRequest(
        f"The request body is not valid {coding} data (Content-Encoding: {coding}).",
        code="invalid_content_encoding",
    )


def codings_of(headers: Mapping[str, str]) -> list[str]:
    """The Content-Encoding codings in the order they were applied, `identity` left out;
    an unknown one → 415."""
    value = headers.get("Content-Encoding")
    if not value:
        return []
    codings = []
    for token in value.split(","):
        coding = token.strip().lower()
        if coding in ("", "identity"):
            continue
        if coding not in _DECODERS:
            raise UnsupportedEncoding(
                f"Content-Encoding '{token.strip()}' is not supported; "
                "send the body as zstd, gzip, deflate or unencoded."
            )
        codings.append(coding)
    return codings


class _Zstd:
    def __init__(self) -> None:
        self.obj = zstandard.ZstdDecompressor().decompressobj()

    def feed(self, data: memoryview) -> bytes:
        return self.obj.decompress(data)

    @property
    def eof(self) -> bool:
        return bool(self.obj.eof)

    @property
    def unused_data(self) -> bytes:
        return bytes(self.obj.unused_data)


class _Zlib:
    def __init__(self, wbits: int) -> None:
        self.obj = zlib.decompressobj(wbits)

    def feed(self, data: memoryview) -> bytes:
        return self.obj.decompress(data)

    @property
    def eof(self) -> bool:
        return self.obj.eof

    @property
    def unused_data(self) -> bytes:
        return self.obj.unused_data


def _deflate_for(data: bytes) -> _Zlib:
    """RFC 9110's deflate is the zlib format; some clients send raw deflate instead."""
    zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and int.from_bytes(data[:2]) % 31 == 0
    return _Zlib(15 if zlib_header else -15)


_DECODERS: dict[str, Callable[[bytes], _Zstd | _Zlib]] = {
    "zstd": lambda data: _Zstd(),
    "gzip": lambda data: _Zlib(31),
    "x-gzip": lambda data: _Zlib(31),
    "deflate": _deflate_for,
}


def _decode_one(coding: str, data: bytes, limit: int) -> bytes:
    """`data` decoded, in slices sized so the output can never pass `limit` by more than
    one slice's worth at the highest ratio; concatenated zstd frames or gzip members are
    one body, as their formats say."""
    out = bytearray()
    while data:
        decoder = _DECODERS[coding](data)
        view = memoryview(data)
        pos = 0
        try:
            while pos < len(view) and not decoder.eof:
                step = max(_MIN_SLICE, (limit - len(out)) // _MAX_RATIO)
                out += decoder.feed(view[pos : pos + step])
                pos += step
                if len(out) > limit:
                    raise too_large(limit)
        except (zlib.error, zstandard.ZstdError):
            raise _corrupt(coding) from None
        if not decoder.eof:
            raise _corrupt(coding)  # cut short
        data = decoder.unused_data + bytes(view[pos:])
        if coding == "deflate" and data:
            raise _corrupt(coding)  # deflate has no members: trailing bytes are garbage
    return bytes(out)


def _decode(codings: list[str], data: bytes, limit: int) -> bytes:
    for coding in reversed(codings):
        data = _decode_one(coding, data, limit)
    return data


async def decoded(codings: list[str], data: bytes, limit: int) -> bytes:
    """The body with its codings undone (413 past `limit`, 400 when corrupt)."""
    if not codings:
        return data
    if len(data) > _THREAD_OVER:
        return await asyncio.to_thread(_decode, codings, data, limit)
    return _decode(codings, data, limit)


def check_length(request: web.Request, limit: int) -> None:
    """A declared Content-Length over the limit is refused before a byte is read (the
    encoded size: a compressed body is smaller than the limit it is held to)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)


async def body_chunks(request: web.Request, limit: int) -> AsyncIterator[bytes]:
    """An unencoded body as it arrives, cut off past the limit (a chunked body declares no
    length). An encoded one is read whole, by read_body."""
    check_length(request, limit)
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        yield chunk


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, decoded."""
    codings = codings_of(request.headers)
    raw = b"".join([chunk async for chunk in body_chunks(request, limit)])
    return await decoded(codings, raw, limit)
