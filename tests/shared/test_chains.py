"""BEGIN sends a chain's newest digests only (shared_layout.WINDOW); a replica takes the
older ones from the chains it read or wrote before (store/shared/chains.py), else asks
the server once (LRANGE). What it builds is the whole history, from any replica."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store.resident import ResidentTier
from ocxproxy.store.shared import layout
from ocxproxy.store.shared.chains import Newest
from ocxproxy.store.shared.store import SharedStore
from tests.shared.servers import KvServer
from tests.shared.test_store import MakeStore, chain_of, make_store, turn

__all__ = ["make_store"]  # the fixture, shared with test_store.py

LONG = layout.WINDOW + 4


def asked(store: SharedStore) -> int:
    """How many times the store fetched a chain's older digests."""
    return int(sum(store.metrics.shared_seconds.labels("chain").counts))


async def history_of(store: SharedStore, rid: str) -> list[str]:
    record = await store.lookup("scope-a", rid)
    items = orjson.loads(b"[" + b",".join(await store.history(record)) + b"]")
    return [item["content"] for item in items if item.get("role") == "user"]


def said(ids: list[str]) -> list[str]:
    return [f"user says {rid}" for rid in ids]


async def test_a_replica_asks_for_older_digests_once_per_chain(make_store: MakeStore) -> None:
    a, b, c = await make_store(), await make_store(), await make_store()
    ids = [f"r{n}" for n in range(1, LONG + 1)]
    await chain_of(a, None, ids)
    assert asked(a) == 0
    assert await history_of(b, ids[-1]) == said(ids)  # b never saw it: one LRANGE
    assert asked(b) == 1
    parent = await a.lookup("scope-a", ids[-1])
    await chain_of(a, parent, ["r-next"])
    assert await history_of(b, "r-next") == said([*ids, "r-next"])  # held: BEGIN's window
    assert await history_of(b, ids[3]) == said(ids[:4])  # a prefix of one it holds
    assert asked(b) == 1
    assert await history_of(c, ids[layout.WINDOW - 1]) == said(ids[: layout.WINDOW])
    assert asked(c) == 0  # short enough for the window alone


async def test_a_fork_off_a_long_chain_replays_its_own_history(make_store: MakeStore) -> None:
    a, b = await make_store(), await make_store()
    ids = [f"r{n}" for n in range(1, LONG + 1)]
    await chain_of(a, None, ids)
    assert await history_of(b, ids[-1]) == said(ids)
    fork_at = ids[layout.WINDOW + 1]  # a sibling of what follows it: a new chain
    await chain_of(a, await a.lookup("scope-a", fork_at), ["f1", "f2"])
    cut = ids.index(fork_at) + 1
    assert await history_of(b, "f2") == said([*ids[:cut], "f1", "f2"])
    assert await history_of(b, ids[-1]) == said(ids)


@pytest.mark.parametrize("length", [3, LONG])
async def test_a_chain_gone_from_the_server_is_evicted_though_held_here(
    make_store: MakeStore, kv_server: KvServer, length: int
) -> None:
    a = await make_store()
    ids = [f"r{n}" for n in range(1, length + 1)]
    await chain_of(a, None, ids)
    record = await a.lookup("scope-a", ids[-1])
    client = aioredis.Redis.from_url(kv_server.url)
    try:
        assert await client.delete(record.chain) == 1  # as the byte budget would
    finally:
        await client.aclose()
    with pytest.raises(StoreFailure) as caught:
        await a.lookup("scope-a", ids[-1])
    assert caught.value.reason == FailureReason.EVICTED
    # A turn in flight on it meanwhile is kept (as on one node), on no chain: its
    # Response is retrieved whole (GET) and its continuations answer evicted, on any
    # replica; its bytes are counted.
    before = a.shared_bytes
    late = turn("r-late", "late")
    await a.commit(a.put(late, record))
    assert a.shared_bytes > before
    for store in (a, await make_store()):
        with pytest.raises(StoreFailure) as caught:
            await store.lookup("scope-a", "r-late")
        assert caught.value.reason == FailureReason.EVICTED
        kept = await store.retrieve("scope-a", "r-late")
        assert await store.response_bytes(kept) == late.response
        with pytest.raises(StoreFailure) as caught:
            await store.history(kept)
        assert caught.value.reason == FailureReason.EVICTED


def begins(store: SharedStore) -> list[int]:
    """How many segment values each BEGIN of `store` sent along, from now on."""
    sent: list[int] = []
    script = store.server.script

    async def spied(name: str, keys: Any, args: Any) -> Any:
        reply = await script(name, keys, args)
        if name == "begin" and reply is not None:
            sent.append(len(reply[2]))
        return reply

    store.server.script = spied  # type: ignore[method-assign]
    return sent


async def test_begin_sends_no_values_of_segments_the_replica_holds(make_store: MakeStore) -> None:
    a, b = await make_store(), await make_store()
    ids = ["r1", "r2", "r3"]
    await chain_of(a, None, ids)
    sent_a, sent_b = begins(a), begins(b)
    assert await history_of(a, "r3") == said(ids)  # a wrote it: its segments are here
    assert await history_of(b, "r3") == said(ids)  # b never saw it: the newest two sent
    assert await history_of(b, "r3") == said(ids)  # now b holds them too
    assert (sent_a, sent_b) == ([0], [layout.TAIL, 0])
    for segment in list(a.cache):  # gone from a's cache: sent along again, not trusted
        a.cache.remove(segment)
    assert await history_of(a, "r3") == said(ids)
    assert await history_of(a, "r2") == said(ids[:2])  # r2's newest: held since r3's read
    assert sent_a == [0, layout.TAIL, 0]


async def test_a_record_held_here_and_deleted_elsewhere_is_gone_here(make_store: MakeStore) -> None:
    a, b = await make_store(), await make_store()
    await chain_of(a, None, ["r1", "r2"])
    sent = begins(a)
    assert await history_of(a, "r2") == said(["r1", "r2"])
    assert sent == [0]  # held here: BEGIN still reads the record
    assert await b.delete("scope-a", "r2")
    with pytest.raises(StoreFailure) as caught:
        await a.lookup("scope-a", "r2")
    assert caught.value.reason == FailureReason.UNKNOWN


def test_newest_lets_its_oldest_go_a_batch_at_a_time() -> None:
    """Past its limit by its slack (a 64th), the oldest go down to the limit at once: one
    delete a put made each put walk the dict's emptied slots (~20 µs at 32,768)."""
    newest, cache = Newest(limit=128), ResidentTier(1 << 20)  # a slack of 2
    for n in range(130):
        newest.put(f"r{n}", ())
    assert newest.held("r0", cache)  # within the slack (no digests: all of them held)
    newest.put("r130", ())
    assert [newest.held(f"r{n}", cache) for n in (0, 1, 2, 3, 130)] == [False] * 3 + [True] * 2
