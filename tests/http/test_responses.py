"""`/v1/responses` end to end: the official SDK and raw HTTP through the proxy to a fake
stateless backend, over real loopback sockets (CONTRACT.md C1, C2)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.fakes.scripted import ScriptedPeer, chunked
from tests.http.helpers import (
    assert_append_only,
    script_events,
    sse_payloads,
    top_level_span,
)

NOT_FOUND = {
    "error": {
        "message": "Previous response with id '{}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
}


def not_found(rid: str) -> dict[str, Any]:
    error = dict(NOT_FOUND["error"], message=NOT_FOUND["error"]["message"].format(rid))
    return {"error": error}


@pytest.fixture(params=["spec", "llama"])
async def any_backend(request: pytest.FixtureRequest) -> AsyncIterator[FakeBackend]:
    async with FakeBackend(stream_style=request.param) as fake:
        yield fake


async def post(
    http: aiohttp.ClientSession,
    proxy: ProxyHandle,
    body: Any,
    *,
    key: str | None = "sk-test-a",
    path: str = "/v1/responses",
) -> tuple[int, bytes, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(proxy.url + path, data=data, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, raw, resp.headers


def text_of(raw: bytes) -> str:
    body = orjson.loads(raw)
    return "".join(
        part["text"]
        for item in body["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


# -- the official SDK, three turns ----------------------------------------------------------


async def test_sdk_chain_non_streaming(any_backend: FakeBackend, make_proxy: MakeProxy) -> None:
    proxy = await make_proxy(any_backend.url)
    client = proxy.client()
    r1 = await client.responses.create(model="m", input=[{"role": "user", "content": "hello"}])
    assert r1.output_text == "echo#1: hello"
    r2 = await client.responses.create(model="m", input="again", previous_response_id=r1.id)
    assert r2.output_text == "echo#3: again"
    r3 = await client.responses.create(
        model="m", input=[{"role": "user", "content": "third"}], previous_response_id=r2.id
    )
    assert r3.output_text == "echo#5: third"
    seen = any_backend.responses_seen
    assert len(seen) == 3
    assert all("previous_response_id" not in s.json for s in seen)
    assert_append_only([s.body for s in seen])


def assert_spec_complete(payloads: list[dict[str, Any]]) -> None:
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    for p in payloads:
        kind = p["type"]
        if kind.startswith("response.output_item") or "_part." in kind or "text." in kind:
            assert isinstance(p["output_index"], int), p
        if "_part." in kind or "output_text." in kind:
            assert isinstance(p["content_index"], int), p


async def test_sdk_chain_streaming_create(any_backend: FakeBackend, make_proxy: MakeProxy) -> None:
    proxy = await make_proxy(any_backend.url)
    client = proxy.client()
    previous: str | None = None
    for n, word in ((1, "one"), (3, "two"), (5, "three")):
        stream = await client.responses.create(
            model="m",
            input=[{"role": "user", "content": word}],
            stream=True,
            **({"previous_response_id": previous} if previous else {}),
        )
        events = [event async for event in stream]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert deltas
        assert all((d.output_index, d.content_index) == (0, 0) for d in deltas)
        assert "".join(d.delta for d in deltas) == f"echo#{n}: {word}"
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == f"echo#{n}: {word}"
        previous = events[-1].response.id
    assert_append_only([s.body for s in any_backend.responses_seen])


async def test_sdk_chain_stream_helper(any_backend: FakeBackend, make_proxy: MakeProxy) -> None:
    """`responses.stream()` indexes its snapshot by output_index/content_index: it only
    works when the stream is spec-complete (repaired for llama-style backends)."""
    proxy = await make_proxy(any_backend.url)
    client = proxy.client()
    previous: str | None = None
    for n, word in ((1, "one"), (3, "two"), (5, "three")):
        kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
        async with client.responses.stream(
            model="m", input=[{"role": "user", "content": word}], **kwargs
        ) as stream:
            texts = [e.snapshot async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert texts[-1] == f"echo#{n}: {word}"
        assert final.output_text == f"echo#{n}: {word}"
        previous = final.id
    assert_append_only([s.body for s in any_backend.responses_seen])


async def test_llama_stream_is_repaired(
    llama_backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(llama_backend.url)
    status, raw, headers = await post(http, proxy, {"model": "m", "input": "hi", "stream": True})
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    payloads = sse_payloads(raw)
    assert_spec_complete(payloads)
    assert payloads[0]["type"] == "response.created"
    assert payloads[0]["response"]["object"] == "response"
    assert payloads[-1]["type"] == "response.completed"
    for block in raw.split(b"\n\n")[:-1]:  # every event keeps its `event:` line
        assert block.startswith(b"event: ")


# -- raw SSE relay --------------------------------------------------------------------------


def odd_sse(events: list[dict[str, Any]]) -> bytes:
    """SSE with CRLF, comments, id lines, spaced JSON and one event without a name."""
    out = b": stream opened\r\n\r\n"
    for i, event in enumerate(events):
        head = b"" if i == 3 else b"event: " + event["type"].encode() + b"\r\n"
        out += head + b"id: " + str(i).encode() + b"\r\ndata: " + json.dumps(event).encode()
        out += b"\r\n\r\n"
    return out


async def test_spec_stream_is_relayed_byte_for_byte(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    script = odd_sse(script_events("resp_s1", "héllo", spec=True))
    chunks = [script[i : i + 37] for i in range(0, len(script), 37)]  # cuts mid-event
    async with ScriptedPeer(*chunked(chunks)) as scripted:
        proxy = await make_proxy(scripted.url)
        async with http.post(
            proxy.url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}
        ) as resp:
            assert resp.status == 200
            relayed = await resp.read()
        assert relayed == script
        # ...and the turn was still understood and remembered
        status, raw, _ = await post(
            http, proxy, {"model": "m", "input": "y", "previous_response_id": "resp_s1"}, key=None
        )
        assert status == 200, raw
        forwarded = orjson.loads(scripted.bodies[-1])
        assert forwarded["input"][1]["content"][0]["text"] == "héllo"


async def test_spec_stream_payloads_match_the_backends(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The same request straight to the backend and through the proxy: same events,
    differing only in the backend's fresh ids and timestamps."""
    body = {"model": "m", "input": [{"role": "user", "content": "same"}], "stream": True}
    proxy = await make_proxy(backend.url)
    async with http.post(backend.url + "/v1/responses", json=body) as resp:
        direct = await resp.read()
    backend.reset()  # forget the prompt: same cached_tokens for the second run
    _, relayed, _ = await post(http, proxy, body)

    def scrub(raw: bytes) -> list[Any]:
        text = raw.decode()
        for payload in sse_payloads(raw):
            for found, replacement in _ids_and_times(payload):
                text = text.replace(found, replacement)
        return sse_payloads(text.encode())

    relayed_events, direct_events = scrub(relayed), scrub(direct)
    assert len(relayed_events) == len(direct_events) == 12
    for got, sent in zip(relayed_events, direct_events, strict=True):
        if "response" in sent:  # the proxy completes it: what the backend said stays
            response, given = got["response"], sent["response"]  # (its items unchanged)
            got = {**got, "response": {k: response[k] for k in given}}
        assert got == sent


def _ids_and_times(value: Any) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("id", "item_id", "call_id") and isinstance(item, str):
                found.append((item, "X"))
            elif key == "created_at":
                found.append((str(item), "0"))
            else:
                found += _ids_and_times(item)
    elif isinstance(value, list):
        for item in value:
            found += _ids_and_times(item)
    return found


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "llama"])
async def test_continuation_sent_the_instant_completed_arrives(
    spec: bool, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The backend holds the stream open after `response.completed`; a continuation sent
    as soon as those bytes arrive (before EOF) must resolve (CONTRACT.md C1.7)."""
    events = script_events("resp_fast", "first", spec=spec)
    script = b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    )
    release = asyncio.Event()
    async with ScriptedPeer(*chunked([script])) as scripted:
        scripted.answer(*chunked([script], hold_at=1, release=release))
        proxy = await make_proxy(scripted.url)
        async with http.post(
            proxy.url + "/v1/responses", json={"model": "m", "input": "a", "stream": True}
        ) as resp:
            seen = b""
            while b"response.completed" not in seen or not seen.endswith(b"\n\n"):
                async with asyncio.timeout(2):
                    chunk = await resp.content.readany()
                assert chunk, "stream ended before response.completed"
                seen += chunk
            assert not resp.content.at_eof()
            status, raw, _ = await post(
                http,
                proxy,
                {"model": "m", "input": "b", "previous_response_id": "resp_fast"},
                key=None,
            )
            assert status == 200, raw
            release.set()
            assert await resp.read() == b""
        forwarded = orjson.loads(scripted.bodies[-1])
        assert [i.get("role") for i in forwarded["input"]] == ["user", "assistant", "user"]


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "llama"])
async def test_events_are_relayed_as_they_arrive(
    spec: bool, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The backend stops before its terminal event; everything before it already reached
    the client (no buffering of deltas, CONTRACT.md C1.7)."""
    events = script_events("resp_live", "partial", spec=spec)
    chunks = [
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    ]
    release = asyncio.Event()
    async with ScriptedPeer(*chunked(chunks, hold_at=len(chunks) - 1, release=release)) as scripted:
        proxy = await make_proxy(scripted.url)
        async with http.post(
            proxy.url + "/v1/responses", json={"model": "m", "input": "a", "stream": True}
        ) as resp:
            seen = b""
            async with asyncio.timeout(3):
                while b"response.output_item.done" not in seen:
                    seen += await resp.content.readany()
            kinds = [p["type"] for p in sse_payloads(seen)]
            assert kinds == [e["type"] for e in events[:-1]]
            assert sse_payloads(seen)[3]["delta"] == "partial"
            release.set()
            rest = await resp.read()
        assert [p["type"] for p in sse_payloads(rest)] == ["response.completed"]


# -- CONTRACT.md C1.1: no previous_response_id ------------------------------------------------

ODD_BODY = (
    b'{ "stream" :false,\n\t"input": [ {"content" : "caf\\u00e9 \xe2\x98\x95", "role":"user"} ,'
    b'  {"role": "user", "content": [{"type": "input_text", "text": "two"}]}\n],'
    b'"model":"m" , "metadata": {"z": 1, "a": 2.50}  }'
)


async def test_no_previous_id_is_forwarded_byte_for_byte(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    status, raw, _ = await post(http, proxy, ODD_BODY)
    assert status == 200, raw
    assert backend.responses_seen[0].body == ODD_BODY
    assert text_of(raw) == "echo#2: two"
    streamed = ODD_BODY.replace(b'"stream" :false', b'"stream" :true')
    status, raw, _ = await post(http, proxy, streamed)
    assert status == 200
    assert backend.responses_seen[1].body == streamed


async def test_first_turn_items_replay_as_the_backend_saw_them(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    """The next turn's forwarded input starts with the first turn's items, byte for byte,
    odd spacing and escapes included (CONTRACT.md C1.2)."""
    _, raw, _ = await post(http, proxy, ODD_BODY)
    rid = orjson.loads(raw)["id"]
    status, raw, _ = await post(http, proxy, {"input": "next", "previous_response_id": rid})
    assert status == 200, raw
    assert text_of(raw) == "echo#4: next"
    first = top_level_span(ODD_BODY, "input")
    second = top_level_span(backend.responses_seen[1].body, "input")
    items = first[1:-1].strip().split(b" ,  ")
    assert second.startswith(b"[" + items[0] + b"," + items[1].strip() + b",")


# -- CONTRACT.md C1.2 / C5: unknown ids, scope ------------------------------------------------


async def test_unknown_id_is_400_and_nothing_is_forwarded(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    for stream in (False, True):
        body = {"model": "m", "input": "x", "previous_response_id": "resp_nope", "stream": stream}
        status, raw, headers = await post(http, proxy, body)
        assert status == 400
        assert headers["Content-Type"].startswith("application/json")
        assert orjson.loads(raw) == not_found("resp_nope")
    with pytest.raises(openai.BadRequestError) as info:
        await proxy.client().responses.create(model="m", input="x", previous_response_id="r_x")
    assert info.value.code == "previous_response_not_found"
    assert info.value.param == "previous_response_id"
    assert backend.seen == []


async def test_another_key_cannot_see_or_continue_a_chain(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    _, raw, _ = await post(http, proxy, {"model": "m", "input": "secret"}, key="sk-a")
    rid = orjson.loads(raw)["id"]
    body = {"model": "m", "input": "x", "previous_response_id": rid}
    for other in ("sk-b", None):
        status, raw, _ = await post(http, proxy, body, key=other)
        assert (status, orjson.loads(raw)) == (400, not_found(rid))
    assert len(backend.responses_seen) == 1
    async with http.get(
        f"{proxy.url}/v1/responses/{rid}", headers={"Authorization": "Bearer sk-b"}
    ) as resp:
        assert resp.status == 404
        assert b"secret" not in await resp.read()
    async with http.get(f"{proxy.url}/v1/responses/{rid}/input_items") as resp:
        assert resp.status == 404
        assert b"secret" not in await resp.read()
    async with http.delete(
        f"{proxy.url}/v1/responses/{rid}", headers={"Authorization": "Bearer sk-b"}
    ) as resp:
        assert resp.status == 404
    status, raw, _ = await post(http, proxy, body, key="sk-a")  # still there for its owner
    assert (status, text_of(raw)) == (200, "echo#3: x")


async def test_no_token_is_the_anonymous_scope(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    _, raw, _ = await post(http, proxy, {"model": "m", "input": "anon"}, key=None)
    rid = orjson.loads(raw)["id"]
    body = {"model": "m", "input": "more", "previous_response_id": rid}
    status, raw, _ = await post(http, proxy, body, key=None)
    assert (status, text_of(raw)) == (200, "echo#3: more")
    status, raw, _ = await post(http, proxy, body, key="sk-a")
    assert (status, orjson.loads(raw)) == (400, not_found(rid))


# -- CONTRACT.md C5: store:false; C1.4: no inheritance -------------------------------------


async def test_store_false_is_not_retained_by_default(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    r1 = await client.responses.create(model="m", input="x", store=False)
    assert r1.output_text == "echo#1: x"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="y", previous_response_id=r1.id)
    assert info.value.code == "previous_response_not_found"
    assert len(backend.responses_seen) == 1
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r1.id)


async def test_store_false_chains_with_retain_unstored(
    backend: FakeBackend, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(backend.url, retain_unstored=True)
    client = proxy.client()
    r1 = await client.responses.create(model="m", input="x", store=False)
    r2 = await client.responses.create(
        model="m", input="y", previous_response_id=r1.id, store=False
    )
    assert r2.output_text == "echo#3: y"
    assert backend.responses_seen[1].json["store"] is False
    # Kept only so it can be chained: not retrievable, as on OpenAI (CONTRACT.md C2: GET
    # serves store:true).
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r2.id)


async def test_instructions_and_tools_are_not_inherited(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    r1 = await client.responses.create(
        model="m1", input="x", instructions="be terse", tools=[tool], temperature=0.5
    )
    await client.responses.create(model="m2", input="y", previous_response_id=r1.id)
    r3 = await client.responses.create(
        model="m3", input="z", previous_response_id=r1.id, instructions="be kind"
    )
    assert r3.output_text == "echo#3: z"
    second, third = backend.responses_seen[1].json, backend.responses_seen[2].json
    for key in ("instructions", "tools", "temperature", "previous_response_id"):
        assert key not in second
    assert second["model"] == "m2"
    assert third["instructions"] == "be kind"
    assert b"be terse" not in backend.responses_seen[1].body


# -- CONTRACT.md C1.5: tool-call bindings -----------------------------------------------------


async def test_function_call_output_must_answer_a_call(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    r1 = await client.responses.create(model="m", input="CALL:get_weather")
    (call,) = r1.output
    assert call.type == "function_call"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(
            model="m",
            previous_response_id=r1.id,
            input=[{"type": "function_call_output", "call_id": "call_wrong", "output": "x"}],
        )
    assert info.value.param == "input"
    assert len(backend.responses_seen) == 1
    r2 = await client.responses.create(
        model="m",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert r2.output_text == "echo#3: tool said sunny"
    forwarded = backend.responses_seen[1].json["input"]
    assert forwarded[1]["call_id"] == forwarded[2]["call_id"] == call.call_id


# -- CONTRACT.md C1.6: what is remembered -----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_only_completed_or_truncated_turns_are_remembered(
    stream: bool, proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    async def turn(body: dict[str, Any]) -> tuple[int, str | None, bytes]:
        status, raw, _ = await post(http, proxy, {"model": "m", "stream": stream, **body})
        if status != 200:
            return status, None, raw
        if stream:
            last = sse_payloads(raw)[-1]
            return status, last["response"]["id"], raw
        return status, orjson.loads(raw)["id"], raw

    backend.status_next("incomplete")
    _, truncated, _ = await turn({"input": "long"})
    backend.status_next("failed")
    _, failed, raw = await turn({"input": "bad"})
    assert (orjson.loads(raw)["status"] if not stream else sse_payloads(raw)[-1]["type"]) in (
        "failed",
        "response.failed",
    )
    status, _, raw = await turn({"input": "go on", "previous_response_id": truncated})
    assert status == 200, raw
    status, _, raw = await turn({"input": "go on", "previous_response_id": failed})
    assert (status, orjson.loads(raw)) == (400, not_found(str(failed)))
    assert len(backend.responses_seen) == 3


KINDS = ["response.created", "response.in_progress", "response.output_item.added"]


@pytest.mark.parametrize("after", [1, 3])
@pytest.mark.parametrize("style", ["spec", "llama"])
async def test_stream_the_backend_hung_up_on_is_not_remembered(
    style: str, after: int, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The client gets the events that arrived, then an `error` event and a clean end
    (never a hang); the turn is not remembered."""
    async with FakeBackend(stream_style=style) as backend:  # type: ignore[arg-type]
        proxy = await make_proxy(backend.url)
        backend.hang_up_next(after_events=after)
        async with http.post(
            proxy.url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}
        ) as resp:
            assert resp.status == 200
            async with asyncio.timeout(5):
                seen = await resp.read()
        payloads = sse_payloads(seen)
        assert [p["type"] for p in payloads] == [*KINDS[:after], "error"]
        error = payloads[-1]
        assert error["sequence_number"] == after
        assert error["error"]["type"] == "server_error"
        assert error["message"] == error["error"]["message"]
        rid = payloads[0]["response"]["id"]
        body = {"model": "m", "input": "y", "previous_response_id": rid}
        status, raw, _ = await post(http, proxy, body, key=None)
        assert (status, orjson.loads(raw)) == (400, not_found(rid))
        status, raw, _ = await post(http, proxy, {"model": "m", "input": "ok"})
        assert status == 200  # the proxy is fine afterwards


async def test_a_stream_that_ends_before_its_terminal_event_ends_with_an_error(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """A backend that closes its stream cleanly but early: the client is told, and the
    turn is not remembered (the WebSocket path says so too, through the same check)."""
    events = script_events("resp_cut", "partial", spec=True)[:-1]  # no response.completed
    script = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    async with ScriptedPeer(*chunked([script])) as scripted:
        proxy = await make_proxy(scripted.url)
        async with http.post(
            proxy.url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}
        ) as resp:
            payloads = sse_payloads(await resp.read())
        assert [p["type"] for p in payloads] == [*(e["type"] for e in events), "error"]
        assert payloads[-1]["sequence_number"] == len(events)
        body = {"model": "m", "input": "y", "previous_response_id": "resp_cut"}
        status, raw, _ = await post(http, proxy, body, key=None)
        assert (status, orjson.loads(raw)) == (400, not_found("resp_cut"))


async def test_sdk_sees_a_broken_stream_as_an_error(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    backend.hang_up_next(after_events=3)
    stream = await proxy.client().responses.create(model="m", input="x", stream=True)
    with pytest.raises(openai.APIError, match="broke off"):
        async for _ in stream:
            pass


# -- CONTRACT.md C1.8: the backend's answers pass through ---------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 404, 422, 500, 503])
async def test_backend_errors_pass_through(
    status: int, stream: bool, proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    body = {"error": {"message": f"nope {status}", "type": "x", "param": "p", "code": "c"}}
    backend.fail_next(status, body)
    got, raw, headers = await post(http, proxy, {"model": "m", "input": "x", "stream": stream})
    assert (got, orjson.loads(raw)) == (status, body)
    assert headers["Content-Type"].startswith("application/json")
    assert headers["x-upstream-request-id"] == "req_1"  # the backend's own id
    assert headers["x-request-id"] == backend.seen[0].headers["x-request-id"]  # the proxy's
    rid_next = (await post(http, proxy, {"model": "m", "input": "x"}))[2]["x-upstream-request-id"]
    assert rid_next == "req_2"


async def test_backend_request_id_passes_through_on_streams(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    status, _, headers = await post(http, proxy, {"model": "m", "input": "x", "stream": True})
    assert (status, headers["x-upstream-request-id"]) == (200, "req_1")
    assert re.fullmatch(r"[0-9a-f]{16}", headers["x-request-id"])
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["Cache-Control"] == "no-cache"


async def test_sdk_sees_backend_errors(proxy: ProxyHandle, backend: FakeBackend) -> None:
    backend.fail_next(500)
    with pytest.raises(openai.InternalServerError) as info:
        await proxy.client().responses.create(model="m", input="x")
    assert "scripted failure 500" in str(info.value)
    assert info.value.response.headers["x-upstream-request-id"] == "req_1"


# -- CONTRACT.md C1.7: a client that disconnects cancels the upstream request ------------------


async def test_client_disconnect_mid_stream_cancels_upstream(
    llama_backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    llama_backend.delay = 0.2
    proxy = await make_proxy(llama_backend.url)
    resp = await http.post(
        proxy.url + "/v1/responses", json={"model": "m", "input": "slow", "stream": True}
    )
    first = await resp.content.readuntil(b"\n\n")
    assert b"response.created" in first
    rid = sse_payloads(first)[0]["response"]["id"]
    resp.close()  # drops the connection
    await llama_backend.wait_for(lambda: llama_backend.cancelled >= 1)
    registry = proxy.proxy.metrics.registry
    labels = {"route": "/v1/responses", "outcome": "client_disconnected"}
    async with asyncio.timeout(5):  # counted as the handler unwinds
        while registry.get_sample_value("ocxproxy_requests_total", labels) != 1:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    body = {"model": "m", "input": "more", "previous_response_id": rid}
    status, raw, _ = await post(http, proxy, body, key=None)
    assert (status, orjson.loads(raw)) == (400, not_found(rid))


async def test_client_disconnect_while_backend_stalls_cancels_upstream(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    backend.stall_next(30)
    with pytest.raises(TimeoutError):
        await http.post(
            proxy.url + "/v1/responses",
            json={"model": "m", "input": "x"},
            timeout=aiohttp.ClientTimeout(total=0.3),
        )
    await backend.wait_for(lambda: backend.cancelled >= 1)
    status, _, _ = await post(http, proxy, {"model": "m", "input": "again"})
    assert status == 200


# -- CONTRACT.md C2: stored responses ------------------------------------------------------


async def test_get_returns_the_stored_response(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    client = proxy.client()
    r1 = await client.responses.create(model="m", input="x", metadata={"k": "v"})
    got = await client.responses.retrieve(r1.id)
    assert got.model_dump() == r1.model_dump()
    assert len(backend.seen) == 1  # served from the store
    async with http.get(
        f"{proxy.url}/v1/responses/{r1.id}", headers={"Authorization": "Bearer sk-test-a"}
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        assert (await resp.json())["output"][0]["content"][0]["text"] == "echo#1: x"


async def test_get_of_a_streamed_response(proxy: ProxyHandle) -> None:
    client = proxy.client()
    async with client.responses.stream(model="m", input="s") as stream:
        final = await stream.get_final_response()
    got = await client.responses.retrieve(final.id)
    assert (got.id, got.status, got.output_text) == (final.id, "completed", "echo#1: s")


async def test_delete_then_continue_and_delete_again(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    auth = {"Authorization": "Bearer sk-test-a"}
    r1 = await proxy.client().responses.create(model="m", input="x")
    async with http.delete(f"{proxy.url}/v1/responses/{r1.id}", headers=auth) as resp:
        assert resp.status == 200
        assert await resp.json() == {"id": r1.id, "object": "response", "deleted": True}
    body = {"model": "m", "input": "y", "previous_response_id": r1.id}
    status, raw, _ = await post(http, proxy, body)
    assert (status, orjson.loads(raw)) == (400, not_found(r1.id))
    async with http.delete(f"{proxy.url}/v1/responses/{r1.id}", headers=auth) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert r1.id in error["message"]
    with pytest.raises(openai.NotFoundError):
        await proxy.client().responses.delete("resp_never")
    assert len(backend.responses_seen) == 1


async def test_deleting_a_turn_keeps_its_descendants(proxy: ProxyHandle) -> None:
    client = proxy.client()
    r1 = await client.responses.create(model="m", input="a")
    r2 = await client.responses.create(model="m", input="b", previous_response_id=r1.id)
    await client.responses.delete(r1.id)
    r3 = await client.responses.create(model="m", input="c", previous_response_id=r2.id)
    assert r3.output_text == "echo#5: c"


async def test_input_items_pagination(proxy: ProxyHandle) -> None:
    client = proxy.client()
    r1 = await client.responses.create(model="m", input=[{"role": "user", "content": "u1"}])
    r2 = await client.responses.create(model="m", input="u2", previous_response_id=r1.id)
    r3 = await client.responses.create(model="m", input="u3", previous_response_id=r2.id)

    def texts(items: list[Any]) -> list[str]:
        return [item.content[0].text for item in items]

    everything = [i async for i in client.responses.input_items.list(r3.id, limit=2)]
    assert texts(everything) == ["u3", "echo#3: u2", "u2", "echo#1: u1", "u1"]  # desc
    assert len({i.id for i in everything}) == 5
    assert all(i.type == "message" and i.status == "completed" for i in everything)
    assert [i.content[0].type for i in everything[:2]] == ["input_text", "output_text"]

    page = await client.responses.input_items.list(r3.id, limit=2, order="asc")
    assert texts(page.data) == ["u1", "echo#1: u1"]
    assert (page.has_more, page.first_id, page.last_id) == (True, page.data[0].id, page.data[1].id)
    page = await client.responses.input_items.list(r3.id, limit=2, order="asc", after=page.last_id)
    assert texts(page.data) == ["u2", "echo#3: u2"]
    page = await client.responses.input_items.list(r3.id, limit=2, order="asc", after=page.last_id)
    assert texts(page.data) == ["u3"]
    assert (page.has_more, page.first_id, page.last_id) == (False, page.data[0].id, page.data[0].id)
    default = await client.responses.input_items.list(r3.id)
    assert texts(default.data) == texts(everything)
    assert default.has_more is False
    again = [i.id async for i in client.responses.input_items.list(r3.id, limit=2)]
    assert again == [i.id for i in everything]  # minted ids are stable
    first = await client.responses.input_items.list(r1.id)
    assert texts(first.data) == ["u1"]


async def test_input_items_are_listed_like_conversation_items(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    """One view of an item for both lists: `include` keeps what it names (reasoning's
    encrypted_content, output-text logprobs) and only that; tool items have a status."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "SECRET"}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    client = proxy.client()
    r = await client.responses.create(model="m", input=[reasoning, call, output])
    url = f"{proxy.url}/v1/responses/{r.id}/input_items?order=asc"
    auth = {"Authorization": "Bearer sk-test-a"}
    async with http.get(url, headers=auth) as resp:
        plain = (await resp.json())["data"]
    assert [i["type"] for i in plain] == ["reasoning", "function_call", "function_call_output"]
    assert plain[0]["id"] == "rs_1" and "encrypted_content" not in plain[0]
    assert [i["status"] for i in plain[1:]] == ["completed", "completed"]
    async with http.get(url + "&include[]=reasoning.encrypted_content", headers=auth) as resp:
        assert (await resp.json())["data"][0]["encrypted_content"] == "SECRET"
    async with http.get(url + "&include[]=bogus", headers=auth) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "include"


@pytest.mark.parametrize(
    ("query", "param"),
    [("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"), ("order=up", "order")],
)
async def test_input_items_bad_query(
    query: str, param: str, proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    _, raw, _ = await post(http, proxy, {"model": "m", "input": "x"}, key=None)
    rid = orjson.loads(raw)["id"]
    async with http.get(f"{proxy.url}/v1/responses/{rid}/input_items?{query}") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == param


async def test_input_items_of_unknown_response_is_404(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{proxy.url}/v1/responses/resp_none/input_items") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_branches_from_one_turn_stay_apart(proxy: ProxyHandle, backend: FakeBackend) -> None:
    client = proxy.client()
    root = await client.responses.create(model="m", input="root")
    left = await client.responses.create(model="m", input="left", previous_response_id=root.id)
    right = await client.responses.create(model="m", input="right", previous_response_id=root.id)
    left2 = await client.responses.create(model="m", input="l2", previous_response_id=left.id)
    right2 = await client.responses.create(model="m", input="r2", previous_response_id=right.id)
    assert (left2.output_text, right2.output_text) == ("echo#5: l2", "echo#5: r2")
    left_input = backend.responses_seen[3].json["input"]
    right_input = backend.responses_seen[4].json["input"]
    assert "left" in str(left_input) and "right" not in str(left_input)
    assert "right" in str(right_input) and "left" not in str(right_input)
    assert_append_only([s.body for s in backend.responses_seen[1::2]])  # root→left→left2


async def test_forward_unknown_ids_when_the_operator_opts_in(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, forward_unknown_ids=True)
    raw = b'{"model": "m", "input": "x", "previous_response_id": "resp_elsewhere"}'
    status, body, _ = await post(http, proxy, raw)
    assert backend.responses_seen[0].body == raw  # as sent: the backend has the state
    assert status == 400  # this (stateless) backend refuses it, and that passes through
    assert orjson.loads(body)["error"]["param"] == "previous_response_id"


async def test_logs_never_carry_content_or_tokens(
    proxy: ProxyHandle, backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    client = proxy.client(api_key="sk-secret-token")
    r1 = await client.responses.create(model="m", input="PROMPT-SECRET")
    async with client.responses.stream(
        model="m", input="MORE-SECRET", previous_response_id=r1.id
    ) as stream:
        await stream.get_final_response()
    backend.hang_up_next(after_events=3)
    with pytest.raises(openai.APIError):
        async for _ in await client.responses.create(model="m", input="S3", stream=True):
            pass
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="X-SECRET", previous_response_id="nope")
    ours = [r for r in caplog.records if r.name.startswith(("ocxproxy", "aiohttp"))]
    assert any(r.name.startswith("ocxproxy") for r in ours)  # something was logged
    for record in ours:
        text = record.getMessage()
        for secret in ("SECRET", "echo#", "sk-secret-token"):
            assert secret not in text, text


async def test_input_tokens_counts_the_whole_chain(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    """`/v1/responses/input_tokens` takes previous_response_id too: expanded, not stored."""
    client = proxy.client()
    r1 = await client.responses.create(model="m", input="hello " * 50)
    alone = await client.responses.input_tokens.count(model="m", input="how long?")
    chained = await client.responses.input_tokens.count(
        model="m", input="how long?", previous_response_id=r1.id
    )
    assert chained.input_tokens > alone.input_tokens
    forwarded = backend.seen[-1]
    assert forwarded.path == "/v1/responses/input_tokens"
    assert "previous_response_id" not in forwarded.json
    assert len(forwarded.json["input"]) == 3  # hello…, its answer, how long?
    assert len(proxy.proxy.store) == 1  # counting remembers nothing

    before = len(backend.seen)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.input_tokens.count(model="m", previous_response_id="resp_nope")
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):  # another credential
        await proxy.client(api_key="sk-other").responses.input_tokens.count(
            model="m", previous_response_id=r1.id
        )
    assert len(backend.seen) == before


async def test_input_tokens_without_previous_id_passes_unchanged(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    raw = b'{"input":  "x",   "model":"m"}'
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            proxy.url + "/v1/responses/input_tokens",
            data=raw,
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 200
    assert backend.seen[-1].body == raw
