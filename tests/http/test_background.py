"""Background mode (CONTRACT.md C11) through the `openai` SDK against a real proxy and the
fake backend: create answers at once, polls see queued/in_progress → completed, streams
resume after any event, cancel stops the backend request, store:false is refused."""

from __future__ import annotations

import asyncio
import errno
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from ocxproxy.errors import FailureReason, StorageUnavailable, StoreFailure
from ocxproxy.store.local import background as local_background
from ocxproxy.store.local.syncer import FsyncChild
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend

pytestmark = pytest.mark.asyncio


async def until_ended(client: openai.AsyncOpenAI, response_id: str, within: float = 10.0) -> Any:
    async with asyncio.timeout(within):
        while True:
            response = await client.responses.retrieve(response_id)
            if response.status not in ("queued", "in_progress"):
                return response
            await asyncio.sleep(0.05)


async def test_create_answers_at_once_and_a_poll_sees_it_finish(
    make_proxy: MakeProxy,
) -> None:
    async with FakeBackend(delay=0.4) as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        created = await client.responses.create(model="m", input="hello", background=True)
        assert created.status in ("queued", "in_progress")  # answered before the ~4 s turn ended
        assert created.background is True
        assert created.id.startswith("resp_")
        polled = await client.responses.retrieve(created.id)
        assert polled.status in ("queued", "in_progress")
        done = await until_ended(client, created.id)
        assert done.status == "completed"
        assert done.id == created.id and done.background is True
        assert done.output_text == "echo#1: hello"
        # The backend got a plain streamed request.
        (seen,) = backend.responses_seen
        assert "background" not in seen.json and seen.json["stream"] is True
        # Then it is a stored response like any other: continued, listed, deleted.
        follow_up = await client.responses.create(
            model="m", input="again", previous_response_id=created.id
        )
        assert follow_up.output_text == "echo#3: again"
        items = await client.responses.input_items.list(created.id)
        assert [item.type for item in items.data] == ["message"]
        assert proxy.metric("ocxproxy_background_finished_total", status="completed") == 1


async def test_store_false_is_refused_naming_background(proxy: ProxyHandle) -> None:
    client = proxy.client()
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="m", input="x", background=True, store=False)
    assert caught.value.body["param"] == "background"  # type: ignore[index]


def unfinished(proxy: ProxyHandle) -> float:
    """The background responses gauge: queued and running ones."""
    gauge = "ocxproxy_background_responses"
    return proxy.metric(gauge, status="queued") + proxy.metric(gauge, status="in_progress")


async def test_cancel_stops_the_backend_and_keeps_nothing(make_proxy: MakeProxy) -> None:
    async with FakeBackend(delay=0.5) as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        created = await client.responses.create(model="m", input="long", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        assert unfinished(proxy) == 1
        started = time.perf_counter()
        cancelled = await client.responses.cancel(created.id)
        assert time.perf_counter() - started < 1.0
        assert cancelled.status == "cancelled" and cancelled.id == created.id
        assert unfinished(proxy) == 0
        await backend.wait_for(lambda: backend.cancelled == 1, within=2.0)
        again = await client.responses.cancel(created.id)
        assert again.model_dump() == cancelled.model_dump()
        assert (await client.responses.retrieve(created.id)).status == "cancelled"
        with pytest.raises(openai.BadRequestError):  # nothing to continue from
            await client.responses.create(model="m", input="more", previous_response_id=created.id)
        assert proxy.metric("ocxproxy_background_cancels_total") == 1


async def test_cancelling_a_finished_one_returns_it_as_it_is(proxy: ProxyHandle) -> None:
    client = proxy.client()
    created = await client.responses.create(model="m", input="quick", background=True)
    done = await until_ended(client, created.id)
    assert done.status == "completed"
    assert (await client.responses.cancel(created.id)).status == "completed"
    foreground = await client.responses.create(model="m", input="fg")
    with pytest.raises(openai.BadRequestError):
        await client.responses.cancel(foreground.id)


def sequence(events: list[Any]) -> list[int]:
    return [event.sequence_number for event in events]


async def test_a_stream_resumes_after_any_event_gap_free(make_proxy: MakeProxy) -> None:
    async with FakeBackend(delay=0.05) as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        stream = await client.responses.create(
            model="m", input="stream me", background=True, stream=True
        )
        first: list[Any] = []
        async for event in stream:
            first.append(event)
            if len(first) == 3:
                break
        await stream.close()
        assert sequence(first) == [0, 1, 2]
        assert first[0].type == "response.created" and first[0].response.status == "queued"
        assert first[1].type == "response.in_progress"
        response_id = first[0].response.id
        rest = [
            event
            async for event in await client.responses.retrieve(
                response_id, stream=True, starting_after=2
            )
        ]
        assert sequence(rest) == list(range(3, 3 + len(rest)))
        assert rest[-1].type == "response.completed"
        assert rest[-1].response.id == response_id
        assert rest[-1].response.output_text == "echo#1: stream me"
        # The whole log again, now the turn is over: the same events.
        replay = [
            event async for event in await client.responses.retrieve(response_id, stream=True)
        ]
        assert [e.model_dump() for e in replay] == [e.model_dump() for e in first + rest]
        # The SDK's helper replays from 0 and filters by itself.
        async with client.responses.stream(response_id=response_id, starting_after=5) as helper:
            tail = [event async for event in helper]
            final = await helper.get_final_response()
        assert sequence(tail) == sequence(replay)[6:]
        assert final.output_text == "echo#1: stream me"
        assert proxy.metric("ocxproxy_background_resumes_total") == 3


async def test_streaming_a_response_not_made_to_be_streamed_is_a_400(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    client = proxy.client()
    plain = await client.responses.create(model="m", input="x")
    polled = await client.responses.create(model="m", input="y", background=True)
    for response_id in (plain.id, polled.id):
        async with http.get(
            f"{proxy.base_url}/responses/{response_id}?stream=true",
            headers={"Authorization": "Bearer sk-test-a"},
        ) as answer:
            assert answer.status == 400
            assert (await answer.json())["error"]["param"] == "stream"
    async with http.get(
        f"{proxy.base_url}/responses/resp_unknown?stream=true",
        headers={"Authorization": "Bearer sk-test-a"},
    ) as answer:
        assert answer.status == 404


async def test_a_backend_error_fails_the_response(proxy: ProxyHandle, backend: FakeBackend) -> None:
    backend.fail_next(500)
    client = proxy.client()
    created = await client.responses.create(model="m", input="x", background=True)
    done = await until_ended(client, created.id)
    assert done.status == "failed"
    assert done.error is not None and done.error.message


async def test_another_key_does_not_see_it(proxy: ProxyHandle) -> None:
    created = await proxy.client().responses.create(model="m", input="x", background=True)
    other = proxy.client(api_key="sk-test-b")
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.cancel(created.id)


async def test_beyond_max_background_they_wait_queued(make_proxy: MakeProxy) -> None:
    async with FakeBackend(delay=0.1) as backend:
        proxy = await make_proxy(backend.url, max_background=1, background_queue=1)
        client = proxy.client()
        first = await client.responses.create(model="m", input="1", background=True)
        second = await client.responses.create(model="m", input="2", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        assert (await client.responses.retrieve(second.id)).status == "queued"
        with pytest.raises(openai.RateLimitError):
            await client.responses.create(model="m", input="3", background=True)
        assert proxy.metric("ocxproxy_background_refused_total") == 1
        assert (await client.responses.cancel(second.id)).status == "cancelled"  # queued
        third = await client.responses.create(model="m", input="3", background=True)
        assert (await until_ended(client, first.id)).status == "completed"
        assert (await until_ended(client, third.id)).status == "completed"
        assert len(backend.responses_seen) == 2  # the cancelled one never ran, the third did


async def test_the_create_body_reaches_the_backend_without_background(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    body = {"model": "m", "input": "x", "background": True, "metadata": {"k": "v"}}
    async with http.post(
        f"{proxy.base_url}/responses",
        data=orjson.dumps(body),
        headers={"Authorization": "Bearer sk-test-a", "Content-Type": "application/json"},
    ) as answer:
        created = await answer.json()
    assert created["background"] is True and created["metadata"] == {"k": "v"}
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    forwarded = backend.responses_seen[0].json
    assert forwarded == {"model": "m", "input": "x", "metadata": {"k": "v"}, "stream": True}


async def test_event_logs_beyond_the_budget_go_oldest_first(make_proxy: MakeProxy) -> None:
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, background_log_bytes=6000)
        client = proxy.client()
        ids = []
        for n in range(4):
            stream = await client.responses.create(
                model="m", input=f"turn {n}", background=True, stream=True
            )
            events = [event async for event in stream]
            assert events[-1].type == "response.completed"
            ids.append(events[0].response.id)
        kept = proxy.metric("ocxproxy_background_log_bytes")
        assert 0 < kept <= 6000
        newest = [e async for e in await client.responses.retrieve(ids[-1], stream=True)]
        assert newest[-1].type == "response.completed"
        with pytest.raises(openai.BadRequestError):  # its events are gone; the response is not
            await client.responses.retrieve(ids[0], stream=True)
        assert (await client.responses.retrieve(ids[0])).output_text == "echo#1: turn 0"


async def test_a_background_turn_on_a_conversation_is_appended(proxy: ProxyHandle) -> None:
    client = proxy.client()
    conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
    created = await client.responses.create(
        model="m", input="bg", conversation=conversation.id, background=True
    )
    done = await until_ended(client, created.id)
    assert done.output_text == "echo#2: bg"
    assert done.conversation is not None and done.conversation.id == conversation.id
    items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
    assert len(items) == 3


async def test_an_idempotent_retry_gets_the_same_background_response(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    headers = {"Idempotency-Key": "bg-1"}
    created = await client.responses.create(
        model="m", input="once", background=True, extra_headers=headers
    )
    await until_ended(client, created.id)
    again = await client.responses.create(
        model="m", input="once", background=True, extra_headers=headers
    )
    assert again.id == created.id and again.status == "completed"
    assert len(backend.responses_seen) == 1


async def test_a_cancelled_stream_ends_with_response_cancelled(make_proxy: MakeProxy) -> None:
    async with FakeBackend(delay=0.3) as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        stream = await client.responses.create(
            model="m", input="long", background=True, stream=True
        )
        events: list[Any] = []
        async with asyncio.timeout(10):
            async for event in stream:
                events.append(event)
                if len(events) == 3:  # under way: cancelled from elsewhere
                    cancelled = await proxy.client().responses.cancel(events[0].response.id)
        assert cancelled.status == "cancelled"
        assert sequence(events) == list(range(len(events)))
        last = events[-1].model_dump()  # (the SDK's types do not name this event)
        assert last["type"] == "response.cancelled"
        assert last["response"]["status"] == "cancelled"
        assert last["response"]["id"] == events[0].response.id
        # A resume after the end gets the same terminal event.
        (again,) = [
            e
            async for e in await client.responses.retrieve(
                last["response"]["id"], stream=True, starting_after=last["sequence_number"] - 1
            )
        ]
        assert again.model_dump() == last


async def test_deleting_a_running_one_cancels_it_and_forgets_it(make_proxy: MakeProxy) -> None:
    async with FakeBackend(delay=0.5) as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        created = await client.responses.create(model="m", input="long", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        deleted = await client.responses.delete(created.id)
        assert deleted is None  # (the SDK returns nothing for a 200)
        await backend.wait_for(lambda: backend.cancelled == 1, within=2.0)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel(created.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(created.id)
        # A cancelled one, kept as one, is deleted too.
        other = await client.responses.create(model="m", input="long", background=True)
        assert (await client.responses.cancel(other.id)).status == "cancelled"
        await client.responses.delete(other.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(other.id)


async def test_input_items_of_a_running_one_are_those_it_will_keep(
    make_proxy: MakeProxy,
) -> None:
    async with FakeBackend(delay=0.3) as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        first = await client.responses.create(model="m", input="first")
        created = await client.responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 2)
        assert (await client.responses.retrieve(created.id)).status == "in_progress"
        running = await client.responses.input_items.list(created.id, order="asc")
        assert [item.type for item in running.data] == ["message", "message", "message"]
        assert running.data[-1].content[0].text == "second"  # type: ignore[union-attr]
        assert (await until_ended(client, created.id)).status == "completed"
        stored = await client.responses.input_items.list(created.id, order="asc")
        assert stored.model_dump() == running.model_dump()


async def test_input_items_of_a_failed_or_cancelled_one_are_its_input(
    make_proxy: MakeProxy,
) -> None:
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        first = await client.responses.create(model="m", input="first")
        backend.fail_next(500)
        failed = await client.responses.create(
            model="m", input="fails", previous_response_id=first.id, background=True
        )
        assert (await until_ended(client, failed.id)).status == "failed"
        backend.stall_next(60)
        cancelled = await client.responses.create(
            model="m", input="cut", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 3)
        assert (await client.responses.cancel(cancelled.id)).status == "cancelled"
        for response_id, text in ((failed.id, "fails"), (cancelled.id, "cut")):
            items = await client.responses.input_items.list(response_id, order="asc")
            texts = [item.content[0].text for item in items.data]  # type: ignore[union-attr]
            assert texts == ["first", "echo#1: first", text]
            assert items.first_id == items.data[0].id and items.has_more is False


async def test_the_input_of_one_continuing_a_store_false_turn_is_never_journaled(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    secret = "store-false-" + uuid.uuid4().hex
    state = tmp_path / "retaining"
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, state_dir=state, retain_unstored=True)
        client = proxy.client()
        first = await client.responses.create(model="m", input=secret, store=False)
        backend.stall_next(60)
        created = await client.responses.create(
            model="m", input="public", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 2)
        assert (await client.responses.cancel(created.id)).status == "cancelled"
        items = await client.responses.input_items.list(created.id, order="asc")
        texts = [item.content[0].text for item in items.data]  # type: ignore[union-attr]
        assert texts == [secret, f"echo#1: {secret}", "public"]  # (in memory)
        journaled = (state / "background.jsonl").read_bytes()
        assert created.id.encode() in journaled and secret.encode() not in journaled


async def _hold_the_turns_commit(
    monkeypatch: pytest.MonkeyPatch, proxy: ProxyHandle, backend: FakeBackend
) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the first store commit after the backend got the turn (the turn finished:
    stored, appended, its Idempotency-Key completed, not yet ended) until `release`;
    `held` is set when it is held."""
    store = proxy.proxy.store
    commit = store.commit
    held, release = asyncio.Event(), asyncio.Event()

    async def holding(*args: Any, **kwargs: Any) -> Any:
        if backend.responses_seen and not held.is_set():
            held.set()
            await release.wait()
        return await commit(*args, **kwargs)

    monkeypatch.setattr(store, "commit", holding)
    return held, release


async def _cancel_once_held(
    client: openai.AsyncOpenAI, response_id: str, held: asyncio.Event, release: asyncio.Event
) -> None:
    """Once the turn's commit is held (the turn stored, appended, its key completed), a
    cancel, which so wins against the turn's end; then the commit goes on."""
    await asyncio.wait_for(held.wait(), 5)
    assert (await client.responses.cancel(response_id)).status == "cancelled"
    release.set()


async def test_a_cancel_that_beats_the_turns_end_is_what_an_idempotent_retry_gets(
    make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        headers = {"Idempotency-Key": "bg-race"}
        held, release = await _hold_the_turns_commit(monkeypatch, proxy, backend)
        created = await client.responses.create(
            model="m", input="race", background=True, extra_headers=headers
        )
        await _cancel_once_held(client, created.id, held, release)
        assert (await client.responses.retrieve(created.id)).status == "cancelled"
        again = await client.responses.create(
            model="m", input="race", background=True, extra_headers=headers
        )
        assert again.id == created.id and again.status == "cancelled"
        assert len(backend.responses_seen) == 1


async def test_a_cancel_that_beats_the_turns_end_takes_it_out_of_its_conversation(
    make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
        held, release = await _hold_the_turns_commit(monkeypatch, proxy, backend)
        created = await client.responses.create(
            model="m", input="race", conversation=conversation.id, background=True
        )
        await _cancel_once_held(client, created.id, held, release)
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        assert [item.content[0].text for item in items] == ["hi"]  # type: ignore[union-attr]
        after = await client.responses.create(model="m", input="next", conversation=conversation.id)
        assert after.output_text == "echo#2: next"  # (the backend saw "hi", then "next")


async def test_a_turn_that_cannot_be_taken_out_of_its_conversation_is_counted(
    make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
        held, release = await _hold_the_turns_commit(monkeypatch, proxy, backend)

        async def failing(*args: Any, **kwargs: Any) -> Any:
            raise StorageUnavailable("the store is failing")

        monkeypatch.setattr(proxy.proxy.store.conversations, "delete_item", failing)
        created = await client.responses.create(
            model="m", input="race", conversation=conversation.id, background=True
        )
        await _cancel_once_held(client, created.id, held, release)
        metric = "ocxproxy_background_take_back_failures_total"
        for _ in range(100):
            if proxy.metric(metric) == 1:
                break
            await asyncio.sleep(0.05)
        assert proxy.metric(metric) == 1
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        assert len(items) == 3  # ("hi", and the turn's input and answer: they stay)
        assert (await client.responses.retrieve(created.id)).status == "cancelled"


async def test_a_streamed_idempotent_retry_of_one_a_cancel_won_ends_with_response_cancelled(
    make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        headers = {"Idempotency-Key": "bg-race-stream"}
        held, release = await _hold_the_turns_commit(monkeypatch, proxy, backend)
        stream = await client.responses.create(
            model="m", input="race", background=True, stream=True, extra_headers=headers
        )
        first = await anext(aiter(stream))
        await _cancel_once_held(client, first.response.id, held, release)
        assert [e.type async for e in stream][-1] == "response.cancelled"
        again = await client.responses.create(
            model="m", input="race", background=True, stream=True, extra_headers=headers
        )
        events = [e async for e in again]
        assert events[-1].type == "response.cancelled"
        ended = events[-1].model_dump()["response"]
        assert ended["id"] == first.response.id and ended["status"] == "cancelled"


async def test_a_create_on_a_long_chain_journals_its_own_input_and_its_parents_id(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    """The chain before a background create is the store's: the create's status line holds
    its own items and the id it continues, whatever the chain's length, and input_items
    still lists the whole input while it runs and once it is cancelled."""
    state = tmp_path / "state"
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, state_dir=state)
        client = proxy.client()
        previous, sent = None, []
        for turn in range(6):
            text = f"turn {turn} " + "x" * 20_000
            done = await client.responses.create(
                model="m", input=text, previous_response_id=previous
            )
            previous, sent = done.id, [*sent, text, done.output_text]
        journal = state / "background.jsonl"
        before = journal.stat().st_size if journal.exists() else 0
        backend.stall_next(60)
        created = await client.responses.create(
            model="m", input="own", previous_response_id=previous, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 7)
        journaled = journal.read_bytes()[before:]
        assert len(journaled) < 2_000, len(journaled)  # the chain holds ~240 KB
        (line,) = [orjson.loads(line) for line in journaled.splitlines()]
        assert line["parent"] == previous
        assert [item["content"] for item in line["own"]] == ["own"]
        for _ in ("running", "cancelled"):
            items = await client.responses.input_items.list(created.id, order="asc", limit=100)
            texts = [item.content[0].text for item in items.data]  # type: ignore[union-attr]
            assert texts == [*sent, "own"]
            assert (await client.responses.cancel(created.id)).status == "cancelled"


async def test_input_items_after_the_parent_is_deleted_are_still_whole(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    """Deleting the response a background one continues, before its turn is stored, keeps
    that one's whole input with it: input_items lists it while it runs, once cancelled,
    and after a restart."""
    state = tmp_path / "state"
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, state_dir=state)
        client = proxy.client()
        first = await client.responses.create(model="m", input="first")
        backend.stall_next(60)
        created = await client.responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 2)
        journal = state / "background.jsonl"
        assert b"echo#1: first" not in journal.read_bytes()  # (its parent's id only)
        await client.responses.delete(first.id)
        assert b"echo#1: first" in journal.read_bytes()
        expected = ["first", "echo#1: first", "second"]
        for _ in ("running", "cancelled"):
            items = await client.responses.input_items.list(created.id, order="asc")
            assert [item.content[0].text for item in items.data] == expected  # type: ignore[union-attr]
            assert (await client.responses.cancel(created.id)).status == "cancelled"
        await proxy.server.close()  # graceful: everything durable is flushed
        again = await make_proxy(backend.url, state_dir=state)
        client = again.client()
        assert (await client.responses.retrieve(created.id)).status == "cancelled"
        items = await client.responses.input_items.list(created.id, order="asc")
        assert [item.content[0].text for item in items.data] == expected  # type: ignore[union-attr]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)


async def test_a_run_whose_end_the_disk_refuses_ends_without_an_error_no_one_awaits(
    make_proxy: MakeProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end of a run cannot be journaled (the disk is full): the run still ends, its
    failure logged, rather than with an OSError that no one awaits."""
    backend = FakeBackend()
    await backend.start()
    proxy = await make_proxy(backend.url, state_dir=tmp_path / "state")
    backend.stall_next(60)
    created = await proxy.client().responses.create(model="m", input="x", background=True)
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    book = proxy.proxy.backgrounds
    (job,) = [job for job in book.jobs.values() if job.id == created.id]  # type: ignore[attr-defined]
    task = job.task
    assert task is not None

    async def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(book, "commit", full)
    await backend.close()  # the backend goes: the run fails, and its end is not written
    await asyncio.wait([task], timeout=10)
    assert task.done() and job.status == "failed"
    assert task.exception() is None


async def test_once_it_ended_the_process_that_ran_it_no_longer_holds_its_parent(
    make_proxy: MakeProxy,
) -> None:
    """A cancelled one's chain is read from the store like any other's: once the response
    it continued is evicted, input_items is a 404 naming it on the process that ran it too
    (which no longer pins that response's chain in memory for --ttl)."""
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, max_entries=2)
        client = proxy.client()
        first = await client.responses.create(model="m", input="first")
        backend.stall_next(60)
        created = await client.responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 2)
        items = await client.responses.input_items.list(created.id, order="asc")
        assert [item.content[0].text for item in items.data] == [  # type: ignore[union-attr]
            "first", "echo#1: first", "second"
        ]  # fmt: skip
        assert (await client.responses.cancel(created.id)).status == "cancelled"
        for n in range(3):  # the entry cap pushes the first response out
            await client.responses.create(model="m", input=f"other {n}")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.input_items.list(created.id)
        assert first.id in caught.value.message


def _no_space(*args: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_full_disk_answers_creates_and_cancels_with_a_503_and_recovers(
    make_proxy: MakeProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """background.jsonl cannot be written (the disk is full): a create and a cancel are
    answered 503 storage_unavailable and counted, not acknowledged; once the disk has room
    the proxy works again, and a cancel it acknowledges then is on disk (kept after a
    restart) although the line of the one that failed was lost."""
    monkeypatch.setattr(FsyncChild, "spawn", classmethod(lambda cls: None))  # (in process)
    state = tmp_path / "state"
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, state_dir=state)
        client = proxy.client()
        backend.stall_next(60)
        running = await client.responses.create(model="m", input="long", background=True)
        with monkeypatch.context() as full:
            full.setattr(local_background, "_pwrite", _no_space)
            full.setattr(local_background, "_rewrite", _no_space)
            for attempt in (
                client.responses.create(model="m", input="x", background=True),
                client.responses.cancel(running.id),
            ):
                with pytest.raises(openai.InternalServerError) as info:
                    await attempt
                assert info.value.status_code == 503
                error = info.value.body
                assert isinstance(error, dict) and error["code"] == "storage_unavailable"
                assert error["type"] == "server_error" and error["message"]
            assert proxy.metric("ocxproxy_store_write_failures_total", reason="ENOSPC") >= 2
        assert (await client.responses.cancel(running.id)).status == "cancelled"
        created = await client.responses.create(model="m", input="after", background=True)
        assert (await until_ended(client, created.id)).status == "completed"
        await proxy.server.close()
        again = await make_proxy(backend.url, state_dir=state)
        assert (await again.client().responses.retrieve(running.id)).status == "cancelled"


async def test_a_create_refused_for_a_full_disk_is_undone_not_run(
    make_proxy: MakeProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background create into a conversation while background.jsonl cannot be written:
    503, which the SDK retries (twice by default), and each attempt is undone: never sent
    to the backend, no turn in the conversation, nothing left to run or kept on disk once
    the disk has room again, and nothing to replay for its Idempotency-Key."""
    monkeypatch.setattr(FsyncChild, "spawn", classmethod(lambda cls: None))  # (in process)
    state = tmp_path / "state"
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, state_dir=state)
        client = proxy.client()
        conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
        for _ in range(3):  # (an attempt that ran would take its time, then end)
            backend.stall_next(0.3)
        key = {"Idempotency-Key": "bg-" + uuid.uuid4().hex}
        retrying = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test-a")
        async with retrying:
            with monkeypatch.context() as full:
                full.setattr(local_background, "_pwrite", _no_space)
                full.setattr(local_background, "_rewrite", _no_space)
                with pytest.raises(openai.InternalServerError) as info:
                    await retrying.responses.create(
                        model="m", input="lost", conversation=conversation.id, background=True,
                        extra_headers=key,
                    )  # fmt: skip
                assert info.value.status_code == 503
            assert proxy.metric("ocxproxy_store_write_failures_total", reason="ENOSPC") >= 3
            # The disk has room again: a create commits (and rewrites the file) ...
            created = await client.responses.create(
                model="m", input="kept", conversation=conversation.id, background=True
            )
            assert (await until_ended(client, created.id)).status == "completed"
            await asyncio.sleep(1.0)  # (... and a refused attempt's run would have ended)
            assert len(backend.responses_seen) == 1  # (that one's)
            items = [i async for i in client.conversations.items.list(conversation.id)]
            assert len(items) == 3  # hi, kept and its answer
            assert unfinished(proxy) == 0
            assert proxy.metric("ocxproxy_background_finished_total", status="completed") == 1
            # The same key again: a new create, not the refused one replayed.
            again = await retrying.responses.create(
                model="m", input="lost", conversation=conversation.id, background=True,
                extra_headers=key,
            )  # fmt: skip
            assert again.id != created.id and again.status in ("queued", "in_progress")
            assert (await until_ended(client, again.id)).status == "completed"
            assert len(backend.responses_seen) == 2
        await proxy.server.close()
    (journal,) = state.rglob(local_background.FILE)
    kept = {orjson.loads(line)["id"] for line in journal.read_bytes().splitlines()}
    assert kept <= {created.id, again.id}


async def test_a_parent_that_cannot_be_read_is_a_503_not_gone(
    make_proxy: MakeProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain of the response a background one continues cannot be read (an I/O
    error): input_items is a 503 storage_unavailable, not a 404 saying it is gone, and a
    DELETE of that response fails rather than lose the background one's input for good."""
    async with FakeBackend() as backend:
        proxy = await make_proxy(backend.url, state_dir=tmp_path / "state")
        client = proxy.client()
        first = await client.responses.create(model="m", input="first")
        backend.stall_next(60)
        created = await client.responses.create(
            model="m", input="second", previous_response_id=first.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 2)

        async def unreadable(record: Any) -> list[bytes]:
            raise StoreFailure(FailureReason.READ_FAILED, "EIO")

        with monkeypatch.context() as failing:
            failing.setattr(proxy.proxy.store, "history", unreadable)
            for attempt in (
                client.responses.input_items.list(created.id),
                client.responses.delete(first.id),
            ):
                with pytest.raises(openai.InternalServerError) as info:
                    await attempt
                assert info.value.status_code == 503
                error = info.value.body
                assert isinstance(error, dict) and error["code"] == "storage_unavailable"
        assert (await client.responses.retrieve(first.id)).id == first.id  # not deleted
        await client.responses.delete(first.id)
        items = await client.responses.input_items.list(created.id, order="asc")
        assert [item.content[0].text for item in items.data] == [  # type: ignore[union-attr]
            "first", "echo#1: first", "second"
        ]  # fmt: skip
