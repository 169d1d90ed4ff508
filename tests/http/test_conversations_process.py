"""Conversations and Idempotency-Keys through a real `python -m ocxproxy serve` process
that is killed with -9 and restarted on the same state dir: an acknowledged conversation
turn and a completed key survive, and a lock held by the killed process is free at once
(on a single node the lock is process memory: a restarted process holds none)."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import openai

from ocxproxy.aio import spawn
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only
from tests.serve import Serve


async def started(backend: FakeBackend, state: Path, started: list[Serve]) -> Serve:
    proc = Serve(backend.url, state)
    started.append(proc)
    await proc.start()
    return proc


async def test_an_acknowledged_conversation_turn_survives_kill_9(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    first = await started(backend, state, processes)
    client = first.client()
    conv = await client.conversations.create(items=[{"role": "user", "content": "hello"}])
    turn = await client.responses.create(model="m", input="one", conversation=conv.id)
    keyed = await client.responses.create(
        model="m", input="two", conversation=conv.id, extra_headers={"Idempotency-Key": "k"}
    )
    assert keyed.output_text == "echo#4: two"
    await client.close()
    assert await first.stop(signal.SIGKILL) == -signal.SIGKILL

    second = await started(backend, state, processes)
    client = second.client()
    items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
    texts = [i.content[0].text for i in items]  # type: ignore[union-attr]
    assert texts == ["hello", "one", turn.output_text, "two", keyed.output_text]
    retried = await client.responses.create(
        model="m", input="two", conversation=conv.id, extra_headers={"Idempotency-Key": "k"}
    )
    assert retried.id == keyed.id and len(backend.responses_seen) == 2
    more = await client.responses.create(model="m", input="three", conversation=conv.id)
    assert more.output_text == "echo#6: three"
    assert_append_only([seen.body for seen in backend.responses_seen])
    await client.close()
    assert await second.stop(signal.SIGTERM) == 0


async def test_a_lock_held_by_a_killed_process_is_free_after_restart(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    first = await started(backend, state, processes)
    client = first.client()
    conv = await client.conversations.create()
    backend.stall_next(30)
    holder = spawn(
        client.responses.create(model="m", input="stuck", conversation=conv.id), name="holder"
    )
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    try:
        await client.responses.create(model="m", input="x", conversation=conv.id)
    except openai.BadRequestError as locked:
        assert locked.code == "conversation_locked"
    else:
        raise AssertionError("the conversation was not locked")
    assert await first.stop(signal.SIGKILL) == -signal.SIGKILL
    with contextlib.suppress(openai.APIConnectionError):
        await holder
    await client.close()

    second = await started(backend, state, processes)
    client = second.client()
    ok = await client.responses.create(model="m", input="free", conversation=conv.id)
    assert ok.output_text == "echo#1: free"
    await client.close()
    assert await second.stop(signal.SIGTERM) == 0
