"""Background responses on the shared store (CONTRACT.md C11), three proxies in this process
on one real Valkey in front of the fake backend, driven by the openai SDK: created on one,
polled, resumed and cancelled on the others; the event log and the status are the
server's, so any replica streams the same events, gap-free, to the end of a turn another
replica runs."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import uuid
from collections import Counter
from typing import Any

import openai
import orjson
import pytest
import redis.asyncio as aioredis

from ocxproxy.aio import spawn
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store.background import LOG_KEPT, Job
from ocxproxy.store.shared import background as shared_background
from ocxproxy.store.shared import server as shared_server
from ocxproxy.store.shared.background import LEASE, OUTAGE, RENEW_EVERY, SharedBackgrounds
from ocxproxy.store.shared.keys import background_keys
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.test_background import unfinished, until_ended
from tests.shared.servers import KvServer
from tests.shared.test_privacy import expanded


async def replicas(
    make_proxy: MakeProxy, backend: FakeBackend, url: str, n: int = 3, **config: Any
) -> list[ProxyHandle]:
    return [
        await make_proxy(backend.url, shared_store=url, state_dir=None, **config) for _ in range(n)
    ]


def numbers(events: list[Any]) -> list[int]:
    return [event.sequence_number for event in events]


@pytest.mark.parametrize("durability", ["ack", "relaxed"])
async def test_created_on_one_polled_on_another_finishes_there(
    make_proxy: MakeProxy, valkey_server: KvServer, durability: str
) -> None:
    async with FakeBackend(delay=0.3) as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url, durability=durability)
        created = await a.client().responses.create(model="m", input="slow", background=True)
        assert created.status == "queued" and created.background is True
        polled = await b.client().responses.retrieve(created.id)
        assert polled.status in ("queued", "in_progress") and polled.id == created.id
        done = await until_ended(c.client(), created.id)
        assert done.status == "completed" and done.output_text == "echo#1: slow"
        assert len(backend.responses_seen) == 1
        # Finished, it is a stored response on every replica: continue it on another.
        more = await b.client().responses.create(
            model="m", input="more", previous_response_id=created.id
        )
        assert more.output_text == "echo#3: more"  # (the backend got all three items)
        # Another credential sees nothing of it.
        with pytest.raises(openai.NotFoundError):
            await c.client(api_key="sk-other").responses.retrieve(created.id)


async def test_a_stream_cut_on_one_resumes_on_another_while_it_runs(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend(delay=0.2) as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        stream = await a.client().responses.create(
            model="m", input="stream me across", background=True, stream=True
        )
        first: list[Any] = []
        async for event in stream:
            first.append(event)
            if len(first) == 3:
                break
        await stream.close()
        assert numbers(first) == [0, 1, 2]
        response_id = first[0].response.id
        # On b, from after 2, while a still runs it: the rest, live, to the terminal event.
        rest = [
            event
            async for event in await b.client().responses.retrieve(
                response_id, stream=True, starting_after=2
            )
        ]
        assert numbers(rest) == list(range(3, 3 + len(rest)))
        assert rest[-1].type == "response.completed"
        assert rest[-1].response.output_text == "echo#1: stream me across"
        # On c, the whole log: the same events, from 0.
        replay = [e async for e in await c.client().responses.retrieve(response_id, stream=True)]
        assert [e.model_dump() for e in replay] == [e.model_dump() for e in first + rest]
        async with c.client().responses.stream(response_id=response_id, starting_after=4) as h:
            tail = [event async for event in h]
            final = await h.get_final_response()
        assert numbers(tail) == numbers(replay)[5:]
        assert final.output_text == "echo#1: stream me across"
        assert b.metric("ocxproxy_background_resumes_total") == 1


async def test_a_cancel_on_another_replica_stops_the_owners_backend_request(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        backend.stall_next(60)
        created = await a.client().responses.create(model="m", input="hang", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        started = time.perf_counter()
        cancelled = await c.client().responses.cancel(created.id)
        assert cancelled.status == "cancelled" and cancelled.id == created.id
        await backend.wait_for(lambda: backend.cancelled == 1, within=1.0)
        assert time.perf_counter() - started < 1.0
        again = await b.client().responses.cancel(created.id)
        assert again.model_dump() == cancelled.model_dump()
        for proxy in (a, b, c):
            assert (await proxy.client().responses.retrieve(created.id)).status == "cancelled"
        with pytest.raises(openai.BadRequestError):  # nothing was kept to continue from
            await b.client().responses.create(
                model="m", input="more", previous_response_id=created.id
            )
        assert not a.proxy.backgrounds.running()


async def test_a_cancelled_stream_ends_with_response_cancelled_on_every_replica(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        backend.stall_next(60)
        stream = await a.client().responses.create(
            model="m", input="hang", background=True, stream=True
        )
        first = await anext(aiter(stream))
        response_id = first.response.id
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)

        async def rest_on(proxy: ProxyHandle) -> list[Any]:
            resumed = await proxy.client().responses.retrieve(response_id, stream=True)
            return [event async for event in resumed]

        following = spawn(rest_on(b), name="follower")
        await asyncio.sleep(0.3)  # (it has read the log, and waits)
        assert (await c.client().responses.cancel(response_id)).status == "cancelled"
        on_a = [event async for event in stream]  # the owner's own follower
        on_b = await asyncio.wait_for(following, 5)
        on_c = await rest_on(c)
        for events in ([first, *on_a], on_b, on_c):
            assert numbers(events) == [0, 1]
            assert events[-1].type == "response.cancelled"
            assert events[-1].model_dump()["response"]["status"] == "cancelled"
        await backend.wait_for(lambda: backend.cancelled == 1, within=1.0)
        # Deleted on another replica: gone everywhere, its log with it.
        deleted = await b.client().responses.delete(response_id)
        assert deleted is None
        for proxy in (a, b, c):
            with pytest.raises(openai.NotFoundError):
                await proxy.client().responses.retrieve(response_id)


async def test_event_logs_beyond_the_budget_go_oldest_first(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend() as backend:
        a, b = await replicas(make_proxy, backend, valkey_server.url, 2, background_log_bytes=6000)
        ids = []
        for n in range(4):
            stream = await a.client().responses.create(
                model="m", input=f"turn {n}", background=True, stream=True
            )
            events = [event async for event in stream]
            assert events[-1].type == "response.completed"
            ids.append(events[0].response.id)
        assert 0 < a.metric("ocxproxy_background_log_bytes") <= 6000
        newest = [e async for e in await b.client().responses.retrieve(ids[-1], stream=True)]
        assert newest[-1].type == "response.completed"
        with pytest.raises(openai.BadRequestError):  # its events are gone; the response is not
            await b.client().responses.retrieve(ids[0], stream=True)
        assert (await b.client().responses.retrieve(ids[0])).output_text == "echo#1: turn 0"
        server = aioredis.from_url(valkey_server.url)
        try:
            _, ended, sizes, total, _ = background_keys("ocx:")
            kept = int(await server.get(total))
            assert kept == sum(int(v) for v in (await server.hgetall(sizes)).values())
            assert 0 < kept <= 6000 and await server.zcard(ended) < 4
        finally:
            await server.aclose()


async def test_a_renewal_before_the_first_write_is_in_leaves_the_run_alone(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend(delay=0.2) as backend:  # (still running at the renewal)
        (a,) = await replicas(make_proxy, backend, valkey_server.url, 1)
        book = a.proxy.backgrounds
        assert isinstance(book, SharedBackgrounds)
        server, write = book.server, book.server.write
        slowed: list[str] = []

        async def slow_first_write(op: str, command: Any) -> Any:
            if op == "background_write" and not slowed:  # the create's: its response's first
                slowed.append(op)
                await asyncio.sleep(RENEW_EVERY * 1.5)  # a renewal runs meanwhile
            return await write(op, command)

        monkeypatch.setattr(server, "write", slow_first_write)
        created = await a.client().responses.create(model="m", input="hello", background=True)
        assert slowed
        done = await until_ended(a.client(), created.id)
        assert done.status == "completed" and done.output_text == "echo#1: hello"


async def test_a_turn_stored_before_its_replica_died_ends_as_stored(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        a, b = await replicas(make_proxy, backend, valkey_server.url, 2)
        book = a.proxy.backgrounds
        assert isinstance(book, SharedBackgrounds)
        server, write = book.server, book.server.write
        held = asyncio.Event()

        async def never_the_end(op: str, command: Any) -> Any:
            if op == "background_write" and "completed" in command():
                held.set()
                await asyncio.Event().wait()  # the replica dies before its last write
            return await write(op, command)

        monkeypatch.setattr(server, "write", never_the_end)
        stream = await a.client().responses.create(
            model="m", input="stored", background=True, stream=True
        )
        response_id = (await anext(aiter(stream))).response.id
        await stream.close()
        await asyncio.wait_for(held.wait(), 5)  # the turn is stored by then
        await book.abandon()
        ended = await until_ended(b.client(), response_id, within=LEASE + 5)
        assert ended.status == "completed" and ended.output_text == "echo#1: stored"
        events = [e async for e in await b.client().responses.retrieve(response_id, stream=True)]
        assert numbers(events) == list(range(len(events)))
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "echo#1: stored"
        assert b.metric("ocxproxy_background_lost_total") == 0


async def test_input_items_on_any_replica_while_it_runs_and_once_it_failed_or_was_cancelled(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        first = await a.client().responses.create(model="m", input="first")

        async def texts(proxy: ProxyHandle, response_id: str) -> list[str]:
            items = await proxy.client().responses.input_items.list(response_id, order="asc")
            return [item.content[0].text for item in items.data]  # type: ignore[union-attr]

        expected = ["first", "echo#1: first", "second"]
        backend.stall_next(60)
        running = await a.client().responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 2)
        for proxy in (a, b, c):
            assert await texts(proxy, running.id) == expected
        assert (await c.client().responses.cancel(running.id)).status == "cancelled"
        for proxy in (a, b, c):
            assert await texts(proxy, running.id) == expected
        backend.fail_next(500)
        failed = await b.client().responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        assert (await until_ended(c.client(), failed.id)).status == "failed"
        for proxy in (a, b, c):
            assert await texts(proxy, failed.id) == expected
        # Once the store holds the turn, it is the store's: no copy stays with the status.
        done = await a.client().responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        assert (await until_ended(b.client(), done.id)).status == "completed"
        assert await texts(c, done.id) == expected
        server = aioredis.from_url(valkey_server.url)
        try:
            keys = [key async for key in server.scan_iter(match="ocx:*")]
            kept = [key for key in keys if await server.type(key) == b"hash"]
            inputs = [await server.hget(key, "own") for key in kept]
            assert sum(value is not None for value in inputs) == 2  # the cancelled, the failed
            # Each holds its own item and the id of the response it continues.
            parents = [await server.hget(key, "parent") for key in kept]
            owns = [orjson.loads(value) for value in inputs if value is not None]
            assert owns == [[{"role": "user", "content": "second"}]] * 2
            assert sorted(p for p in parents if p is not None) == [first.id.encode()] * 2
            # A hash an earlier version wrote (the whole input, no parent) still reads.
            (key,) = [key for key in kept if failed.id.encode() in key]
            old = orjson.dumps([{"role": "user", "content": t} for t in ("way", "back", "then")])
            await server.hset(key, "input", old)
            await server.hdel(key, "own", "parent")
            for proxy in (a, b, c):
                assert await texts(proxy, failed.id) == ["way", "back", "then"]
        finally:
            await server.aclose()
        # The response continued deleted before the turn is stored: every replica lists
        # the whole input (the DELETE had it kept whole first), once cancelled too.
        backend.stall_next(60)
        backend.stall_next(60)
        running = await a.client().responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        unindexed = await a.client().responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 6)
        server = aioredis.from_url(valkey_server.url)
        try:  # (one a DELETE cannot find: as if its entry had expired)
            (entry,) = [k async for k in server.scan_iter(match=b"*p" + first.id.encode())]
            assert await server.srem(entry, unindexed.id) == 1
        finally:
            await server.aclose()
        await b.client().responses.delete(first.id)
        for _ in ("running", "cancelled"):
            for proxy in (a, b, c):
                assert await texts(proxy, running.id) == expected
            assert (await c.client().responses.cancel(running.id)).status == "cancelled"
        # Where only the deleted response's id is kept, the replica running it lists the
        # whole input (it holds that response); the others answer 404, never a list
        # without the chain.
        assert await texts(a, unindexed.id) == expected
        for proxy in (b, c):
            with pytest.raises(openai.NotFoundError) as caught:
                await texts(proxy, unindexed.id)
            assert first.id in caught.value.message
        assert (await c.client().responses.cancel(unindexed.id)).status == "cancelled"


async def test_each_replica_counts_the_runs_it_owns_so_their_sum_is_the_fleets(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        ids = []
        for owner in (a, a, b):
            backend.stall_next(60)
            created = await owner.client().responses.create(model="m", input="x", background=True)
            ids.append(created.id)
        await backend.wait_for(lambda: len(backend.responses_seen) == 3)
        for response_id in ids:  # polled, and followed, on the one that runs none of them
            polled = await c.client().responses.retrieve(response_id)
            assert polled.status in ("queued", "in_progress")  # (queued until its first event)
        assert [unfinished(proxy) for proxy in (a, b, c)] == [2, 1, 0]
        for response_id in ids:
            assert (await c.client().responses.cancel(response_id)).status == "cancelled"
        async with asyncio.timeout(2 * RENEW_EVERY):  # (the owners hear of it on the channel)
            while True:
                if [unfinished(proxy) for proxy in (a, b, c)] == [0, 0, 0]:
                    break
                await asyncio.sleep(0.02)


async def _hold_writes(
    monkeypatch: pytest.MonkeyPatch, proxy: ProxyHandle, status: str
) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold `proxy`'s background write that sets `status` until `release` is set;
    `held` is set when it is held."""
    book = proxy.proxy.backgrounds
    assert isinstance(book, SharedBackgrounds)
    server, write = book.server, book.server.write
    held, release = asyncio.Event(), asyncio.Event()

    async def holding(op: str, command: Any) -> Any:
        if op == "background_write" and status in command() and not held.is_set():
            held.set()
            await release.wait()
        return await write(op, command)

    monkeypatch.setattr(server, "write", holding)
    return held, release


async def test_a_cancel_that_beats_the_owners_end_to_the_server_wins_everywhere(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        held, release = await _hold_writes(monkeypatch, a, "completed")
        stream = await a.client().responses.create(
            model="m", input="race", background=True, stream=True
        )
        first = await anext(aiter(stream))
        response_id = first.response.id
        following = spawn(_rest(stream), name="owner's follower")
        await asyncio.wait_for(held.wait(), 5)  # a finished the turn (stored it) first
        cancelled = await c.client().responses.cancel(response_id)  # ... the server: c
        assert cancelled.status == "cancelled"
        release.set()
        events = [first, *await asyncio.wait_for(following, 5)]
        assert numbers(events) == list(range(len(events)))
        ends = ("response.completed", "response.cancelled", "response.failed")
        assert [e.type for e in events if e.type in ends] == ["response.cancelled"]
        for proxy in (a, b, c):
            assert (await proxy.client().responses.retrieve(response_id)).status == "cancelled"
            replay = [e async for e in await proxy.client().responses.retrieve(
                response_id, stream=True)]  # fmt: skip
            assert replay[-1].type == "response.cancelled"
        items = await b.client().responses.input_items.list(response_id)
        assert [item.content[0].text for item in items.data] == ["race"]  # type: ignore[union-attr]
        async with asyncio.timeout(5):  # the turn a stored goes: nothing is kept of it
            while True:
                try:
                    await b.client().responses.create(
                        model="m", input="more", previous_response_id=response_id
                    )
                except openai.BadRequestError:
                    break
                await asyncio.sleep(0.05)


async def test_an_end_that_beats_a_cancel_to_the_server_is_what_the_cancel_answers(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        backend.stall_next(1.0)
        stream = await a.client().responses.create(
            model="m", input="race", background=True, stream=True
        )
        first = await anext(aiter(stream))
        response_id = first.response.id
        following = spawn(_rest(stream), name="owner's follower")
        held, release = await _hold_writes(monkeypatch, c, "cancelled")
        cancelling = spawn(c.client().responses.cancel(response_id), name="cancel")
        await asyncio.wait_for(held.wait(), 5)  # c cancelled it, but the server ...
        done = await until_ended(b.client(), response_id)  # ... took a's end first
        assert done.status == "completed"
        release.set()
        answered = await asyncio.wait_for(cancelling, 5)
        assert answered.status == "completed" and answered.output_text == "echo#1: race"
        events = [first, *await asyncio.wait_for(following, 5)]
        assert events[-1].type == "response.completed"
        for proxy in (a, b, c):
            assert (await proxy.client().responses.retrieve(response_id)).status == "completed"
        more = await b.client().responses.create(
            model="m", input="more", previous_response_id=response_id
        )
        assert more.output_text == "echo#3: more"


async def test_a_cancel_racing_the_end_has_one_outcome_everywhere(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend(delay=0.01) as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        lengths = []  # a turn's length here (the first one's includes warming up)
        for _ in range(3):
            started = time.perf_counter()
            stream = await a.client().responses.create(
                model="m", input="timed", background=True, stream=True
            )
            await _rest(stream)
            lengths.append(time.perf_counter() - started)
        length = min(lengths)
        outcomes = set()
        counted: Counter[str] = Counter()
        for n in range(40):  # (until the race went both ways, and a dozen times)
            if n >= 12 and len(outcomes) == 2:
                break
            stream = await a.client().responses.create(
                model="m", input=f"race {n}", background=True, stream=True
            )
            first = await anext(aiter(stream))
            response_id = first.response.id
            following = spawn(_rest(stream), name="owner's follower")
            await asyncio.sleep(length * (n % 12) / 8)  # (from its start to past its end)
            answered = (await c.client().responses.cancel(response_id)).status
            events = [first, *await asyncio.wait_for(following, 10)]
            status = events[-1].type.removeprefix("response.")
            assert status in ("completed", "cancelled") and answered == status, n
            for proxy in (a, b, c):
                assert (await proxy.client().responses.retrieve(response_id)).status == status
            outcomes.add(status)
            counted[status] += 1
        assert outcomes == {"completed", "cancelled"}  # (the race went both ways)
        counted["completed"] += len(lengths)  # (the timed ones)
        finished = "ocxproxy_background_finished_total"
        for status, count in counted.items():  # each end counted once, as it ended
            assert sum(p.metric(finished, status=status) for p in (a, b, c)) == count, status


async def _follow(
    proxy: ProxyHandle,
    response_id: str,
    after: int | None = None,
    reading: asyncio.Event | None = None,
) -> tuple[list[Any], openai.APIError | None]:
    """A stream's events, and the `error` event that ended it (the SDK raises it);
    `reading` is set at the first event."""
    resumed = await proxy.client().responses.retrieve(
        response_id, stream=True, **({} if after is None else {"starting_after": after})
    )
    events: list[Any] = []
    try:
        async for event in resumed:
            events.append(event)
            if reading is not None:
                reading.set()
    except openai.APIError as error:
        return events, error
    return events, None


async def _rest(stream: Any) -> list[Any]:
    return [event async for event in stream]


async def _run_followed(
    backend: FakeBackend, a: ProxyHandle, b: ProxyHandle, text: str
) -> tuple[Any, asyncio.Task[list[Any]], asyncio.Task[tuple[list[Any], openai.APIError | None]]]:
    """A streamed background response created on `a`, running at the backend: its first
    event, the rest of that stream, and a stream of it followed on `b` (both tasks; the
    one on `b` has had its first event)."""
    stream = await a.client().responses.create(model="m", input=text, background=True, stream=True)
    first = await anext(aiter(stream))
    owners = spawn(_rest(stream), name="owner's follower")
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    reading = asyncio.Event()
    elsewhere = spawn(_follow(b, first.response.id, reading=reading), name="a follower on b")
    await asyncio.wait_for(reading.wait(), 5)
    return first, owners, elsewhere


async def _poll_while_down(proxy: ProxyHandle, response_id: str) -> None:
    """A poll while the server is down: 503, OpenAI-shaped, `storage_unavailable`."""
    with pytest.raises(openai.InternalServerError) as caught:
        await proxy.client().responses.retrieve(response_id)
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "storage_unavailable"  # type: ignore[index]


@pytest.mark.parametrize("down", [1.0, OUTAGE + 3 * RENEW_EVERY])
async def test_a_server_restart_mid_run_ends_it_completed_or_failed_never_running(
    make_proxy: MakeProxy, valkey_server: KvServer, down: float
) -> None:
    async with FakeBackend(delay=0.15) as backend:  # (a turn of a second or two)
        a, b = await replicas(make_proxy, backend, valkey_server.url, 2)
        first, following, elsewhere = await _run_followed(backend, a, b, "through a restart")
        response_id = first.response.id
        valkey_server.kill9()
        await _poll_while_down(b, response_id)
        # The replica running it answers what it knows: running (an end only once taken).
        assert (await a.client().responses.retrieve(response_id)).status == "in_progress"
        await asyncio.sleep(down)
        await valkey_server.astart()  # same data dir, same port
        ended = await until_ended(b.client(), response_id, within=LEASE + 15)
        assert ended.status in ("completed", "failed"), ended.status
        if ended.status == "failed":
            assert ended.error is not None and ended.error.code in (
                "server_error", "storage_unavailable"
            )  # fmt: skip
        else:
            assert ended.output_text == "echo#1: through a restart"
        events = [first, *await asyncio.wait_for(following, LEASE + 15)]
        assert numbers(events) == list(range(len(events)))
        assert events[-1].type == "response." + ended.status
        # A stream followed on another replica goes on through a short outage; cut by
        # a long one with an `error` event, it resumes after its last event.
        followed, error = await asyncio.wait_for(elsewhere, LEASE + 15)
        if error is not None:
            assert down > OUTAGE and error.code == "storage_unavailable", (down, error)
            more, error = await _follow(b, response_id, followed[-1].sequence_number)
            assert error is None
            followed += more
        assert [e.model_dump() for e in followed] == [e.model_dump() for e in events]
        for proxy in (a, b):
            assert (await proxy.client().responses.retrieve(response_id)).status == ended.status
            replay = [e async for e in await proxy.client().responses.retrieve(
                response_id, stream=True)]  # fmt: skip
            assert replay[-1].type == "response." + ended.status
            assert numbers(replay) == list(range(len(replay)))


async def test_the_input_of_one_continuing_a_store_false_turn_stays_off_the_server(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    secret = "store-false-" + uuid.uuid4().hex
    async with FakeBackend() as backend:
        a, b = await replicas(make_proxy, backend, valkey_server.url, 2, retain_unstored=True)
        first = await a.client().responses.create(model="m", input=secret, store=False)
        backend.stall_next(60)
        running = await a.client().responses.create(
            model="m", input="public", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 2)
        items = await a.client().responses.input_items.list(running.id, order="asc")
        texts = [item.content[0].text for item in items.data]  # type: ignore[union-attr]
        assert texts == [secret, f"echo#1: {secret}", "public"]  # (the replica running it)
        with pytest.raises(openai.NotFoundError):  # elsewhere: not on the server to read
            await b.client().responses.input_items.list(running.id)
        assert (await b.client().responses.cancel(running.id)).status == "cancelled"
        assert secret.encode() not in expanded(valkey_server.aof_bytes())


async def test_a_server_back_without_its_data_ends_the_run_and_forgets_it(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend(delay=0.15) as backend:
        a, b = await replicas(make_proxy, backend, valkey_server.url, 2)
        stream = await a.client().responses.create(
            model="m", input="lost with the data", background=True, stream=True
        )
        first = await anext(aiter(stream))
        response_id = first.response.id
        following = spawn(_rest(stream), name="owner's follower")
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        valkey_server.kill9()
        shutil.rmtree(valkey_server.data_dir / "appendonlydir")
        await valkey_server.astart()  # same port, nothing kept
        events = [first, *await asyncio.wait_for(following, LEASE + 15)]
        assert numbers(events) == list(range(len(events)))
        assert events[-1].type == "response.failed"
        assert events[-1].response.error.message.startswith("background_lost")
        for proxy in (a, b):
            with pytest.raises(openai.NotFoundError):
                await proxy.client().responses.retrieve(response_id)


async def test_an_idempotent_retry_of_one_a_cancel_won_gets_it_cancelled_on_any_replica(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        headers = {"Idempotency-Key": "bg-race-" + uuid.uuid4().hex}
        held, release = await _hold_writes(monkeypatch, a, "completed")
        created = await a.client().responses.create(
            model="m", input="race", background=True, extra_headers=headers
        )
        await asyncio.wait_for(held.wait(), 5)  # a stored the turn, completed its key
        assert (await c.client().responses.cancel(created.id)).status == "cancelled"
        release.set()
        for proxy in (a, b, c):
            assert (await proxy.client().responses.retrieve(created.id)).status == "cancelled"
            again = await proxy.client().responses.create(
                model="m", input="race", background=True, extra_headers=headers
            )
            assert again.id == created.id and again.status == "cancelled"
        assert len(backend.responses_seen) == 1


async def test_a_cancel_that_beats_the_owners_end_takes_the_turn_out_of_its_conversation(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        a, b, c = await replicas(make_proxy, backend, valkey_server.url)
        conversation = await a.client().conversations.create(
            items=[{"role": "user", "content": "hi"}]
        )
        held, release = await _hold_writes(monkeypatch, a, "completed")
        created = await a.client().responses.create(
            model="m", input="race", conversation=conversation.id, background=True
        )
        await asyncio.wait_for(held.wait(), 5)  # a appended the turn, stored it
        assert (await c.client().responses.cancel(created.id)).status == "cancelled"
        release.set()
        async with asyncio.timeout(5):  # (the owner takes it back once it learns)
            while True:
                items = [
                    i async for i in b.client().conversations.items.list(
                        conversation.id, order="asc")
                ]  # fmt: skip
                texts = [item.content[0].text for item in items]  # type: ignore[union-attr]
                if texts == ["hi"]:
                    break
                await asyncio.sleep(0.05)
        after = await b.client().responses.create(
            model="m", input="next", conversation=conversation.id
        )
        assert after.output_text == "echo#2: next"


async def test_replicas_whose_server_is_gone_shut_down_promptly(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    grace = 0.5  # --shutdown-timeout: what the running turn is given to finish
    async with FakeBackend() as backend:
        proxies = await replicas(make_proxy, backend, valkey_server.url, shutdown_timeout=grace)
        backend.stall_next(60)
        await proxies[0].client().responses.create(model="m", input="hang", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        valkey_server.stop()
        # The lease and probe loops go round without a pause, so a close lands at every
        # point of their round trips against the dead server, the moment one fails too.
        monkeypatch.setattr(shared_background, "RENEW_EVERY", 0.0)
        monkeypatch.setattr(shared_server, "PROBE_EVERY", 0.0)
        await asyncio.sleep(0.2)
        for proxy in proxies:
            async with asyncio.timeout(grace + 4):  # (the turn's grace, then a cut)
                await proxy.server.close()


async def test_a_response_the_server_lost_mid_run_is_failed_counted_and_404(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    async with FakeBackend() as backend:
        a, b = await replicas(make_proxy, backend, valkey_server.url, 2)
        backend.stall_next(60)
        first, owners, elsewhere = await _run_followed(backend, a, b, "lost")
        response_id = first.response.id
        # The server forgets it mid-run (a restart without its data, a key gone): its
        # hash and its log, behind the replicas' back.
        server = aioredis.from_url(valkey_server.url)
        try:
            gone = await server.keys(f"*{response_id}*")
            assert len(gone) == 2
            await server.delete(*gone)
        finally:
            await server.aclose()
        # The replica running it fails it, closes its backend request, and counts it.
        events = [first, *await asyncio.wait_for(owners, LEASE)]
        assert events[-1].type == "response.failed"
        assert events[-1].response.error.message.startswith("background_lost")
        await backend.wait_for(lambda: backend.cancelled == 1)
        assert a.metric("ocxproxy_background_lost_total") == 1
        assert b.metric("ocxproxy_background_lost_total") == 0  # (counted once)
        # A stream followed elsewhere ends with an `error` event, not silently.
        followed, error = await asyncio.wait_for(elsewhere, LEASE)
        assert 0 < len(followed) < len(events)
        assert [e.model_dump() for e in followed] == [e.model_dump() for e in events][
            : len(followed)
        ]
        assert error is not None and error.code == "server_error"
        assert error.message.startswith("background_lost")
        for proxy in (a, b):  # gone: a poll is a 404, OpenAI-shaped
            with pytest.raises(openai.NotFoundError) as caught:
                await proxy.client().responses.retrieve(response_id)
            assert caught.value.body["code"] == "not_found"  # type: ignore[index]


async def test_one_whose_open_and_stored_end_go_in_one_write_leaves_the_set_alone(
    make_proxy: MakeProxy, valkey_server: KvServer
) -> None:
    """The set of the background responses continuing a response lives for --ttl: one
    whose first write also carries its stored end (written together after a retry)
    needs no place in it, and does not cut the set's life to an event log's."""
    async with FakeBackend() as backend:
        (a,) = await replicas(make_proxy, backend, valkey_server.url, 1)
        book = a.proxy.backgrounds
        assert isinstance(book, SharedBackgrounds)
        queued = orjson.dumps({"id": "x", "status": "queued", "background": True})
        kept = Job("resp_kept", "scope", "queued", queued, False, inputs=b'"own"', parent="resp_p")
        book.open(kept)
        await book.commit()
        done = Job("resp_done", "scope", "queued", queued, False, inputs=b'"own"', parent="resp_p")
        book.open(done)
        book.moved(done, "completed", orjson.dumps({"id": "resp_done", "status": "completed"}))
        await book.commit()
        server = aioredis.from_url(valkey_server.url)
        try:
            (entry,) = [k async for k in server.scan_iter(match=b"*presp_p")]
            assert await server.smembers(entry) == {b"resp_kept"}
            assert await server.pttl(entry) > LOG_KEPT * 1000 * 2
        finally:
            await server.aclose()
        for job in (kept, done):
            book.drop(job)
        await book.commit()


async def test_a_create_the_server_refused_is_undone_not_run(
    make_proxy: MakeProxy, valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background create into a conversation whose first write the server refuses: 503,
    which the SDK retries (twice by default), and each attempt is undone: never sent to
    the backend, no turn in the conversation, nothing of it on the server once it takes
    writes again."""
    async with FakeBackend() as backend:
        (a,) = await replicas(make_proxy, backend, valkey_server.url, 1)
        client = a.client()
        conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
        for _ in range(3):  # (an attempt that ran would take its time, then end)
            backend.stall_next(0.3)
        book = a.proxy.backgrounds
        assert isinstance(book, SharedBackgrounds)
        write, refusing = book.server.write, True

        async def refused(op: str, command: Any) -> Any:
            if op == "background_write" and refusing:
                raise StoreFailure(FailureReason.WRITE_FAILED, "refused")
            return await write(op, command)

        monkeypatch.setattr(book.server, "write", refused)
        async with openai.AsyncOpenAI(base_url=a.base_url, api_key="sk-test-a") as retrying:
            with pytest.raises(openai.InternalServerError) as info:
                await retrying.responses.create(
                    model="m", input="lost", conversation=conversation.id, background=True
                )
        assert info.value.status_code == 503
        refusing = False
        created = await client.responses.create(
            model="m", input="kept", conversation=conversation.id, background=True
        )
        assert (await until_ended(client, created.id)).status == "completed"
        await asyncio.sleep(1.0)  # (a refused attempt's run would have ended; its write retried)
        assert len(backend.responses_seen) == 1  # (the kept one's)
        items = [i async for i in client.conversations.items.list(conversation.id)]
        assert len(items) == 3  # hi, kept and its answer
        assert unfinished(a) == 0
        server = aioredis.from_url(valkey_server.url)
        try:
            keys = [key async for key in server.scan_iter(match="ocx:*")]
        finally:
            await server.aclose()
        named = {m.group() for key in keys for m in re.finditer(rb"resp_[0-9a-f]{48}", key)}
        assert named == {created.id.encode()}
