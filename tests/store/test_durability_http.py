"""`--durability ack` through the proxy: a stored turn is answered only once its journal
entries are durable, and a disk that refuses writes is answered, not hidden (a 503
storage_unavailable, an SSE or WebSocket `error` event, /readyz 503), while continuations
from stored turns keep working and the proxy recovers by itself. The fault is injected at
the file layer (the journal's one write call, in this process: here the store writes
without its helper process, which writes out of a monkeypatch's reach; test_fsync_child.py
covers the helper's failures)."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest

from ocxproxy.store.local import files
from ocxproxy.store.local.syncer import FsyncChild
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.store.helpers import durable_ids

AUTH = {"Authorization": "Bearer sk-test-a"}


def no_space(fd: int, data: bytes, offset: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(autouse=True)
def _writes_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FsyncChild, "spawn", classmethod(lambda cls: None))


async def test_an_answer_waits_for_its_fsync(
    make_proxy: MakeProxy, backend: FakeBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the client has the answer, the journal on disk already holds the turn."""
    handle = await make_proxy(backend.url)
    client = handle.client()
    seen: list[list[str]] = []
    real = files.write_at

    def write_at(fd: int, data: bytes, offset: int) -> None:
        real(fd, data, offset)
        seen.append(durable_ids(tmp_path / "state"))  # what a kill -9 now would leave

    monkeypatch.setattr(files, "write_at", write_at)
    r1 = await client.responses.create(model="m", input="one")
    assert r1.id in durable_ids(tmp_path / "state")
    async with client.responses.stream(model="m", input="two", previous_response_id=r1.id) as s:
        r2 = await s.get_final_response()
    assert r2.id in durable_ids(tmp_path / "state")
    assert any(r1.id in ids for ids in seen)
    await client.responses.delete(r1.id)
    assert r1.id not in durable_ids(tmp_path / "state")


async def test_disk_full_is_answered_and_recovers(
    make_proxy: MakeProxy, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = await make_proxy(backend.url)
    client = handle.client()
    stored = await client.responses.create(model="m", input="before the disk filled")
    monkeypatch.setattr(files, "write_at", no_space)

    with pytest.raises(openai.InternalServerError) as info:  # JSON: a 503, nothing kept
        await client.responses.create(model="m", input="lost", previous_response_id=stored.id)
    assert info.value.status_code == 503
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "storage_unavailable"
    assert error["type"] == "server_error"

    async with aiohttp.ClientSession() as http:  # SSE: an error event, no completed
        body = {"model": "m", "input": "streamed", "stream": True}
        async with http.post(f"{handle.url}/v1/responses", json=body, headers=AUTH) as resp:
            assert resp.status == 200
            text = await resp.text()
        assert "response.completed" not in text
        assert "event: error" in text and "storage_unavailable" in text

        async with http.get(f"{handle.url}/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["store"] == "unavailable"

        # store:false turns and continuations from stored state still work
        r = await client.responses.create(
            model="m", input="private", store=False, previous_response_id=stored.id
        )
        assert r.output_text.startswith("echo#3:")
        assert handle.metric("ocxproxy_store_available") == 0
        assert handle.metric("ocxproxy_store_write_failures_total", reason="ENOSPC") >= 2
        assert handle.metric("ocxproxy_spill_failures_total", reason="write_failed") >= 2

        monkeypatch.undo()  # space again: the proxy finds out by itself
        for _ in range(100):
            async with http.get(f"{handle.url}/readyz") as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert resp.status == 200
    again = await client.responses.create(model="m", input="after", previous_response_id=stored.id)
    assert again.output_text.startswith("echo#3:")


async def test_websocket_turn_on_a_full_disk_gets_an_error_event(
    make_proxy: MakeProxy, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = await make_proxy(backend.url)
    monkeypatch.setattr(files, "write_at", no_space)
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(f"{handle.url}/v1/responses", headers=AUTH) as ws,
    ):
        await ws.send_str(
            orjson.dumps({"type": "response.create", "model": "m", "input": "x"}).decode()
        )
        kinds = []
        while True:
            event = orjson.loads((await ws.receive()).data)
            kinds.append(event["type"])
            if event["type"] in ("error", "response.completed"):
                break
    assert kinds[-1] == "error" and "response.completed" not in kinds
    assert event["error"]["code"] == "storage_unavailable"
