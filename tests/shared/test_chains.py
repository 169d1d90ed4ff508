"""BEGIN sends a chain's newest digests only (shared_layout.WINDOW); a replica takes the
older ones from the chains it read or wrote before (store/shared.py's Chains), else asks
the server once (LRANGE). What it builds is the whole history, from any replica."""

from __future__ import annotations

import orjson
import pytest
import redis.asyncio as aioredis

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store import shared_layout as layout
from ocxproxy.store.shared import SharedStore
from tests.shared.servers import KvServer
from tests.shared.test_store import MakeStore, chain_of, make_store, turn

__all__ = ["make_store"]  # the fixture, shared with test_store.py

LONG = layout.WINDOW + 4


def asked(store: SharedStore) -> int:
    """How many times the store fetched a chain's older digests."""
    return int(sum(store.metrics.shared_seconds.labels("chain").counts))


async def history_of(store: SharedStore, rid: str) -> list[str]:
    record = await store.begin("scope-a", rid)
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
    parent = await a.begin("scope-a", ids[-1])
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
    await chain_of(a, await a.begin("scope-a", fork_at), ["f1", "f2"])
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
    record = await a.begin("scope-a", ids[-1])
    client = aioredis.Redis.from_url(kv_server.url)
    try:
        assert await client.delete(record.chain) == 1  # as the byte budget would
    finally:
        await client.aclose()
    with pytest.raises(StoreFailure) as caught:
        await a.begin("scope-a", ids[-1])
    assert caught.value.reason == FailureReason.EVICTED
    with pytest.raises(StoreFailure) as caught:
        await a.commit(a.put(turn("r-late", "late"), record))
    assert caught.value.reason == FailureReason.MISSING
