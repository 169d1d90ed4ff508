"""The members the proxy fills into a Response from the request (a coding agent's ~15 KB
of instructions and ~13 KB of tools, sent again on every turn to a backend that does not
echo them) are stored once for every turn that sends the same ones, not in each turn's
stored Response: the state dir holds them once, while GET, a restart and `state verify`
see every turn's Response complete, byte for byte as the client got it."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import zstandard
from aiohttp import web

from ocxproxy.cli import main
from tests.conftest import MakeProxy
from tests.http.helpers import sse_payloads
from tests.serve import Serve

AUTH = {"Authorization": "Bearer sk-test-a"}
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def agent_members() -> dict[str, Any]:
    """A coding agent's instructions and tools, at its sizes."""
    rng = random.Random(7)
    words = [f"w{rng.randrange(100_000)}" for _ in range(2_600)]
    tools = [
        {
            "type": "function",
            "name": f"tool_{n}",
            "description": " ".join(rng.choice(words) for _ in range(40)),
            "parameters": {
                "type": "object",
                "properties": {f"arg_{k}": {"type": "string"} for k in range(6)},
            },
        }
        for n in range(12)
    ]
    return {"instructions": "AGENT-RULES " + " ".join(words), "tools": tools}


@pytest.fixture
async def bare_backend() -> AsyncIterator[str]:
    """A stateless backend that, as llama.cpp does, answers without the request's
    instructions, tools and the other members the schema requires (JSON and SSE)."""
    count = 0

    async def respond(request: web.Request) -> web.StreamResponse:
        nonlocal count
        count += 1
        item: dict[str, Any] = {"type": "message", "id": f"msg_{count}", "status": "completed"}
        item |= {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
        answer: dict[str, Any] = {"id": f"resp_{count}", "object": "response"}
        answer |= {"status": "completed"}
        answer |= {"created_at": 1, "model": "m", "output": [item]}
        if not (await request.json()).get("stream"):
            return web.Response(body=orjson.dumps(answer), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n, kind in enumerate(("response.created", "response.completed")):
            event = orjson.dumps({"type": kind, "response": answer, "sequence_number": n})
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + event + b"\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/responses", respond)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def turns(http: aiohttp.ClientSession, url: str, n: int) -> dict[str, Any]:
    """`n` turns of one chain with the agent's members, JSON and SSE in turn: each
    Response as the client got it, by id."""
    members, previous = agent_members(), None
    got: dict[str, Any] = {}
    for k in range(n):
        body = {"model": "m", **members, "input": f"step {k}", "stream": k % 2 == 1}
        if previous is not None:
            body["previous_response_id"] = previous
        async with http.post(url + "/v1/responses", json=body, headers=AUTH) as resp:
            raw = await resp.read()
            assert resp.status == 200, raw
        response = sse_payloads(raw)[-1]["response"] if body["stream"] else orjson.loads(raw)
        assert response["instructions"] == members["instructions"]
        assert response["tools"][0]["name"] == "tool_0"
        previous = response["id"]
        got[previous] = response
    return got


async def stored(http: aiohttp.ClientSession, url: str, ids: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rid in ids:
        async with http.get(f"{url}/v1/responses/{rid}", headers=AUTH) as resp:
            assert resp.status == 200
            out[rid] = await resp.json()
    return out


def copies(root: Path, text: bytes) -> int:
    """How many times `text` is in the files under `root`, in their zstd frames too."""
    found = 0
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        found += data.count(text)
        at = data.find(_ZSTD_MAGIC)
        while at >= 0:
            with contextlib.suppress(zstandard.ZstdError):  # (not a frame after all)
                found += (
                    zstandard.ZstdDecompressor().decompressobj().decompress(data[at:]).count(text)
                )
            at = data.find(_ZSTD_MAGIC, at + 1)
    return found


async def test_the_state_dir_holds_the_agents_instructions_once(
    bare_backend: str, tmp_path: Path, processes: list[Serve], http: aiohttp.ClientSession
) -> None:
    state = tmp_path / "state"
    serve = Serve(bare_backend, state)
    processes.append(serve)
    await serve.start()
    answered = await turns(http, serve.url, 4)
    ids = list(answered)
    assert await stored(http, serve.url, ids) == answered
    assert await serve.stop() == 0
    instructions = agent_members()["instructions"].encode()
    assert copies(state, instructions[:2_000]) == 1  # (4 without: one in each turn's entry)
    again = Serve(bare_backend, state)
    processes.append(again)
    await again.start()
    assert await stored(http, again.url, ids) == answered
    await turns(http, again.url, 2)  # the same members, after the restart
    assert await again.stop() == 0
    assert copies(state, instructions[:2_000]) == 1
    assert main(["state", "verify", "--state-dir", str(state)]) == 0


async def test_memory_only_turns_share_the_members_too(
    bare_backend: str, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(bare_backend, zdr=True)
    answered = await turns(http, handle.url, 2)
    held = handle.metric("ocxproxy_store_bytes", tier="resident")
    answered |= await turns(http, handle.url, 4)
    # Four more turns hold a few KB (their items, their Responses without the members),
    # not four more copies of the ~28 KB the agent sends on each.
    assert handle.metric("ocxproxy_store_bytes", tier="resident") - held < 16_000
    assert await stored(http, handle.url, list(answered)) == answered


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> dict[str, Any]:
    async with http.post(url + "/v1/responses", json=body, headers={**AUTH, **headers}) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    answer: dict[str, Any] = orjson.loads(raw)
    return answer


async def test_each_fill_is_its_own_and_a_store_false_ones_never_reach_the_disk(
    bare_backend: str, tmp_path: Path, processes: list[Serve], http: aiohttp.ClientSession
) -> None:
    """Turns that alternate between fills each get back their own, before and after a
    restart; store:false members not shared with a stored turn are never journaled,
    though the turn continues a stored one and stored turns come around it."""
    state = tmp_path / "state"
    serve = Serve(bare_backend, state)
    processes.append(serve)
    await serve.start()
    kept, other = "STORED-RULES " + "k" * 3_000, "OTHER-RULES " + "o" * 3_000
    unkept = "UNSTORED-RULES " + "u" * 3_000
    answered: dict[str, Any] = {}
    first = await post(http, serve.url, {"model": "m", "input": "a", "instructions": kept})
    answered[first["id"]] = first
    body = {"model": "m", "input": "b", "instructions": unkept, "store": False}
    await post(http, serve.url, {**body, "previous_response_id": first["id"]})
    await post(http, serve.url, body)
    for n, instructions in enumerate((kept, other, kept, other)):
        answer = await post(
            http, serve.url, {"model": "m", "input": f"c{n}", "instructions": instructions}
        )
        answered[answer["id"]] = answer
    assert await stored(http, serve.url, list(answered)) == answered
    assert await serve.stop() == 0
    assert copies(state, b"STORED-RULES") == copies(state, b"OTHER-RULES") == 1
    assert copies(state, b"UNSTORED-RULES") == 0
    again = Serve(bare_backend, state)
    processes.append(again)
    await again.start()
    assert await stored(http, again.url, list(answered)) == answered
    assert await again.stop() == 0


async def test_deletes_replays_and_restarts_keep_the_shared_members(
    bare_backend: str, tmp_path: Path, processes: list[Serve], http: aiohttp.ClientSession
) -> None:
    """Every record of one fill names its segment: an Idempotency-Key's replay, a
    conversation's turn, a WebSocket turn and a background one give the Response as
    answered, before and after a restart, and DELETEs of some leave the others whole."""
    state = tmp_path / "state"
    members = agent_members()
    serve = Serve(bare_backend, state)
    processes.append(serve)
    await serve.start()
    answered: dict[str, Any] = {}
    for k in range(3):
        body = {"model": "m", "input": f"q{k}", **members}
        answer = await post(http, serve.url, body, **{"Idempotency-Key": f"key{k}"})
        answered[answer["id"]] = answer
    async with http.post(serve.url + "/v1/conversations", json={}, headers=AUTH) as resp:
        conversation = (await resp.json())["id"]
    answer = await post(
        http, serve.url, {"model": "m", "input": "c", "conversation": conversation, **members}
    )
    answered[answer["id"]] = answer
    ws = await http.ws_connect(serve.url + "/v1/responses", headers=AUTH)
    await ws.send_str(
        orjson.dumps({"type": "response.create", "model": "m", "input": "w", **members}).decode()
    )
    event: dict[str, Any] = {"type": ""}
    while event["type"] not in ("response.completed", "response.failed", "error"):
        event = orjson.loads((await ws.receive()).data)
    await ws.close()
    answered[event["response"]["id"]] = event["response"]
    background = await post(
        http, serve.url, {"model": "m", "input": "bg", "background": True, **members}
    )
    for _ in range(100):
        done = (await stored(http, serve.url, [background["id"]]))[background["id"]]
        if done["status"] not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.05)
    assert done["status"] == "completed" and done["instructions"] == members["instructions"]
    answered[done["id"]] = done
    ids = list(answered)
    assert await stored(http, serve.url, ids) == answered
    async with http.delete(f"{serve.url}/v1/responses/{ids[0]}", headers=AUTH) as resp:
        assert resp.status == 200
    assert await serve.stop() == 0
    assert main(["state", "verify", "--state-dir", str(state)]) == 0
    again = Serve(bare_backend, state)
    processes.append(again)
    await again.start()
    assert await stored(http, again.url, ids[1:]) == {rid: answered[rid] for rid in ids[1:]}
    replay = await post(
        http, again.url, {"model": "m", "input": "q1", **members}, **{"Idempotency-Key": "key1"}
    )
    assert replay == answered[ids[1]]
    for rid in ids[1:]:
        async with http.delete(f"{again.url}/v1/responses/{rid}", headers=AUTH) as resp:
            assert resp.status == 200
    latest = await post(http, again.url, {"model": "m", "input": "z", **members})
    assert await again.stop() == 0
    assert main(["state", "verify", "--state-dir", str(state)]) == 0
    last = Serve(bare_backend, state)
    processes.append(last)
    await last.start()
    assert await stored(http, last.url, [latest["id"]]) == {latest["id"]: latest}
    assert await last.stop() == 0
