"""http/passthrough.py: every other path is reverse-proxied transparently (CONTRACT.md C2, C5)."""

from __future__ import annotations

import asyncio
import gzip
import io
from collections.abc import AsyncIterator

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import sse_payloads

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi there"}]}
INPUT = {"model": "m", "input": "hi there"}
IMAGE = {
    "model": "m",
    "input": [
        {
            "role": "user",
            "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}],
        }
    ],
}


async def test_chat_completions_json(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    raw = b'{"messages": [ {"role":"user","content":"hi there"} ], "model":"m"}'
    headers = {"Authorization": "Bearer sk-client", "Content-Type": "application/json"}
    async with http.post(proxy.url + "/v1/chat/completions", data=raw, headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        assert resp.headers["x-upstream-request-id"] == "req_1"
        body = await resp.json()
    assert body["choices"][0]["message"]["content"] == "echo#1: hi there"
    (seen,) = backend.seen
    assert (seen.method, seen.path, seen.body) == ("POST", "/v1/chat/completions", raw)
    assert seen.headers["Authorization"] == "Bearer sk-client"


async def test_chat_completions_through_the_sdk(proxy: ProxyHandle) -> None:
    completion = await proxy.client().chat.completions.create(**CHAT)  # type: ignore[call-overload]
    assert completion.choices[0].message.content == "echo#1: hi there"


async def test_chat_completions_streaming(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    direct_body = {**CHAT, "stream": True}
    async with http.post(backend.url + "/v1/chat/completions", json=direct_body) as resp:
        direct = await resp.read()
    async with http.post(proxy.url + "/v1/chat/completions", json=direct_body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        relayed = await resp.read()
    assert relayed.endswith(b"data: [DONE]\n\n")
    chunks = sse_payloads(relayed)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "echo#1: hi there"
    assert len(relayed) == len(direct)  # same framing; only ids differ

    stream = await proxy.client().chat.completions.create(**direct_body)  # type: ignore[call-overload]
    parts = [c.choices[0].delta.content or "" async for c in stream]
    assert "".join(parts) == "echo#1: hi there"


async def test_models_and_query_strings(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    models = await proxy.client(api_key="sk-m").models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert backend.seen[-1].headers["Authorization"] == "Bearer sk-m"
    async with http.get(proxy.url + "/v1/models?a=1&b=two") as resp:
        assert resp.status == 200
    assert backend.seen[-1].path == "/v1/models"
    assert "Authorization" not in backend.seen[-1].headers


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405), ("GET", "/health", 200)],
)
async def test_backend_statuses_pass_through(
    method: str, path: str, status: int, proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    async with http.request(method, proxy.url + path) as resp:
        assert resp.status == status
        body = await resp.json()
    if status >= 400:
        assert path in body["error"]["message"]  # the backend's own error body


async def test_upstream_api_key_replaces_the_clients(
    backend: FakeBackend, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(backend.url, upstream_api_key="sk-upstream")
    client = proxy.client(api_key="sk-client")
    await client.models.list()
    await client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    r1 = await client.responses.create(model="m", input="x")
    await client.responses.create(model="m", input="y", previous_response_id=r1.id)
    assert len(backend.seen) == 4
    for seen in backend.seen:
        assert seen.headers.getall("Authorization") == ["Bearer sk-upstream"]
    other = proxy.client(api_key="sk-other")  # the client's token still decides the scope
    with pytest.raises(openai.BadRequestError) as info:
        await other.responses.create(model="m", input="z", previous_response_id=r1.id)
    assert info.value.code == "previous_response_not_found"


async def test_authorization_is_forwarded_unchanged(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    for value in ("Bearer sk-a", "bearer  sk-odd", "Basic dXNlcjpw"):
        headers = {"Authorization": value, "X-Custom": "kept"}
        async with http.post(proxy.url + "/v1/responses", json={"input": "x"}, headers=headers):
            pass
        async with http.get(proxy.url + "/v1/models", headers=headers):
            pass
        for seen in backend.seen[-2:]:
            assert seen.headers["Authorization"] == value
            assert seen.headers["X-Custom"] == "kept"


async def test_large_bodies_stream_both_ways(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    content = "z" * 3_000_000
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    async with http.post(proxy.url + "/v1/chat/completions", data=io.BytesIO(body)) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["choices"][0]["message"]["content"] == "echo#1: " + content
    assert backend.seen[0].body == body


async def test_bodies_over_the_limit_are_413_and_never_reach_the_backend(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, max_body_bytes=1000)
    url = proxy.url + "/v1/chat/completions"

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length to check up front
        for _ in range(4):
            yield b"y" * 500

    for data in (b"x" * 2000, chunked()):
        async with http.post(url, data=data) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "request_too_large"
    assert not [s for s in backend.seen if s.path == "/v1/chat/completions"]
    async with http.post(url, json=CHAT) as resp:  # the proxy stays up
        assert resp.status == 200


async def test_a_body_the_backend_breaks_off_is_cut_short_not_patched(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The status line is already out when the backend hangs up mid-body: the client's
    connection is closed, so it sees a short body; no error answer is written into it."""

    async def half_an_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\n")
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(half_an_answer, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        proxy = await make_proxy(f"http://127.0.0.1:{port}")
        async with http.get(proxy.url + "/v1/files/file_1") as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("GET", "/v1/nothing", None, 404, "invalid_request_error"),
        ("DELETE", "/v1/models", None, 405, "invalid_request_error"),
        ("POST", "/v1/chat/completions", b"{not json", 400, "invalid_request_error"),
        ("POST", "/v1/responses/input_tokens", orjson.dumps(IMAGE), 500, "server_error"),
    ],
)
async def test_a_relayed_backend_error_gets_a_string_code(
    method: str,
    path: str,
    body: bytes | None,
    status: int,
    code: str,
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
) -> None:
    """The fake backend answers errors with `"code": null`, as some backends do: the
    client gets the one the status stands for (CONTRACT.md C1.3), the message kept."""
    async with FakeBackend(rejects_images=True) as backend:
        proxy = await make_proxy(backend.url)
        headers = {"Content-Type": "application/json"}
        async with http.request(method, proxy.url + path, data=body, headers=headers) as resp:
            assert resp.status == status
            assert resp.headers["Content-Type"].startswith("application/json")
            error = (await resp.json())["error"]
    assert error["code"] == code
    assert error["message"] and error["message"] != "The backend reported an error."
    if status in (404, 405):
        assert path in error["message"]  # the backend's own message


async def test_a_relayed_backend_error_with_a_code_is_left_as_it_is(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """An error in OpenAI's shape with a string code, or one the proxy cannot read (here
    compressed), is relayed byte for byte."""
    with_code = b'{"error":{"message":"no","type":"invalid_request_error","param":null,"code":"x"}}'
    null_code = b'{"error":{"message":"no","type":"server_error","param":null,"code":null}}'
    compressed = gzip.compress(null_code)

    async def answer(request: web.Request) -> web.Response:
        if request.path == "/v1/gzipped":
            headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            return web.Response(status=503, body=compressed, headers=headers)
        return web.Response(status=429, body=with_code, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        proxy = await make_proxy(f"http://127.0.0.1:{port}")
        async with http.post(proxy.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 429
            assert await resp.read() == with_code
        headers = {"Accept-Encoding": "gzip"}
        async with http.get(
            proxy.url + "/v1/gzipped", headers=headers, auto_decompress=False
        ) as resp:
            assert resp.status == 503
            assert resp.headers["Content-Encoding"] == "gzip"
            assert await resp.read() == compressed
    finally:
        await runner.cleanup()
