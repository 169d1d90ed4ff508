"""The disk cap with long chains: eviction frees what it is asked to (whole chains, the
least recently extended first), the chain in use survives while it fits, the store does
not checkpoint at every commit while over the cap, and when nothing it may evict can take
it back under the cap it says so once and refuses new turns with a typed failure."""

from __future__ import annotations

import asyncio
import logging
import random
import string
from pathlib import Path

import aiohttp
import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Record
from ocxproxy.store import Store
from ocxproxy.store.local import admin
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.serve import create
from tests.store.helpers import inline, make_store, make_turn, sample

CAP = 400_000  # --max-disk-bytes: live segments may take 60%, eviction takes them to 50%
TURN = 3000  # bytes of incompressible text a turn adds (~2.6 KB on disk with its record)


def text(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters, k=TURN))


def extend(store: Store, rng: random.Random, prefix: str, n: int, parent: Record | None) -> Record:
    for i in range(n):
        parent = store.put(make_turn(f"{prefix}{i}", text(rng)), parent)
    assert parent is not None
    return parent


async def in_flight_turn(store: Store, rng: random.Random, rid: str, parent_id: str) -> Record:
    """A turn as the HTTP layer makes it: its parent looked up, the backend's time (the
    maintainer runs meanwhile), then put on the record looked up, and committed."""
    parent = store.lookup_nowait("scope-a", parent_id)
    await asyncio.sleep(0.002)
    record = store.put(make_turn(rid, text(rng)), parent)
    await store.commit(record)
    return record


async def test_the_chain_in_use_survives_and_older_chains_go_whole(tmp_path: Path) -> None:
    """A long session started first (its root is the oldest record) and still in use,
    idle chains started after it: over the cap the idle ones go whole, the session is
    still continued with its whole history, and the store checkpoints a few times, not at
    every turn over the cap."""
    rng = random.Random(7)
    store = make_store(tmp_path, max_disk_bytes=CAP, max_resident_bytes=1, offload=inline)
    await store.start()
    head = extend(store, rng, "s", 20, None)  # the session: ~52 KB
    for k in range(3):
        extend(store, rng, f"idle{k}-", 15, None)  # ~39 KB each
    await store.commit()
    assert store.table.keydir.live_bytes < CAP * 0.5
    written = sample(store.metrics.snapshot_writes)
    for i in range(40):  # the session grows to ~156 KB: past the cap with the rest
        head = await in_flight_turn(store, rng, f"s{20 + i}", head.id)
    await asyncio.sleep(0.05)
    checkpoints = sample(store.metrics.snapshot_writes) - written
    assert sample(store.metrics.store_evictions, reason="disk_bytes") > 0
    # Every turn of the session is still there, each with its whole history.
    for i in (0, 19, 59):
        assert len(await store.history(store.lookup_nowait("scope-a", f"s{i}"))) == i + 1
    with pytest.raises(StoreFailure) as info:
        store.lookup_nowait("scope-a", "idle0-14")
    assert info.value.reason == FailureReason.EVICTED
    # Two for the journal's growth (one every eighth of the cap), one or two for the cap;
    # one per commit over the cap would be ~20.
    assert checkpoints <= 4, checkpoints
    await in_flight_turn(store, rng, "s60", "s59")  # and it goes on
    assert await store.flush()
    assert await store.flush()  # (the files of evicted segments go after the second)
    assert store.stats().disk_bytes <= CAP
    assert store.disk is not None and not store.disk.full
    assert store.check() == []
    await store.close()


async def test_the_chain_extended_last_stays_while_it_alone_is_under_the_cap(
    tmp_path: Path,
) -> None:
    """A session that alone takes more than eviction's target (50% of the cap) but less
    than what the store may keep (60%): over the cap, the other chains go and it stays
    whole, though it is the oldest."""
    rng = random.Random(11)
    store = make_store(tmp_path, max_disk_bytes=CAP, max_resident_bytes=1, offload=inline)
    await store.start()
    head = extend(store, rng, "s", 80, None)  # ~210 KB, its root the oldest record
    for k in range(2):
        extend(store, rng, f"idle{k}-", 15, None)  # ~39 KB each: the store is over the cap
    store.put(make_turn("s80", text(rng)), head)  # and the session is extended last
    await store.commit()
    for _ in range(200):  # (eviction goes in steps of the loop: both idle chains, 30)
        await asyncio.sleep(0.01)
        if sample(store.metrics.store_evictions, reason="disk_bytes") >= 30:
            break
    await asyncio.sleep(0.05)
    with pytest.raises(StoreFailure) as info:
        store.lookup_nowait("scope-a", "idle1-14")
    assert info.value.reason == FailureReason.EVICTED
    assert sample(store.metrics.store_evictions, reason="disk_bytes") == 30
    assert len(await store.history(store.lookup_nowait("scope-a", "s80"))) == 81
    assert store.check() == []
    await store.close()


async def test_a_chain_past_the_cap_alone_goes_whole_and_stays_gone(tmp_path: Path) -> None:
    """A session that alone outgrows the store's share of the cap is evicted whole, and a
    turn in flight on it then does not bring its chain back onto the disk: the store gets
    back under the cap, checkpoints a few times, and the next turn on it is told it was
    evicted."""
    rng = random.Random(8)
    store = make_store(tmp_path, max_disk_bytes=CAP, max_resident_bytes=1, offload=inline)
    await store.start()
    head = extend(store, rng, "s", 80, None)  # ~210 KB: under the 240 KB the store keeps
    await store.commit()
    assert sample(store.metrics.store_evictions, reason="disk_bytes") == 0
    written = sample(store.metrics.snapshot_writes)
    outcome: StoreFailure | None = None
    for i in range(30):
        try:
            head = await in_flight_turn(store, rng, f"s{80 + i}", head.id)
        except StoreFailure as failure:
            outcome = failure
            break
    assert outcome is not None and outcome.reason == FailureReason.EVICTED
    assert sample(store.metrics.store_evictions, reason="disk_bytes") >= 80
    assert sample(store.metrics.snapshot_writes) - written <= 3
    with pytest.raises(StoreFailure) as info:
        await store.history(head)  # the turn that was in flight: its chain is gone
    assert info.value.reason == FailureReason.EVICTED
    assert store.table.keydir.live_bytes < CAP * 0.6
    assert await store.flush()
    assert await store.flush()
    assert store.stats().disk_bytes <= CAP
    assert store.check() == []
    await store.close()


async def test_nothing_to_evict_is_said_once_and_new_turns_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Others' files (background responses') past what the cap leaves: evicting every
    response cannot help. The store says so once (a counter, one warning), is unavailable,
    refuses new turns with a typed failure (FULL: answered 507 store_full), retries
    rarely (no checkpoint per pass), and takes turns again once there is room."""
    rng = random.Random(9)
    store = make_store(tmp_path, max_disk_bytes=CAP, max_resident_bytes=1, offload=inline)
    await store.start()
    extend(store, rng, "a", 10, None)
    await store.commit()
    others = [CAP]
    store.count_on_disk(lambda: others[0])
    written = sample(store.metrics.snapshot_writes)
    assert store.disk is not None
    with caplog.at_level(logging.WARNING, logger="ocxproxy.store"):
        store.disk._wanted.set()  # (as a commit over the cap does)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if store.disk.full:
                break
        assert store.disk.full
        assert not store.available
        assert sample(store.metrics.store_disk_full) == 1
        # Refused, typed, and no checkpoint for each, nor at each maintenance pass
        # (MAINTAIN_EVERY) over the two seconds they take: the next waits CAP_GAP.
        for i in range(20):
            record = store.put(make_turn(f"b{i}", text(rng)), None)
            with pytest.raises(StoreFailure) as info:
                await store.commit(record)
            assert info.value.reason == FailureReason.FULL
            await asyncio.sleep(0.1)
        with pytest.raises(StoreFailure):
            store.lookup_nowait("scope-a", "b0")
        # Nor a conversation's write, even one forced past the caps (an answered turn's).
        with pytest.raises(StoreFailure) as info:
            store.kept.keep("conv_1", "scope-a", (), b"{}", created_at=0.0, force=True)
        assert info.value.reason == FailureReason.FULL
    full = [r for r in caplog.records if "store full" in r.getMessage()]
    assert len(full) == 1
    assert sample(store.metrics.snapshot_writes) - written <= 2
    assert sample(store.metrics.store_disk_full) == 1
    others[0] = 0  # the background files went
    for _ in range(100):
        await asyncio.sleep(0.01)
        if store.available:
            break
    assert store.available
    record = store.put(make_turn("c0", text(rng)), None)
    await store.commit(record)
    assert store.lookup_nowait("scope-a", "c0") is record
    assert store.check() == []
    await store.close()


async def test_a_turn_in_flight_on_an_evicted_chain_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    """The parent a turn was looked up on is evicted for the disk cap while the backend
    answers: the turn is kept, but its chain's bytes are not taken back onto the disk
    (eviction would free nothing); a continuation of it is told it was evicted, after a
    restart too (no segment counted missing: nothing was lost but what the cap took)."""
    rng = random.Random(10)
    store = make_store(tmp_path, max_disk_bytes=CAP, max_resident_bytes=1, offload=inline)
    await store.start()
    head = extend(store, rng, "s", 30, None)
    await store.commit()
    parent = store.lookup_nowait("scope-a", head.id)
    assert not await store.expiry.for_disk(0, 0)  # the cap evicts the whole chain
    assert store.table.keydir.live_bytes == 0
    record = store.put(make_turn("s30", text(rng)), parent)
    await store.commit(record)
    assert store.table.keydir.live_bytes < 3 * TURN  # its own turn only
    with pytest.raises(StoreFailure) as info:
        await store.history(store.lookup_nowait("scope-a", "s30"))
    assert info.value.reason == FailureReason.EVICTED
    with pytest.raises(StoreFailure) as info:
        store.lookup_nowait("scope-a", "s29")
    assert info.value.reason == FailureReason.EVICTED
    assert store.check() == []
    await store.close()
    report, problems = admin.verify(tmp_path)  # (`ocxproxy state verify`)
    assert problems == [] and report.evicted == ["s30"]
    store = make_store(tmp_path, max_disk_bytes=CAP, max_resident_bytes=1, offload=inline)
    await store.start()
    with pytest.raises(StoreFailure) as info:
        await store.history(store.lookup_nowait("scope-a", "s30"))
    assert info.value.reason == FailureReason.EVICTED
    assert sample(store.metrics.spill_failures, reason="missing") == 0
    assert store.check() == []
    await store.close()


async def test_a_turn_the_full_store_cannot_take_is_answered_507(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    """Over HTTP: while nothing can be evicted to get under --max-disk-bytes, a store:true
    turn is answered 507 store_full, as a conversation write is (never a 200 for a turn
    that is not kept, nor an answer blaming the disk), and turns are taken again once
    there is room. Meanwhile the proxy stays ready (/readyz 200, saying the store is
    full: a load balancer keeps sending the reads and DELETEs that make room), serves
    stored turns, DELETEs and store:false turns, and the store_available gauge is 0."""
    proxy = await make_proxy(backend.url, max_disk_bytes=CAP)
    body = {"model": "fake-model", "input": "hello"}
    store = proxy.proxy.store
    assert isinstance(store, Store) and store.disk is not None
    kept = []  # conversations: pinned, what is left when responses are all evicted
    for _ in range(2):
        item = {"type": "message", "role": "user", "content": "kept"}
        async with http.post(f"{proxy.url}/v1/conversations", json={"items": [item]}) as r:
            assert r.status == 200
            kept.append((await r.json())["id"])
    others = [CAP]
    store.count_on_disk(lambda: others[0])  # background files past the cap
    store.disk._wanted.set()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if store.disk.full:
            break
    assert proxy.metric("ocxproxy_store_disk_full_total") == 1
    for stream in (False, True):
        status, error, rid = await create(http, proxy.url, {**body, "stream": stream})
        assert rid is None, "a turn the store cannot keep must not be acknowledged"
        assert error is not None
        if stream:  # the stream's end: an error event in place of response.completed
            error = error["error"]
        else:
            assert status == 507
        assert error["code"] == "store_full" and "store is full" in error["message"], error
    assert proxy.metric("ocxproxy_store_disk_full_total") == 1
    async with http.get(proxy.url + "/readyz") as r:
        assert r.status == 200 and (await r.json())["store"] == "full"
    assert proxy.metric("ocxproxy_store_available") == 0
    async with http.get(f"{proxy.url}/v1/conversations/{kept[0]}/items") as r:
        assert r.status == 200 and (await r.json())["data"][0]["content"][0]["text"] == "kept"
    async with http.delete(f"{proxy.url}/v1/conversations/{kept[1]}") as r:
        assert r.status == 200
    status, error, rid = await create(http, proxy.url, {**body, "store": False})
    assert status == 200 and rid is not None, error
    others[0] = 0
    for _ in range(200):
        await asyncio.sleep(0.01)
        if store.available:
            break
    status, error, first = await create(http, proxy.url, body)
    assert status == 200 and first is not None, error
    status, error, rid = await create(http, proxy.url, {**body, "previous_response_id": first})
    assert status == 200 and rid is not None, error
    async with http.get(proxy.url + "/readyz") as r:
        assert r.status == 200 and (await r.json())["store"] == "available"


async def test_a_turn_kept_after_its_chain_was_evicted_is_retrieved_live_and_after_restarts(
    tmp_path: Path,
) -> None:
    """A turn in flight on a chain the disk cap evicts meanwhile is acknowledged: its
    Response is stored, so GET (`retrieve`, `response_bytes`) answers it byte for byte,
    live, after a crash (journal replay) and from a checkpoint, and a DELETE finds it;
    its history is gone (EVICTED) each time, and no segment is counted missing."""
    rng = random.Random(11)
    options = {"max_disk_bytes": CAP, "max_resident_bytes": 1, "offload": inline}
    store = make_store(tmp_path, **options)
    await store.start()
    head = extend(store, rng, "s", 30, None)
    await store.commit()
    parent = store.lookup_nowait("scope-a", head.id)
    assert not await store.expiry.for_disk(0, 0)  # the cap evicts the whole chain
    turn = make_turn("s30", text(rng), filled=True)
    await store.commit(store.put(turn, parent))

    async def answers(store: Store) -> None:
        record = await store.retrieve("scope-a", "s30")
        assert await store.response_bytes(record) == turn.response
        with pytest.raises(StoreFailure) as info:
            await store.history(await store.lookup("scope-a", "s30"))
        assert info.value.reason == FailureReason.EVICTED
        assert sample(store.metrics.spill_failures, reason="missing") == 0
        assert store.check() == []

    await answers(store)
    await store.abandon()  # a crash: the turn is in the journal only
    for checkpointed in (False, True):
        store = make_store(tmp_path, **options)
        await store.start()
        await answers(store)
        if not checkpointed:
            assert await store.flush()  # its row in a checkpoint from now on
            await store.abandon()
    assert await store.delete("scope-a", "s30")
    await store.commit()
    assert store.check() == []
    await store.close()
    store = make_store(tmp_path, **options)
    await store.start()
    with pytest.raises(StoreFailure) as info:
        await store.retrieve("scope-a", "s30")
    assert info.value.reason == FailureReason.UNKNOWN
    assert store.check() == []
    await store.close()
