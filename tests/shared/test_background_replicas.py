"""Background responses on three `ocxproxy serve` replicas (real processes, the real CLI)
on one real Valkey in front of the slow fake backend (CONTRACT.md C11): created on one,
polled and resumed on another, cancelled from the third; the owner killed with -9 leaves
its responses `failed` (`background_lost`) on the others once its lease lapses, their
streams ending with `response.failed`."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp
import pytest

from ocxproxy.aio import spawn
from ocxproxy.store.shared.background import LEASE, RENEW_EVERY
from tests.fakes.backend import FakeBackend
from tests.shared.conftest import MakeReplicas
from tests.shared.servers import KvServer

pytestmark = pytest.mark.timeout(180)


def numbers(events: list[Any]) -> list[int]:
    return [event.sequence_number for event in events]


async def test_created_on_one_resumed_on_another_cancelled_from_a_third(
    valkey_server: KvServer, make_replicas: MakeReplicas, backend: FakeBackend
) -> None:
    replicas = await make_replicas(valkey_server.url, 3)
    one, two, three = (replicas[i].client() for i in range(3))
    try:
        backend.delay = 0.3  # a turn of a few seconds
        stream = await one.responses.create(
            model="m", input="across replicas", background=True, stream=True
        )
        first: list[Any] = []
        async for event in stream:
            first.append(event)
            if len(first) == 2:
                break
        await stream.close()
        response_id = first[0].response.id
        assert (await two.responses.retrieve(response_id)).status in ("queued", "in_progress")
        rest = [
            event
            async for event in await two.responses.retrieve(
                response_id, stream=True, starting_after=1
            )
        ]
        assert numbers(first + rest) == list(range(len(first) + len(rest)))
        assert rest[-1].type == "response.completed"
        replay = [e async for e in await three.responses.retrieve(response_id, stream=True)]
        assert [e.model_dump() for e in replay] == [e.model_dump() for e in first + rest]
        assert (await three.responses.retrieve(response_id)).output_text == (
            "echo#1: across replicas"
        )

        backend.delay = 0.0
        backend.stall_next(60)
        created = await one.responses.create(model="m", input="hang", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 2, within=10)
        started = time.perf_counter()
        cancelled = await three.responses.cancel(created.id)
        assert cancelled.status == "cancelled"
        await backend.wait_for(lambda: backend.cancelled == 1, within=1.0)
        assert time.perf_counter() - started < 1.0
        assert (await two.responses.retrieve(created.id)).status == "cancelled"
        assert (await one.responses.retrieve(created.id)).status == "cancelled"
        items = await two.responses.input_items.list(created.id)  # its input, anywhere
        assert [item.content[0].text for item in items.data] == ["hang"]  # type: ignore[union-attr]
    finally:
        for client in (one, two, three):
            await client.close()


async def test_an_owner_killed_leaves_its_responses_failed_on_the_others(
    valkey_server: KvServer, make_replicas: MakeReplicas, backend: FakeBackend
) -> None:
    replicas = await make_replicas(valkey_server.url, 3)
    owner = replicas[0].client()
    try:
        backend.stall_next(60)
        stream = await owner.responses.create(
            model="m", input="streamed", background=True, stream=True
        )
        async for event in stream:
            streamed_id = event.response.id  # response.created
            break
        await stream.close()
        backend.stall_next(60)
        polled = await owner.responses.create(model="m", input="polled", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 2, within=10)
        # Followers on the others before the kill: they must end too.
        others = [replicas[1].client(), replicas[2].client()]
        following = spawn(_events(others[1], streamed_id), name="follower")
        await replicas.kill9(0)
        killed = time.perf_counter()
        async with asyncio.timeout(LEASE + 10):
            while True:
                if (await others[0].responses.retrieve(polled.id)).status == "failed":
                    break
                await asyncio.sleep(0.05)
        seen_after = time.perf_counter() - killed
        assert seen_after <= LEASE + RENEW_EVERY + 2, seen_after
        for client in others:
            for response_id in (polled.id, streamed_id):
                lost = await client.responses.retrieve(response_id)
                assert lost.status == "failed" and lost.background is True
                assert lost.error is not None and lost.error.code == "server_error"
                assert lost.error.message.startswith("background_lost")
        events = await asyncio.wait_for(following, 10)
        assert numbers(events) == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.failed"
        assert events[-1].response.error.message.startswith("background_lost")
        for client in others:  # its input outlives its replica
            items = await client.responses.input_items.list(polled.id)
            assert [item.content[0].text for item in items.data] == ["polled"]  # type: ignore[union-attr]
        # Cancelling a lost one answers it as it is.
        assert (await others[0].responses.cancel(polled.id)).status == "failed"
        lost_total = 0.0
        for serve in (replicas[1], replicas[2]):
            text = await _metrics(serve.url)
            lost_total += sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("ocxproxy_background_lost_total ")
            )
        assert lost_total == 2
        for client in others:
            await client.close()
    finally:
        await owner.close()


async def _events(client: Any, response_id: str) -> list[Any]:
    return [event async for event in await client.responses.retrieve(response_id, stream=True)]


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        return await r.text()


async def test_a_replica_stopped_gracefully_fails_what_it_could_not_finish(
    valkey_server: KvServer, make_replicas: MakeReplicas, backend: FakeBackend
) -> None:
    replicas = await make_replicas(valkey_server.url, 2, "--shutdown-timeout", "0.5")
    owner, other = replicas[0].client(), replicas[1].client()
    try:
        backend.stall_next(60)
        created = await owner.responses.create(model="m", input="too slow", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 1, within=10)
        assert await replicas[0].stop(signal.SIGTERM) == 0
        failed = await other.responses.retrieve(created.id)  # at once: no lease to wait out
        assert failed.status == "failed"
        assert failed.error is not None and failed.error.code == "server_shutting_down"
    finally:
        await owner.close()
        await other.close()
