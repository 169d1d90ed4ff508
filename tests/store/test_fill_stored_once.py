"""The members the proxy fills into a Response from the request (a coding agent's ~15 KB
of instructions and ~13 KB of tools, sent again on every turn to a backend that does not
echo them) are stored once for every turn that sends the same ones, not in each turn's
stored Response: the state dir holds them once, while GET, a restart and `state verify`
see every turn's Response complete, byte for byte as the client got it."""

from __future__ import annotations

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
