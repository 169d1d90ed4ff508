"""Tests for the fake stateless Responses backend, driven over real HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.fakes.backend import FakeBackend, _common_prefix_len

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def backend() -> AsyncIterator[FakeBackend]:
    async with FakeBackend() as fb:
        yield fb


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


async def post(
    http: aiohttp.ClientSession, fb: FakeBackend, body: dict[str, Any], path: str = "/v1/responses"
) -> tuple[int, Any]:
    async with http.post(fb.url + path, json=body) as r:
        return r.status, await r.json()


def parse_sse(raw: bytes) -> list[tuple[str | None, Any]]:
    events: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data = ""
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data += line[len("data: ") :]
        events.append((name, data if data == "[DONE]" else orjson.loads(data)))
    return events


async def stream(
    http: aiohttp.ClientSession, fb: FakeBackend, body: dict[str, Any]
) -> list[tuple[str | None, Any]]:
    async with http.post(fb.url + "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return parse_sse(await r.read())


def normalize(resp: dict[str, Any]) -> dict[str, Any]:
    """Drop the per-request parts (ids, timestamps, cache counts)."""
    out = {k: v for k, v in resp.items() if k not in ("id", "created_at", "usage")}
    out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in resp["output"]]
    return out


def text_of(resp: dict[str, Any]) -> str:
    (item,) = resp["output"]
    assert item["type"] == "message"
    return str(item["content"][0]["text"])


# --------------------------------------------------------------------------- basics


async def test_string_input_echo(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    status, resp = await post(http, backend, {"model": "m1", "input": "hello"})
    assert status == 200
    assert text_of(resp) == "echo#1: hello"
    assert resp["object"] == "response"
    assert resp["id"].startswith("resp_")
    assert resp["status"] == "completed"
    assert resp["model"] == "m1"
    assert resp["previous_response_id"] is None
    assert resp["error"] is None and resp["incomplete_details"] is None
    assert resp["tools"] == [] and resp["metadata"] == {}
    (item,) = resp["output"]
    assert item["id"].startswith("msg_")
    assert item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "echo#1: hello", "annotations": []}]
    usage = resp["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


async def test_list_input_reveals_history(
    backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    items = [
        {"type": "message", "role": "system", "content": "be nice"},
        user("first"),
        assistant("echo#2: first"),
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "sec"},
                {"type": "input_text", "text": "ond"},
            ],
        },
    ]
    body = {"input": items, "instructions": "sys", "store": False, "tools": [{"type": "x"}]}
    status, resp = await post(http, backend, body)
    assert status == 200
    assert text_of(resp) == "echo#5: second"
    assert resp["model"] == "fake-model"
    assert resp["instructions"] == "sys"
    assert resp["store"] is False
    assert resp["tools"] == [{"type": "x"}]
    assert backend.responses_seen[-1].json == body


async def test_function_call_round_trip(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    items: list[Any] = [user("please CALL:get_weather now")]
    _, r1 = await post(http, backend, {"input": items})
    (call,) = r1["output"]
    assert call["type"] == "function_call"
    assert call["name"] == "get_weather"
    assert call["arguments"] == '{"n":1}'
    assert call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")

    # Same body again: still a fresh call_id.
    _, r1b = await post(http, backend, {"input": items})
    assert r1b["output"][0]["call_id"] != call["call_id"]

    items += [call, {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    _, r2 = await post(http, backend, {"input": items})
    assert text_of(r2) == "echo#3: tool said sunny"


async def test_previous_response_id_rejected(
    backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    status, body = await post(http, backend, {"input": "x", "previous_response_id": "resp_1"})
    assert status == 400
    assert body == {
        "error": {
            "message": "'previous_response_id' is not supported",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": None,
        }
    }
    status, _ = await post(http, backend, {"input": "x", "previous_response_id": None})
    assert status == 200


async def test_records_headers_and_request_ids(
    backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    headers = {"Authorization": "Bearer sk-test"}
    async with http.post(backend.url + "/v1/responses", json={"input": "a"}, headers=headers) as r:
        assert r.headers["x-request-id"] == "req_1"
    async with http.get(backend.url + "/health") as r:
        assert r.headers["x-request-id"] == "req_2"
        assert await r.json() == {"status": "ok"}
    async with http.get(backend.url + "/v1/models") as r:
        assert await r.json() == {
            "object": "list",
            "data": [{"id": "fake-model", "object": "model"}],
        }
    async with http.get(backend.url + "/nope") as r:
        assert r.status == 404
        assert r.headers["x-request-id"] == "req_4"
        assert "error" in await r.json()
    assert [(s.method, s.path) for s in backend.seen] == [
        ("POST", "/v1/responses"),
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/nope"),
    ]
    assert backend.seen[0].headers["authorization"] == "Bearer sk-test"
    assert len(backend.responses_seen) == 1


async def test_invalid_json(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    async with http.post(backend.url + "/v1/responses", data=b"{nope") as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- streaming


async def test_spec_stream_matches_non_streaming(
    backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    body = {"model": "m", "input": [user("hi"), assistant("yo"), user("stream me please")]}
    events = await stream(http, backend, body)
    types = [e["type"] for _, e in events]
    assert [name for name, _ in events] == types
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e for _, e in events if e["type"] == "response.output_text.delta"]
    assert 3 <= len(deltas) <= 4
    assert all(
        d["output_index"] == 0 and d["content_index"] == 0 and d["logprobs"] == [] for d in deltas
    )
    final = events[-1][1]["response"]
    text = "".join(d["delta"] for d in deltas)
    assert text == text_of(final) == "echo#3: stream me please"
    assert all(d["item_id"] == final["output"][0]["id"] for d in deltas)
    assert events[0][1]["response"]["status"] == "in_progress"

    _, plain = await post(http, backend, body)
    assert normalize(final) == normalize(plain)
    assert set(final["usage"]) == set(plain["usage"])


async def test_spec_stream_function_call(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    events = await stream(http, backend, {"input": "CALL:lookup"})
    assert [e["type"] for _, e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(7))
    assert events[4][1]["arguments"] == '{"n":1}'
    assert events[-1][1]["response"]["output"][0]["name"] == "lookup"


async def test_llama_stream_omits_indices(http: aiohttp.ClientSession) -> None:
    async with FakeBackend(stream_style="llama") as fb:
        events = await stream(http, fb, {"input": "hi there"})
    assert events[-1][0] == "response.completed"
    for name, event in events:
        assert name == event["type"]
        assert not {"sequence_number", "output_index", "content_index"} & set(event)
    assert text_of(events[-1][1]["response"]) == "echo#1: hi there"


async def test_delay_streams_events_separately(http: aiohttp.ClientSession) -> None:
    async with FakeBackend(delay=0.02) as fb:
        arrivals: list[float] = []
        async with http.post(fb.url + "/v1/responses", json={"input": "x", "stream": True}) as r:
            async for _line in r.content:
                if _line.startswith(b"event: "):
                    arrivals.append(time.monotonic())
    assert len(arrivals) >= 9
    assert arrivals[-1] - arrivals[0] >= 0.02 * (len(arrivals) - 1) * 0.8


# --------------------------------------------------------------------------- prefix cache


async def test_cached_tokens_grow_for_append_only(
    backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    items: list[Any] = [user("a fairly long first message " * 20)]
    _, r1 = await post(http, backend, {"input": items})
    assert r1["usage"]["input_tokens_details"]["cached_tokens"] == 0
    items += [assistant(text_of(r1)), user("second")]
    _, r2 = await post(http, backend, {"input": items})
    u2 = r2["usage"]
    assert u2["input_tokens_details"]["cached_tokens"] >= r1["usage"]["input_tokens"] - 2
    assert u2["input_tokens_details"]["cached_tokens"] < u2["input_tokens"]
    items += [assistant(text_of(r2)), user("third")]
    _, r3 = await post(http, backend, {"input": items})
    u3 = r3["usage"]
    assert u3["input_tokens_details"]["cached_tokens"] > u2["input_tokens_details"]["cached_tokens"]
    # The exact same input again is (almost) fully cached.
    _, r4 = await post(http, backend, {"input": items})
    assert r4["usage"]["input_tokens_details"]["cached_tokens"] >= u3["input_tokens"] - 1
    # A string input is canonicalized as a single user message.
    _, r5 = await post(http, backend, {"input": items[0]["content"]})
    assert r5["usage"]["input_tokens_details"]["cached_tokens"] >= r1["usage"]["input_tokens"] - 1


def test_common_prefix_len_is_fast_and_right() -> None:
    a = os.urandom(512 * 1024)
    for cut in (0, 1, 7, 4096, len(a) // 2, len(a) - 1):
        b = a[:cut] + bytes([a[cut] ^ 1]) + a[cut + 1 :]
        assert _common_prefix_len(a, b) == cut
    assert _common_prefix_len(a, a + b"x") == len(a)
    assert _common_prefix_len(b"", a) == 0
    start = time.perf_counter()
    for _ in range(16):
        _common_prefix_len(a, a[:-1] + b"\0")
    assert time.perf_counter() - start < 0.5


# --------------------------------------------------------------------------- scripting


async def test_fail_next(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    backend.fail_next(503)
    backend.fail_next(429, {"error": {"message": "slow down", "type": "rate_limit", "code": "x"}})
    status, body = await post(http, backend, {"input": "a"})
    assert status == 503
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "server_error"
    status, body = await post(http, backend, {"input": "a"})
    assert status == 429 and body["error"]["message"] == "slow down"
    status, _ = await post(http, backend, {"input": "a"})
    assert status == 200
    assert backend.script == []


async def test_hang_up_next_stream(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    backend.hang_up_next(3)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(
            backend.url + "/v1/responses", json={"input": "a", "stream": True}
        ) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                received += chunk
    events = parse_sse(received)
    assert [e["sequence_number"] for _, e in events] == [0, 1, 2]
    assert backend.cancelled == 0
    # The next request is normal again.
    status, resp = await post(http, backend, {"input": "a"})
    assert status == 200 and text_of(resp) == "echo#1: a"


async def test_hang_up_next_non_streaming(
    backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    backend.hang_up_next(0)
    with pytest.raises(aiohttp.ClientError):
        await post(http, backend, {"input": "a"})
    status, _ = await post(http, backend, {"input": "a"})
    assert status == 200


@pytest.mark.parametrize("streaming", [False, True])
async def test_status_next_incomplete(
    backend: FakeBackend, http: aiohttp.ClientSession, streaming: bool
) -> None:
    backend.status_next("incomplete")
    if streaming:
        events = await stream(http, backend, {"input": "a"})
        assert events[-1][0] == "response.incomplete"
        resp = events[-1][1]["response"]
    else:
        _, resp = await post(http, backend, {"input": "a"})
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize("streaming", [False, True])
async def test_status_next_failed(
    backend: FakeBackend, http: aiohttp.ClientSession, streaming: bool
) -> None:
    backend.status_next("failed")
    if streaming:
        events = await stream(http, backend, {"input": "a"})
        assert [name for name, _ in events] == [
            "response.created",
            "response.in_progress",
            "response.failed",
        ]
        resp = events[-1][1]["response"]
    else:
        status, resp = await post(http, backend, {"input": "a"})
        assert status == 200
    assert resp["status"] == "failed"
    assert resp["error"]["code"] == "server_error"
    assert resp["output"] == []


async def test_stall_next_cancelled_on_disconnect(
    backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    backend.stall_next(30)
    task = asyncio.ensure_future(post(http, backend, {"input": "a"}))
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await backend.wait_for(lambda: backend.cancelled == 1)


async def test_stall_next_then_answers(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    backend.stall_next(0.05)
    start = time.monotonic()
    status, resp = await post(http, backend, {"input": "a"})
    assert status == 200 and text_of(resp) == "echo#1: a"
    assert time.monotonic() - start >= 0.05
    assert backend.cancelled == 0


async def test_disconnect_mid_stream_counts_as_cancelled(http: aiohttp.ClientSession) -> None:
    async with FakeBackend(delay=0.05) as fb:
        async with http.post(fb.url + "/v1/responses", json={"input": "a", "stream": True}) as r:
            await r.content.readline()
            r.close()
        await fb.wait_for(lambda: fb.cancelled == 1)


# --------------------------------------------------------------------------- chat completions


async def test_chat_completions(backend: FakeBackend, http: aiohttp.ClientSession) -> None:
    messages = [user("one"), {"role": "assistant", "content": "x"}, user("two")]
    status, body = await post(http, backend, {"messages": messages}, "/v1/chat/completions")
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "echo#3: two"}

    url = backend.url + "/v1/chat/completions"
    async with http.post(url, json={"messages": messages, "stream": True}) as r:
        events = parse_sse(await r.read())
    assert events[-1] == (None, "[DONE]")
    chunks = [e for _, e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "echo#3: two"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# --------------------------------------------------------------------------- standalone


def test_standalone_main() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.backend", "--stream-style", "llama"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert orjson.loads(r.read()) == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
