"""A state dir the previous release wrote (tests/store/data/legacy_state, made by
make_legacy_state.py from commit e207233: conversations whose item ids were in their
head segment, rewritten whole every turn) loads in a real `serve` process: the
conversation's items, ids and metadata as they were, a deleted one still gone, and its
next turns forward the same bytes, before and after a kill -9."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from ocxproxy.cli import main
from ocxproxy.store.local import codec
from tests.fakes.backend import FakeBackend
from tests.http.helpers import top_level_span
from tests.serve import Serve, create

DATA = Path(__file__).resolve().parents[1] / "store" / "data" / "legacy_state"


async def items_of(http: aiohttp.ClientSession, url: str, conversation: str) -> list[Any]:
    async with http.get(f"{url}/v1/conversations/{conversation}/items?order=asc&limit=100") as r:
        assert r.status == 200
        data: list[Any] = (await r.json())["data"]
        return data


def conversation_rows(state: Path, conversation: str) -> list[list[Any]]:
    rows = []
    for path in sorted((state / "journal").glob("*.log")):
        for kind, payload, _ in codec.entries(path.read_bytes()):
            if kind == codec.PUT and (row := orjson.loads(payload))[0] == conversation:
                rows.append(row)
    return rows


async def test_the_previous_releases_conversations_load_and_continue(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    expected = orjson.loads((DATA / "expected.json").read_bytes())
    state = tmp_path / "state"
    shutil.copytree(DATA / "state", state)
    conv = expected["conversation"]
    headers = {"Authorization": f"Bearer {expected['key']}"}
    last_input = expected["last_input"].encode()
    async with aiohttp.ClientSession(headers=headers) as http:
        first = Serve(backend.url, state)
        processes.append(first)
        await first.start()
        assert await items_of(http, first.url, conv) == expected["items"]
        async with http.get(f"{first.url}/v1/conversations/{conv}") as r:
            assert (await r.json())["metadata"] == expected["metadata"]
        async with http.get(f"{first.url}/v1/conversations/{expected['deleted']}") as r:
            assert r.status == 404
        body = {"model": "m", "input": "five", "conversation": conv}
        status, error, _ = await create(http, first.url, body)
        assert status == 200, error
        five = top_level_span(backend.responses_seen[-1].body, "input")
        assert five.startswith(last_input[:-1] + b","), (last_input, five)  # the same prefix
        # Its first write since: the whole row, ids in it (no longer in the head).
        assert len(conversation_rows(state, conv)[-1]) == codec.IDS + 1
        after_five = await items_of(http, first.url, conv)
        assert after_five[: len(expected["items"])] == expected["items"]
        assert len(after_five) == len(expected["items"]) + 2
        await first.kill9()

        second = Serve(backend.url, state)
        processes.append(second)
        await second.start()
        assert await items_of(http, second.url, conv) == after_five
        body = {"model": "m", "input": "six", "conversation": conv}
        status, error, _ = await create(http, second.url, body)
        assert status == 200, error
        six = top_level_span(backend.responses_seen[-1].body, "input")
        assert six.startswith(five[:-1] + b","), (five, six)
        assert await second.stop() == 0
    assert main(["state", "verify", "--state-dir", str(state)]) == 0
