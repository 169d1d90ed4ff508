"""Compressed request bodies (CONTRACT.md C10): `Content-Encoding: zstd`, `gzip` or
`deflate` on every route, on both ways in (a Content-Length body is served by the front
end, a chunked one by aiohttp). The body reaches the backend decoded and without the
header; the decoded size is what `--max-body-bytes` limits, and a bomb is refused with
memory bounded; an unknown coding is a 415, a corrupt body a 400, both OpenAI-shaped."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx2 as httpx
import orjson
import pytest
import zstandard

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.test_errors import assert_openai_error, still_serves

CODERS = {
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data),
    "gzip": gzip.compress,
    "deflate": zlib.compress,
}


def zstd_stream(data: bytes) -> bytes:
    """A frame without a declared content size, as a streaming compressor writes it."""
    obj = zstandard.ZstdCompressor().compressobj()
    return obj.compress(data) + obj.flush()


def body_of(text: str, **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "input": text, **extra})


async def post(
    http: aiohttp.ClientSession,
    url: str,
    data: bytes,
    encoding: str,
    *,
    chunked: bool,
) -> tuple[int, Any]:
    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    async with http.post(url, data=pieces() if chunked else data, headers=headers) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "aiohttp"])
@pytest.mark.parametrize("coding", ["zstd", "gzip", "deflate", "zstd-stream", "gzip, zstd"])
async def test_create_with_a_compressed_body_chains(
    coding: str,
    chunked: bool,
    proxy: ProxyHandle,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    def encode(data: bytes) -> tuple[bytes, str]:
        if coding == "zstd-stream":
            return zstd_stream(data), "zstd"
        for name in [c.strip() for c in coding.split(",")]:
            data = CODERS[name](data)
        return data, coding

    url = proxy.url + "/v1/responses"
    first = body_of("hello " * 500)
    status, answer = await post(http, url, *encode(first), chunked=chunked)
    assert status == 200, answer
    assert answer["output"][0]["content"][0]["text"].startswith("echo#1: hello")
    second = body_of("again", previous_response_id=answer["id"])
    status, answer = await post(http, url, *encode(second), chunked=chunked)
    assert status == 200, answer
    assert answer["output"][0]["content"][0]["text"] == "echo#3: again"
    seen = backend.responses_seen
    assert seen[0].body == first  # decoded, byte for byte
    assert [s.headers.get("Content-Encoding") for s in seen] == [None, None]
    assert orjson.loads(seen[1].body)["input"][0]["content"] == "hello " * 500


async def test_the_sdk_sends_zstd_bodies_through_a_chain(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    """The openai SDK over an httpx transport that compresses every request body, as
    Codex does."""

    class Compressing(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raw = await request.aread()
            if raw:
                packed = zstandard.ZstdCompressor().compress(raw)
                request.headers["Content-Encoding"] = "zstd"
                request.headers["Content-Length"] = str(len(packed))
                request.stream = httpx.ByteStream(packed)
                request._content = packed
            return await super().handle_async_request(request)

    client = proxy.client(http_client=httpx.AsyncClient(transport=Compressing()))
    first = await client.responses.create(model="m", input="one")
    second = await client.responses.create(model="m", input="two", previous_response_id=first.id)
    assert second.output_text == "echo#3: two"
    streamed = await client.responses.create(
        model="m", input="three", previous_response_id=second.id, stream=True
    )
    events = [event async for event in streamed]
    assert events[-1].type == "response.completed"
    assert [s.headers.get("Content-Encoding") for s in backend.responses_seen] == [None] * 3
    assert orjson.loads(backend.responses_seen[2].body)["input"][-1]["content"] == "three"


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "aiohttp"])
@pytest.mark.parametrize("coding", ["zstd", "gzip"])
async def test_a_decompression_bomb_is_413_with_memory_bounded(
    coding: str,
    chunked: bool,
    backend: FakeBackend,
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
) -> None:
    limit = 1 << 20
    proxy = await make_proxy(backend.url, max_body_bytes=limit)
    zeros = b"0" * (1 << 20)
    if coding == "zstd":  # 512 MiB of "0" in about 20 KB
        obj = zstandard.ZstdCompressor(level=1).compressobj()
        bomb = b"".join(obj.compress(zeros) for _ in range(512)) + obj.flush()
    else:  # 64 MiB in about 64 KB (deflate's ratio is at most 1032:1)
        obj = zlib.compressobj(9, zlib.DEFLATED, 31)
        bomb = b"".join(obj.compress(zeros) for _ in range(64)) + obj.flush()
    assert len(bomb) < limit
    tracemalloc.start()
    try:
        status, answer = await post(
            http, proxy.url + "/v1/responses", bomb, coding, chunked=chunked
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 413
    error = assert_openai_error(answer, "invalid_request_error")
    assert error["code"] == "request_too_large"
    assert peak < 8 * limit, peak  # the limit plus a slice, never the bomb's size
    assert backend.seen == []
    await still_serves(http, proxy)


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "aiohttp"])
async def test_decoded_size_is_what_the_limit_counts(
    chunked: bool, backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    body = body_of("x" * 4000)
    proxy = await make_proxy(backend.url, max_body_bytes=len(body) - 1)
    packed = zstandard.ZstdCompressor().compress(body)
    assert len(packed) < 200
    status, answer = await post(http, proxy.url + "/v1/responses", packed, "zstd", chunked=chunked)
    assert status == 413, answer
    proxy = await make_proxy(backend.url, max_body_bytes=len(body))
    status, answer = await post(http, proxy.url + "/v1/responses", packed, "zstd", chunked=chunked)
    assert status == 200, answer
    assert backend.responses_seen[0].body == body


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "aiohttp"])
@pytest.mark.parametrize(
    ("coding", "data", "status", "code"),
    [
        ("br", body_of("hi"), 415, "unsupported_content_encoding"),
        ("zstd, compress", body_of("hi"), 415, "unsupported_content_encoding"),
        ("zstd", b"not zstd at all", 400, "invalid_content_encoding"),
        (
            "zstd",
            zstandard.ZstdCompressor().compress(body_of("hi" * 99))[:-6],
            400,
            "invalid_content_encoding",
        ),
        ("gzip", gzip.compress(body_of("hi" * 99))[:-10], 400, "invalid_content_encoding"),
        ("gzip", gzip.compress(body_of("hi")) + b"trailing junk", 400, "invalid_content_encoding"),
        ("deflate", b"\x78\x9c broken", 400, "invalid_content_encoding"),
    ],
    ids=["br", "unknown-in-list", "garbage", "zstd-cut", "gzip-cut", "gzip-junk", "deflate"],
)
async def test_bad_encodings_are_answered_and_never_forwarded(
    coding: str,
    data: bytes,
    status: int,
    code: str,
    chunked: bool,
    proxy: ProxyHandle,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    got, answer = await post(http, proxy.url + "/v1/responses", data, coding, chunked=chunked)
    assert got == status, answer
    error = assert_openai_error(answer, "invalid_request_error")
    assert error["code"] == code
    assert backend.seen == []
    await still_serves(http, proxy)


async def test_other_routes_take_compressed_bodies(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    """A passthrough route and a conversation: decoded, the header not forwarded."""
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    status, answer = await post(
        http, proxy.url + "/v1/chat/completions", gzip.compress(chat), "gzip", chunked=False
    )
    assert status == 200, answer
    assert backend.seen[-1].body == chat
    assert "Content-Encoding" not in backend.seen[-1].headers
    status, answer = await post(
        http, proxy.url + "/v1/chat/completions", b"garbage", "zstd", chunked=True
    )
    assert status == 400, answer
    conv = orjson.dumps({"items": [{"type": "message", "role": "user", "content": "hi"}]})
    status, answer = await post(
        http, proxy.url + "/v1/conversations", zstd_stream(conv), "zstd", chunked=False
    )
    assert status == 200, answer
    status, items = await post(
        http,
        proxy.url + f"/v1/conversations/{answer['id']}/items",
        zstandard.ZstdCompressor().compress(conv),
        "zstd",
        chunked=True,
    )
    assert status == 200, items
    assert items["data"][0]["content"][0]["text"] == "hi"
    status, answer = await post(http, proxy.url + "/v1/conversations", conv, "br", chunked=False)
    assert status == 415, answer
