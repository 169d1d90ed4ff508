"""Makes tests/store/data/legacy_state: a state dir written by the release before
conversations kept their item ids beside the record (commit e207233), for
test_legacy_state.py. Run from a checkout of that commit, with its venv:

    git worktree add --detach /tmp/old e207233
    cd /tmp/old && python <this file> <this repo>/tests/store/data/legacy_state

A real `serve` of that code: a conversation with turns, then its checkpoint (that
release's Store.flush), then more turns, a metadata update, an item deleted and a second
conversation deleted, ended by kill -9. Writes expected.json beside the state dir (what
the conversation holds, and the last turn's forwarded input). Journal files are cut
after their last entry (the rest is preallocated zeros).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path.cwd()))
from ocxproxy.store import Store
from ocxproxy.store.local import codec
from tests.fakes.backend import FakeBackend
from tests.http.helpers import top_level_span
from tests.serve import Serve, create

KEY = "sk-legacy"


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def turn(http: aiohttp.ClientSession, url: str, conversation: str, text: str) -> None:
    body = {"model": "m", "input": text, "conversation": conversation}
    status, error, _ = await create(http, url, body)
    assert status == 200, error


async def main(out: Path) -> None:
    state = out / "state"
    shutil.rmtree(out, ignore_errors=True)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with FakeBackend() as backend, aiohttp.ClientSession(headers=headers) as http:
        first = Serve(backend.url, state)
        await first.start()
        url = first.url
        conv = await post(
            http, url + "/v1/conversations", {"items": [{"role": "user", "content": "hello"}]}
        )
        for text in ("one", "two"):
            await turn(http, url, conv["id"], text)
        other = await post(http, url + "/v1/conversations", {})
        await turn(http, url, other["id"], "elsewhere")
        assert await first.stop(signal.SIGTERM) == 0

        store = Store(
            max_resident_bytes=1 << 20, max_entries=1000, ttl=30 * 86400.0, state_dir=state
        )
        await store.start()
        assert await store.flush()  # a checkpoint of that release's rows
        await store.close()

        second = Serve(backend.url, state)
        await second.start()
        url = second.url
        await turn(http, url, conv["id"], "three")
        await post(http, f"{url}/v1/conversations/{conv['id']}", {"metadata": {"k": "v"}})
        items = await (
            await http.get(f"{url}/v1/conversations/{conv['id']}/items?order=asc")
        ).json()
        one = next(i for i in items["data"] if i.get("content", [{}])[0].get("text") == "one")
        async with http.delete(f"{url}/v1/conversations/{conv['id']}/items/{one['id']}") as r:
            assert r.status == 200
        await turn(http, url, conv["id"], "four")
        async with http.delete(f"{url}/v1/conversations/{other['id']}") as r:
            assert r.status == 200
        items = await (
            await http.get(f"{url}/v1/conversations/{conv['id']}/items?order=asc&limit=100")
        ).json()
        await second.kill9()
        last_input = top_level_span(backend.responses_seen[-1].body, "input").decode()
    for path in (state / "journal").glob("*.log"):
        data = path.read_bytes()
        ends = [o + codec.FRAME.size + len(p) for _, p, o in codec.entries(data)]
        path.write_bytes(data[: ends[-1] if ends else 0])
    (state / "lock").unlink(missing_ok=True)
    expected = {
        "key": KEY,
        "conversation": conv["id"],
        "deleted": other["id"],
        "metadata": {"k": "v"},
        "items": items["data"],
        "last_input": last_input,
    }
    (out / "expected.json").write_bytes(orjson.dumps(expected, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]).resolve()))
