"""The store through the real proxy: a `python -m ocxproxy serve` process that is stopped
(SIGTERM) or killed (-9) and restarted on the same state dir, privacy of store:false and
--zdr (every byte under the state dir scanned), and the stored-response routes when every
segment has been spilled to disk."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.serve import Serve
from tests.store.helpers import all_bytes_under

ROOT = Path(__file__).resolve().parents[2]


async def chain_through(proxy: Serve, prev: str | None, *texts: str) -> tuple[str, str]:
    client = proxy.client()
    text = ""
    for t in texts:
        kwargs: dict[str, Any] = {"previous_response_id": prev} if prev else {}
        r = await client.responses.create(model="m", input=t, **kwargs)
        prev, text = r.id, r.output_text
    await client.close()
    assert prev is not None
    return prev, text


@pytest.mark.parametrize("how", ["sigterm", "kill -9"])
async def test_a_chain_survives_a_restart(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve], how: str
) -> None:
    state = tmp_path / "state"
    first = Serve(backend.url, state, "--snapshot-delay", "0.2")
    processes.append(first)
    await first.start()
    last, text = await chain_through(first, None, "one", "two", "three")
    assert text == "echo#5: three"
    if how == "sigterm":
        assert await first.stop(signal.SIGTERM) == 0
    else:
        await asyncio.sleep(0.6)  # > the snapshot delay
        assert await first.stop(signal.SIGKILL) == -signal.SIGKILL
    second = Serve(backend.url, state)
    processes.append(second)
    await second.start()
    _, text = await chain_through(second, last, "four")
    assert text == "echo#7: four"  # the backend saw the whole history again
    body = backend.responses_seen[-1].json
    assert [i["content"] for i in body["input"] if i.get("role") == "user"] == [
        "one",
        "two",
        "three",
        "four",
    ]
    assert await second.stop(signal.SIGTERM) == 0


async def test_state_cli_on_a_stopped_proxy_dir(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    proxy = Serve(backend.url, state)
    processes.append(proxy)
    await proxy.start()
    await chain_through(proxy, None, "one", "two")
    assert await proxy.stop(signal.SIGTERM) == 0

    async def cli(*args: str) -> tuple[int, str]:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ocxproxy", "state", *args, "--state-dir", str(state),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await p.communicate()
        return p.returncode or 0, out.decode()

    code, out = await cli("stats")
    # Two turns' segments and the one of the members both had filled in from the request
    assert code == 0 and re.search(r"records\s+2", out) and "segments       3 (" in out
    code, out = await cli("verify")
    assert code == 0 and "0 problems, 5 segments and responses checked" in out
    code, out = await cli("gc")
    assert code == 0 and "0 entries removed" in out


# -- privacy ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("retain_unstored", [False, True])
async def test_store_false_never_touches_disk(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    tmp_path: Path,
    retain_unstored: bool,
    stream: bool,
) -> None:
    state = tmp_path / "state"
    # small enough that stored turns spill, big enough to keep retained store:false turns
    handle = await make_proxy(
        backend.url, state_dir=state, max_resident_bytes=2048, retain_unstored=retain_unstored
    )
    client = handle.client()

    async def create(**body: Any) -> Any:
        if not stream:
            return await client.responses.create(**body)
        async with client.responses.stream(**body) as events:
            return await events.get_final_response()

    secret, public = f"SECRET-{uuid.uuid4().hex}", f"PUBLIC-{uuid.uuid4().hex}"
    kept = await client.responses.create(model="m", input=f"{public} one")
    r = await create(model="m", input=f"{secret} a", store=False, previous_response_id=kept.id)
    for i in range(3):
        r = await create(model="m", input=f"{secret} {i}", store=False)
        if retain_unstored:
            r = await create(
                model="m", input=f"{secret} more {i}", store=False, previous_response_id=r.id
            )
    kept = await client.responses.create(
        model="m", input=f"{public} two", previous_response_id=kept.id
    )
    store = handle.proxy.store
    assert await store.flush()
    await handle.server.close()  # shutdown flush too
    everything = all_bytes_under(state)
    assert public.encode() in everything  # the scan does see stored content
    assert secret.encode() not in everything


async def test_zdr_writes_nothing(
    make_proxy: MakeProxy, backend: FakeBackend, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    handle = await make_proxy(backend.url, state_dir=state, zdr=True)
    client = handle.client()
    r = await client.responses.create(model="m", input="hello")
    r = await client.responses.create(model="m", input="again", previous_response_id=r.id)
    assert r.output_text == "echo#3: again"
    assert not handle.proxy.store.durable
    await handle.server.close()
    assert not state.exists()


# -- stored-response routes over spilled segments ----------------------------------------


async def test_routes_work_when_everything_is_spilled(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url, max_resident_bytes=1)
    client = handle.client()
    r1 = await client.responses.create(model="m", input="one")
    r2 = await client.responses.create(model="m", input="two", previous_response_id=r1.id)
    store = handle.proxy.store
    assert await store.flush()
    assert store.stats().resident_bytes == 0 and store.stats().disk_segments >= 2

    got = await client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == "echo#3: two"
    assert got.model_dump() == r2.model_dump()
    auth = {"Authorization": "Bearer sk-test-a"}
    async with aiohttp.ClientSession() as http:
        url = f"{handle.url}/v1/responses/{r2.id}/input_items?order=asc"
        async with http.get(url, headers=auth) as resp:
            listed = await resp.json()
    assert listed["data"][0]["content"] == [{"type": "input_text", "text": "one"}]
    assert len(listed["data"]) == 3  # one, echo#1: one, two

    r3 = await client.responses.create(model="m", input="three", previous_response_id=r2.id)
    assert r3.output_text == "echo#5: three"
    assert await store.flush()

    await client.responses.delete(r2.id)
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{handle.url}/v1/responses/{r2.id}/input_items",
            headers={"Authorization": "Bearer sk-test-a"},
        ) as resp,
    ):
        assert resp.status == 404
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="x", previous_response_id=r2.id)
    r4 = await client.responses.create(model="m", input="four", previous_response_id=r3.id)
    assert r4.output_text == "echo#7: four"
    assert await store.flush() and store.check() == []
