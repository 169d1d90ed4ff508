"""The client's request body, bounded by `--max-body-bytes`: one rule, one message."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from ocxproxy.errors import PayloadTooLarge


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body exceeds {limit} bytes.")


def check_length(request: web.Request, limit: int) -> None:
    """A declared Content-Length over the limit is refused before a byte is read."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)


async def body_chunks(request: web.Request, limit: int) -> AsyncIterator[bytes]:
    """The body as it arrives, cut off past the limit (a chunked body declares no length)."""
    check_length(request, limit)
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        yield chunk


async def read_body(request: web.Request, limit: int) -> bytes:
    return b"".join([chunk async for chunk in body_chunks(request, limit)])
