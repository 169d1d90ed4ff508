"""A conversation's journal through a real `python -m ocxproxy serve` process: a turn
journals the same bytes whatever the conversation's length (its new items and their
ids, not its whole history's ids again), and a long conversation killed with -9 at random
moments continues with every acknowledged turn, forwarding the same bytes as before."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from ocxproxy.aio import spawn
from ocxproxy.cli import main
from ocxproxy.errors import NotFound
from ocxproxy.store import Store
from ocxproxy.store.local import codec
from tests.fakes.backend import FakeBackend
from tests.http.helpers import top_level_span
from tests.serve import Serve, create
from tests.store.helpers import inline, make_store


def journal_bytes(state: Path) -> int:
    """The bytes of every good entry in the journal's files (past them: preallocated
    zeros), read from outside the process."""
    total = 0
    for path in sorted((state / "journal").glob("*.log")):
        data = path.read_bytes()
        ends = [offset + codec.FRAME.size + len(p) for _, p, offset in codec.entries(data)]
        total += ends[-1] if ends else 0
    return total


async def test_a_conversation_turn_journals_as_much_at_turn_200_as_at_turn_20(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    proc = Serve(backend.url, state)
    processes.append(proc)
    await proc.start()
    headers = {"Authorization": "Bearer sk-x"}
    growth: dict[int, int] = {}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(proc.url + "/v1/conversations", json={}) as r:
            conversation = (await r.json())["id"]
        for turn in range(1, 201):
            before = journal_bytes(state) if turn in (20, 200) else 0
            body = {"model": "m", "input": "go on", "conversation": conversation}
            status, error, _ = await create(http, proc.url, body)
            assert status == 200, error
            if turn in (20, 200):
                growth[turn] = journal_bytes(state) - before
    # The same entries (this turn's items, its response, one row each): a few bytes more
    # for longer counts in the response, never the history's item ids again.
    assert 0 < growth[200] <= growth[20] + 64, growth
    assert await proc.stop() == 0


def last_text(body: bytes) -> str:
    """The text of the last input item of a forwarded body."""
    item = orjson.loads(body)["input"][-1]
    content = item["content"]
    return content if isinstance(content, str) else content[0]["text"]


async def user_texts(http: aiohttp.ClientSession, url: str, conversation: str) -> list[str]:
    texts: list[str] = []
    after = ""
    while True:
        query = f"order=asc&limit=100{'&after=' + after if after else ''}"
        async with http.get(f"{url}/v1/conversations/{conversation}/items?{query}") as r:
            assert r.status == 200
            page = await r.json()
        for item in page["data"]:
            if item.get("role") == "user":
                texts.append(item["content"][0]["text"])
        if not page["has_more"]:
            return texts
        after = page["last_id"]


async def test_a_long_conversation_killed_with_9_continues_every_acknowledged_turn(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    rng = random.Random()
    headers = {"Authorization": "Bearer sk-x"}
    n = 2  # conversations driven at once
    acked: list[list[str]] = [[] for _ in range(n)]  # texts whose 200 came back
    sent: list[str | None] = [None] * n  # the turn in flight when the process died
    async with aiohttp.ClientSession(headers=headers) as http:
        proc = Serve(backend.url, state)
        processes.append(proc)
        await proc.start()
        conversations = []
        for _ in range(n):
            async with http.post(proc.url + "/v1/conversations", json={}) as r:
                conversations.append((await r.json())["id"])

        progress = asyncio.Event()  # a turn was acknowledged

        async def drive(c: int, url: str) -> None:
            while True:
                text = f"c{c}-t{len(acked[c])}-{rng.randrange(10**6)}"
                sent[c] = text
                body = {"model": "m", "input": text, "conversation": conversations[c]}
                try:
                    status, error, _ = await create(http, url, body)
                except aiohttp.ClientError:
                    return
                assert status == 200, error
                acked[c].append(text)
                sent[c] = None
                progress.set()

        for kill in range(4):
            drivers = [spawn(drive(c, proc.url), name=f"drive-{c}") for c in range(n)]
            grown = [len(texts) + 3 for texts in acked]  # a few turns each, then any moment
            async with asyncio.timeout(60):
                while any(len(texts) < g for texts, g in zip(acked, grown, strict=True)):
                    progress.clear()
                    await progress.wait()
            await asyncio.sleep(rng.uniform(0, 0.4))
            await proc.kill9()
            await asyncio.gather(*drivers)
            forwarded = {last_text(seen.body): seen.body for seen in backend.responses_seen}
            proc = Serve(backend.url, state)
            processes.append(proc)
            await proc.start()
            for c, conversation in enumerate(conversations):
                texts = await user_texts(http, proc.url, conversation)
                # every acknowledged turn, in order; the one in flight may or may not be
                assert texts in (acked[c], [*acked[c], sent[c]]), (c, texts[-3:], acked[c][-3:])
                acked[c] = texts
                # the next turn forwards the same bytes as the last one, plus its own
                body = {"model": "m", "input": f"c{c}-after-{kill}", "conversation": conversation}
                status, error, _ = await create(http, proc.url, body)
                assert status == 200, error
                now = top_level_span(backend.responses_seen[-1].body, "input")
                if texts:
                    before = top_level_span(forwarded[texts[-1]], "input")
                    assert now.startswith(before[:-1] + b","), c
                acked[c].append(f"c{c}-after-{kill}")
        assert await proc.stop() == 0
    assert main(["state", "verify", "--state-dir", str(state)]) == 0


async def test_every_conversation_write_survives_a_restart_with_its_ids(tmp_path: Path) -> None:
    """Appends (rows naming the previous one), an item deleted and the metadata changed
    (whole rows), then appends again, a checkpoint between some of them: after a restart
    (and after a crash, the store abandoned) the items, their ids and the metadata are as
    acknowledged, and a deleted conversation stays deleted."""
    state = tmp_path / "state"

    def user(text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    async def opened() -> Store:
        store = make_store(state, offload=inline)
        await store.start()
        return store

    store = await opened()
    conv = await store.conversations.create("scope", [user("a")], {"k": "1"})
    gone = await store.conversations.create("scope", [user("x")], {})
    for text in ("b", "c"):
        conv = await store.conversations.add_items(conv, [user(text), user(text + "2")])
    await store.flush()  # a checkpoint: the rows so far whole
    conv = await store.conversations.add_items(conv, [user("d")])
    middle = conv.meta.ids[1][1]  # "b2"
    conv = await store.conversations.delete_item(conv, middle)
    conv = await store.conversations.set_metadata(conv, {"k": "2"})
    conv = await store.conversations.add_items(conv, [user("e")])
    await store.conversations.delete(gone)
    want = await store.conversations.items(conv)
    assert [item["content"] for _, item in want] == ["a", "b", "c", "c2", "d", "e"]
    assert middle not in {item_id for item_id, _ in want}
    await store.close()

    for crash in (False, True):
        store = await opened()
        assert store.check() == []
        again = await store.conversations.load("scope", conv.id)
        assert await store.conversations.items(again) == want
        assert again.meta.metadata == {"k": "2"}
        with pytest.raises(NotFound):
            await store.conversations.load("scope", gone.id)
        if crash:
            await store.abandon()
        else:
            await store.close()
