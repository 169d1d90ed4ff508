"""http/middleware.py: every failure is OpenAI-shaped, with the right status, and the
proxy keeps serving afterwards (CONTRACT.md C1.3, C5)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Record
from ocxproxy.store import Store
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import closed_port
from tests.serve import create


def assert_openai_error(body: Any, type_: str, param: str | None = None) -> dict[str, Any]:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert (error["type"], error["param"]) == (type_, param)
    return dict(error)


async def still_serves(http: aiohttp.ClientSession, proxy: ProxyHandle) -> None:
    async with http.post(proxy.url + "/v1/responses", json={"model": "m", "input": "ok"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["output"][0]["content"][0]["text"] == "echo#1: ok"


@pytest.mark.parametrize(
    ("raw", "param", "code"),  # (a code never null: the status's when none is more exact)
    [
        (b'{"model": "m", "input": ', None, "invalid_request_error"),
        (b"not json at all", None, "invalid_request_error"),
        (b"\xff\xfe", None, "invalid_request_error"),
        (b"", None, "invalid_request_error"),
        (b"[]", None, "invalid_request_error"),
        (b"null", None, "invalid_request_error"),
        (b'"a string"', None, "invalid_request_error"),
        (b'{"input": "x", "previous_response_id": 12}', "previous_response_id", "invalid_type"),
        (
            b'{"input": "x", "previous_response_id": {"id": "r"}}',
            "previous_response_id",
            "invalid_type",
        ),
        (b'{"input": 42}', "input", "invalid_type"),
        (b'{"input": {"role": "user"}}', "input", "invalid_type"),
        (b'{"input": "x", "store": "false"}', "store", "invalid_type"),
        (b'{"input": "x", "stream": 1}', "stream", "invalid_type"),
        (
            b'{"input": "x", "previous_response_id": "resp_1", "conversation": "conv_1"}',
            "previous_response_id",
            "mutually_exclusive_parameters",
        ),
    ],
)
async def test_bad_request_bodies(
    raw: bytes,
    param: str | None,
    code: str | None,
    proxy: ProxyHandle,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    async with http.post(
        proxy.url + "/v1/responses", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        assert resp.headers["Content-Type"].startswith("application/json")
        error = assert_openai_error(await resp.json(), "invalid_request_error", param)
    assert error["code"] == code
    assert backend.seen == []
    await still_serves(http, proxy)


@pytest.mark.parametrize("chunked", [False, True])
async def test_body_over_the_limit_is_413(
    chunked: bool, backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, max_body_bytes=1000)
    body = orjson.dumps({"model": "m", "input": "x" * 5000})

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 500):
            yield body[i : i + 500]

    async with http.post(proxy.url + "/v1/responses", data=chunks() if chunked else body) as resp:
        assert resp.status == 413
        error = assert_openai_error(await resp.json(), "invalid_request_error")
    assert "1000" in error["message"]
    assert backend.seen == []
    async with http.post(
        proxy.url + "/v1/responses", json={"model": "m", "input": "y" * 990}
    ) as resp:
        assert resp.status == 413  # the limit is on the whole body
    await still_serves(http, proxy)


async def test_body_at_the_limit_is_accepted(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    body = orjson.dumps({"model": "m", "input": "x"})
    proxy = await make_proxy(backend.url, max_body_bytes=len(body))
    async with http.post(proxy.url + "/v1/responses", data=body) as resp:
        assert resp.status == 200
    assert backend.responses_seen[0].body == body


async def wait_ready(http: aiohttp.ClientSession, proxy: ProxyHandle) -> None:
    async with asyncio.timeout(5):
        while True:
            async with http.get(proxy.url + "/readyz") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.02)


UNREACHABLE = {(502, "upstream_unreachable"), (503, "no_backend_available")}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/responses", {"model": "m", "input": "x"}),
        ("POST", "/v1/responses", {"model": "m", "input": "x", "stream": True}),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": []}),
        ("GET", "/v1/models", None),
    ],
)
@pytest.mark.parametrize("probing", [False, True])
async def test_unreachable_backend_is_a_quick_openai_error(
    probing: bool,
    method: str,
    path: str,
    body: Any,
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
) -> None:
    """502 when the connect fails; 503 once the backend is known to be down."""
    interval = 0.05 if probing else 0.0
    proxy = await make_proxy(f"http://127.0.0.1:{closed_port()}", health_interval=interval)
    for attempt in range(2):
        start = time.monotonic()
        async with http.request(method, proxy.url + path, json=body) as resp:
            error = assert_openai_error(await resp.json(), "server_error")
            status = resp.status
        assert time.monotonic() - start < 2.0
        assert (status, error["code"]) in UNREACHABLE
        if attempt == 0 and not probing:
            assert status == 502
    async with http.get(proxy.url + "/healthz") as resp:
        assert resp.status == 200


async def test_proxy_recovers_when_the_backend_comes_back(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    port = closed_port()
    proxy = await make_proxy(f"http://127.0.0.1:{port}", health_interval=0.05)
    async with http.post(proxy.url + "/v1/responses", json={"input": "x"}) as resp:
        assert resp.status in (502, 503)
    backend = FakeBackend()
    await backend.start(port=port)
    try:
        await wait_ready(http, proxy)
        await still_serves(http, proxy)
    finally:
        await backend.close()


@pytest.mark.parametrize("key", [None, "sk-wrong", ""])
async def test_required_client_keys(
    key: str | None, backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, api_keys=("sk-good",))
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/models")):
        async with http.request(
            method, proxy.url + path, json={"input": "x"}, headers=headers
        ) as resp:
            assert resp.status == 401, path
            error = assert_openai_error(await resp.json(), "invalid_request_error")
            assert error["code"] == "invalid_api_key"
    assert backend.seen == []
    ok = {"Authorization": "Bearer sk-good"}
    async with http.post(proxy.url + "/v1/responses", json={"input": "x"}, headers=ok) as resp:
        assert resp.status == 200
    async with http.get(proxy.url + "/healthz") as resp:
        assert resp.status == 200  # probes need no key


async def test_backend_timeout_is_504(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, read_timeout=0.2, health_interval=0.05)
    backend.stall_next(2)
    start = time.monotonic()
    async with http.post(proxy.url + "/v1/responses", json={"input": "x"}) as resp:
        assert resp.status == 504
        error = assert_openai_error(await resp.json(), "server_error")
    assert error["code"] == "upstream_timeout"
    assert time.monotonic() - start < 1.5
    await wait_ready(http, proxy)
    await still_serves(http, proxy)


@pytest.mark.parametrize(
    ("reason", "status", "type_", "code", "says"),
    [
        (FailureReason.WRITE_FAILED, 503, "server_error", "storage_unavailable", "could not write"),
        (FailureReason.FULL, 507, "server_error", "store_full", "is full"),
        (
            FailureReason.EVICTED,
            400,
            "invalid_request_error",
            "previous_response_not_found",
            "evicted",
        ),
        (
            FailureReason.EXPIRED,
            400,
            "invalid_request_error",
            "previous_response_not_found",
            "expired",
        ),
        (
            FailureReason.MISSING,
            400,
            "invalid_request_error",
            "previous_response_not_found",
            "lost",
        ),
        (
            FailureReason.UNKNOWN,
            400,
            "invalid_request_error",
            "previous_response_not_found",
            "it continues went while it ran (the store no longer holds it).",
        ),
        (FailureReason.CORRUPT, 503, "server_error", "storage_unavailable", "(corrupt)"),
        (FailureReason.READ_FAILED, 503, "server_error", "storage_unavailable", "(read_failed)"),
        (FailureReason.TOO_LARGE, 503, "server_error", "storage_unavailable", "(too_large)"),
    ],
)
async def test_a_refused_commit_says_why(
    reason: FailureReason,
    status: int,
    type_: str,
    code: str,
    says: str,
    backend: FakeBackend,
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A turn whose commit the store refuses is answered with what its reason is to a
    client (a full disk is not blamed for a chain lost meanwhile), as JSON and as the
    stream's `error` event, counted, its message naming no content; not acknowledged."""
    proxy = await make_proxy(backend.url)
    real = Store.commit

    async def refuse(self: Store, record: Record | None = None) -> None:
        if record is not None:
            raise StoreFailure(reason, "secret-detail")
        await real(self, record)

    monkeypatch.setattr(Store, "commit", refuse)
    for stream in (False, True):
        body = {"model": "m", "input": "private words", "stream": stream}
        got, error, rid = await create(http, proxy.url, body)
        assert rid is None and error is not None
        if stream:
            assert got == 200 and error["type"] == "error", error
            error = error["error"]
        else:
            assert got == status
        assert (error["type"], error["code"]) == (type_, code), error
        assert says in error["message"]
        assert "private" not in error["message"] and "secret" not in error["message"]
    assert proxy.metric("ocxproxy_turns_not_recorded_total", reason="storage_unavailable") == 2
    monkeypatch.undo()
    await still_serves(http, proxy)
