"""The Store: tiers, the journal, disk cap, checkpoint, restart, crash, delete."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import Record, Segment
from ocxproxy.store import Store
from ocxproxy.store.local.durable import StateDirUnusable
from ocxproxy.store.output import split_output
from tests.store.helpers import (
    FILL,
    Clock,
    all_bytes_under,
    checkpoint_ids,
    durable_ids,
    inline,
    journal_files,
    make_store,
    make_turn,
    sample,
)


async def no_thread(fn: Any, /, *args: Any) -> Any:
    raise AssertionError(f"unexpected thread hop for {fn}")


def build_chain(store: Store, n: int, *, prefix: str = "r", durable: bool = True) -> list[Record]:
    records: list[Record] = []
    parent = None
    for i in range(n):
        parent = store.put(
            make_turn(f"{prefix}{i}", f"turn {i} of {prefix}", durable=durable), parent
        )
        records.append(parent)
    return records


def expected_items(prefix: str, n: int) -> list[Any]:
    items: list[Any] = []
    for i in range(n):
        items.append({"role": "user", "content": f"turn {i} of {prefix}"})
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"echo: turn {i} of {prefix}"}],
            }
        )
    return items


async def items_of(store: Store, record_id: str, scope: str = "scope-a") -> list[Any]:
    history = await store.history(store.lookup_nowait(scope, record_id))
    items: list[Any] = orjson.loads(b"[" + b",".join(history) + b"]")
    return items


async def test_all_resident_history_never_leaves_the_loop(tmp_path: Path) -> None:
    store = make_store(tmp_path, offload=no_thread)
    records = build_chain(store, 5)
    assert await items_of(store, "r4") == expected_items("r", 5)
    assert (await store.response_bytes(records[2]))[:9] == b'{"id":"r2'
    assert store.check() == []


async def test_past_the_byte_cap_segments_leave_memory_not_the_store(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_resident_bytes=600, offload=inline)
    await store.start()
    for record in build_chain(store, 30):
        await store.commit(record)
    stats = store.stats()
    assert stats.resident_bytes <= 600 and stats.pending_segments == 0
    assert stats.disk_segments == 30  # the item segments (responses: in their entries)
    assert sample(store.metrics.spill_writes) == 30
    assert sample(store.metrics.journal_commits) == 1  # queued together: one group commit
    assert sample(store.metrics.store_evictions, reason="resident_bytes") == 0
    assert len(journal_files(tmp_path)) == 1  # not a file per segment
    for i in range(30):  # every turn still resolves, reading back what it needs
        assert await items_of(store, f"r{i}") == expected_items("r", i + 1)
        assert store.stats().resident_bytes <= 600
    assert sample(store.metrics.spill_reads) > 0
    original = make_turn("r7", "turn 7 of r").response
    assert await store.response_bytes(store.lookup_nowait("scope-a", "r7")) == original
    assert store.check() == []
    await store.close()


@pytest.mark.parametrize("helper", [False, True], ids=["thread", "fsync-helper"])
async def test_store_false_content_is_dropped_never_spilled(tmp_path: Path, helper: bool) -> None:
    store = make_store(tmp_path, max_resident_bytes=400, offload=inline, fsync_child=helper)
    await store.start()
    build_chain(store, 20, prefix="private", durable=False)
    await store.flush()
    assert all(p.stat().st_size == 0 for p in journal_files(tmp_path).values())
    assert sample(store.metrics.store_evictions, reason="resident_bytes") > 0
    with pytest.raises(StoreFailure) as info:
        await store.history(store.lookup_nowait("scope-a", "private19"))
    assert info.value.reason == FailureReason.EVICTED
    assert checkpoint_ids(tmp_path) == []
    assert store.check() == []
    await store.close()


@pytest.mark.parametrize("helper", [False, True], ids=["thread", "fsync-helper"])
async def test_disk_cap_evicts_the_oldest_segments(tmp_path: Path, helper: bool) -> None:
    # The cap's 60% holds one chain of 10 turns whole with its checkpoint (~6.8 KB), not two.
    store = make_store(
        tmp_path, max_resident_bytes=300, max_disk_bytes=12_000, offload=inline,
        fsync_child=helper,
    )  # fmt: skip
    await store.start()
    build_chain(store, 10, prefix="old")
    await store.flush()
    build_chain(store, 10, prefix="new")
    await store.flush()
    await store.flush()  # the second checkpoint lets the files of evicted segments go
    assert store.stats().disk_bytes <= 12_000
    occupied = sum(p.stat().st_size for p in journal_files(tmp_path).values())
    occupied += (tmp_path / "checkpoint").stat().st_size
    assert occupied <= 12_000
    assert sample(store.metrics.store_evictions, reason="disk_bytes") > 0
    with pytest.raises(StoreFailure) as info:
        await store.history(store.lookup_nowait("scope-a", "old9"))
    assert info.value.reason == FailureReason.EVICTED
    assert await items_of(store, "new9") == expected_items("new", 10)
    assert store.check() == []
    await store.close()


async def test_restart_serves_every_chain_from_disk(tmp_path: Path) -> None:
    store = make_store(tmp_path, offload=inline)
    await store.start()
    build_chain(store, 6, prefix="a")
    build_chain(store, 3, prefix="b")
    await store.close()
    store = make_store(tmp_path, offload=inline)
    await store.start()
    assert len(store) == 9 and store.stats().resident_bytes == 0
    assert await items_of(store, "a5") == expected_items("a", 6)
    assert await items_of(store, "b2") == expected_items("b", 3)
    assert store.lookup_nowait("scope-a", "a5").has_call_id("nope") is False
    with pytest.raises(StoreFailure):
        store.lookup_nowait("scope-b", "a5")  # another credential
    parent = store.lookup_nowait("scope-a", "a5")
    store.put(make_turn("a6", "turn 6 of a"), parent)
    assert await items_of(store, "a6") == expected_items("a", 7)
    assert store.check() == []
    await store.close()


async def test_committed_turns_survive_a_crash_without_a_checkpoint(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_resident_bytes=300, offload=inline)
    await store.start()
    records = build_chain(store, 8)
    await store.commit(records[-1])
    assert not (tmp_path / "checkpoint").exists()
    await store.abandon()
    store = make_store(tmp_path, offload=inline)
    await store.start()
    assert len(store) == 8  # from the journal alone; the uncommitted turn is not there
    assert await items_of(store, "r7") == expected_items("r", 8)
    assert store.check() == []
    await store.close()


async def test_crash_after_a_checkpoint_replays_the_journal_after_it(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_resident_bytes=300, offload=inline)
    await store.start()
    records = build_chain(store, 5)
    await store.flush()
    store.delete_nowait("scope-a", "r4")
    store.delete_nowait("scope-a", "r3")
    x = store.put(make_turn("x", "later"), records[2])
    await store.commit(x)
    await store.abandon()  # the deletes and "x" are only in the journal
    assert sorted(checkpoint_ids(tmp_path)) == ["r0", "r1", "r2", "r3", "r4"]
    store = make_store(tmp_path, offload=inline)
    await store.start()
    assert sorted(r.id for r in store.records()) == ["r0", "r1", "r2", "x"]
    assert await items_of(store, "x") == [*expected_items("r", 3), *await items_of(store, "x")][-8:]
    assert store.check() == []
    await store.close()


async def test_delete_is_journaled_and_compaction_drops_its_bytes(tmp_path: Path) -> None:
    store = make_store(tmp_path, offload=inline)
    await store.start()
    build_chain(store, 3, prefix="keep")
    build_chain(store, 9, prefix="gone")
    await store.flush()
    for i in range(9):
        assert store.delete_nowait("scope-a", f"gone{i}")
    assert not store.delete_nowait("scope-a", "gone0")
    with pytest.raises(StoreFailure):
        store.lookup_nowait("scope-a", "gone8")
    await store.commit()
    assert durable_ids(tmp_path) == ["keep0", "keep1", "keep2"]
    await store.flush()
    assert checkpoint_ids(tmp_path) == ["keep0", "keep1", "keep2"]
    await store.flush()  # the sparse file is compacted, then removed
    everything = all_bytes_under(tmp_path)  # compressed segments opened
    assert b"turn 0 of keep" in everything and b"of gone" not in everything
    assert store.stats().disk_segments == 3  # the item segments (responses: in entries)
    assert store.check() == []
    await store.close()


async def test_ttl_and_max_entries(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock=clock, ttl=10, max_entries=3, offload=inline)
    await store.start()
    for record in build_chain(store, 5):
        await store.commit(record)
    assert sorted(r.id for r in store.records()) == ["r2", "r3", "r4"]
    with pytest.raises(StoreFailure) as info:
        store.lookup_nowait("scope-a", "r0")
    assert info.value.reason == FailureReason.EVICTED
    assert sample(store.metrics.store_evictions, reason="max_entries") == 2
    await store.close()
    clock.now += 11
    store = make_store(tmp_path, clock=clock, ttl=10, offload=inline)
    await store.start()
    assert len(store) == 0  # expired records are not loaded
    await store.flush()
    await store.close()
    assert sum(p.stat().st_size for p in journal_files(tmp_path).values()) == 0
    store2 = make_store(None, clock=clock, ttl=10)
    build_chain(store2, 2)
    clock.now += 11
    with pytest.raises(StoreFailure) as info:
        store2.lookup_nowait("scope-a", "r1")
    assert info.value.reason == FailureReason.EXPIRED
    assert await store2.sweep() == 1 and len(store2) == 0


async def test_records_evicted_at_start_up_stay_gone_and_their_files_outlive_it(
    tmp_path: Path,
) -> None:
    """A start with a lower --max-entries evicts the oldest records as it loads; a stop
    before any checkpoint then, and the next start finds every live record whole and
    every evicted one gone (even under a roomier cap), none missing a file."""
    store = make_store(tmp_path, offload=inline)
    await store.start()
    for batch in range(3):  # a checkpoint after the first two: files 1, 2 before it, 3 after
        for i in range(100):
            await store.commit(store.put(make_turn(f"b{batch}_{i}", f"turn {i} {batch}"), None))
        if batch < 2:
            assert await store.flush()
    await store.close()
    assert sorted(journal_files(tmp_path)) == [1, 2, 3]

    store = make_store(tmp_path, offload=inline, max_entries=200)
    await store.start()  # the oldest 100, all of file 1's, evicted
    assert len(store) == 200
    with pytest.raises(StoreFailure) as info:
        store.lookup_nowait("scope-a", "b0_0")
    assert info.value.reason == FailureReason.EVICTED
    await store.close()  # before any checkpoint (as a stop during start-up's own would)
    assert sorted(checkpoint_ids(tmp_path)) == sorted(
        f"b{b}_{i}" for b in (0, 1) for i in range(100)
    )

    for cap in (200, 10_000):
        store = make_store(tmp_path, offload=inline, max_entries=cap)
        await store.start()
        assert sample(store.metrics.spill_failures, reason="missing") == 0
        assert sorted(r.id for r in store.records()) == sorted(
            f"b{b}_{i}" for b in (1, 2) for i in range(100)
        )
        assert await items_of(store, "b1_0") == [
            {"role": "user", "content": "turn 0 1"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "echo: turn 0 1"}],
            },
        ]
        assert store.check() == []
        await store.close()


async def test_memory_only_store_writes_nothing(tmp_path: Path) -> None:
    store = make_store(None, max_resident_bytes=300)
    await store.start()
    build_chain(store, 10)
    assert await store.flush() is False
    await store.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(StoreFailure) as info:
        await store.history(store.lookup_nowait("scope-a", "r9"))
    assert info.value.reason == FailureReason.EVICTED


async def test_a_parent_deleted_mid_turn_still_chains(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_resident_bytes=300, offload=inline)
    await store.start()
    records = build_chain(store, 4)
    await store.flush()
    for i in range(4):
        store.delete_nowait("scope-a", f"r{i}")
    child = store.put(make_turn("r4", "turn 4 of r"), records[3])
    assert await items_of(store, "r4") == expected_items("r", 5)
    await store.flush()
    assert child.segments[0] is store.segments()[child.segments[0].key]
    assert store.check() == []
    await store.close()


async def test_records_from_another_store_are_copied_not_shared() -> None:
    shared = make_store(None)
    local = make_store(None)
    parent = build_chain(shared, 2)[-1]
    local.put(make_turn("l", "turn 2 of r", durable=False), parent)
    assert await items_of(local, "l") == expected_items("r", 3)
    assert shared.check() == [] and local.check() == []
    assert all(s.refs == 1 or s.refs == 2 for s in parent.segments)


async def test_a_reused_response_id_replaces_its_record_cleanly(tmp_path: Path) -> None:
    """A backend that reuses an id for identical bytes: the old record goes, the new one
    owns the very same segments, and the index stays whole through a delete."""
    store = make_store(tmp_path)
    first = store.put(make_turn("r0", "hello"), None)
    again = store.put(make_turn("r0", "hello"), None)
    assert store.lookup_nowait("scope-a", "r0") is again is not first
    assert store.check() == []
    assert await items_of(store, "r0") == [
        {"role": "user", "content": "hello"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "echo: hello"}],
        },
    ]
    assert store.delete_nowait("scope-a", "r0")
    assert store.check() == []


@pytest.mark.parametrize("demoted", [False, True], ids=["resident", "demoted"])
async def test_content_shared_with_a_deleted_stored_turn_leaves_the_disk(
    tmp_path: Path, demoted: bool
) -> None:
    """A store:false turn kept for chaining (--retain-unstored) whose new items are the
    same bytes as a store:true turn's share that turn's segment. Once the store:true turn
    is deleted, nothing durable holds it: compaction drops it, and it is never written
    again."""
    store = make_store(tmp_path, offload=inline, max_resident_bytes=1 << 20)
    await store.start()
    public = store.put(make_turn("public", "same words"), None)
    private = store.put(make_turn("private", "same words", durable=False), None)
    assert private.segments[0] is public.segments[0]
    await store.flush()
    segment = public.segments[0]
    assert segment.on_disk
    if demoted:  # memory pressure: the shared bytes now live only in the journal
        store.resident.max_bytes = 1
        store.put(make_turn("filler", "other words", durable=False), None)
        await store.flush()
        assert segment.data is None
    assert store.delete_nowait("scope-a", "public")
    await store.flush()
    await store.flush()  # compaction, then the second checkpoint lets the file go
    assert not segment.on_disk and store.stats().disk_segments == 0
    assert b"same words" not in b"".join(p.read_bytes() for p in journal_files(tmp_path).values())
    assert store.check() == []
    store.resident.max_bytes = 1 << 20
    store.put(make_turn("more", "more words", durable=False), private)
    await store.flush()
    assert store.stats().disk_segments == 0  # not written again for store:false holders
    if demoted:  # its bytes were only on disk: the store:false chain is gone, and says so
        with pytest.raises(StoreFailure):
            await store.history(store.lookup_nowait("scope-a", "private"))
    else:
        assert await items_of(store, "private") == [
            {"role": "user", "content": "same words"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "echo: same words"}],
            },
        ]
    await store.close()


def test_a_store_is_not_kept_alive_by_its_metrics() -> None:
    """WebSocket connections share one Metrics object; a closed connection's store, and
    the store:false bytes it holds, must go with it."""
    metrics = Metrics()
    store = make_store(None, metrics=metrics)
    store.put(make_turn("r0", "private"), None)
    gone = weakref.ref(store)
    assert sample(metrics.store_entries, tier="records") == 1
    del store
    gc.collect()
    assert gone() is None
    assert sample(metrics.store_entries, tier="records") == 0


def test_split_output_round_trips() -> None:
    turn = make_turn("r", "hello")
    skeleton, at = split_output(turn.response, turn.items)
    assert at is not None and len(skeleton) < len(turn.response)
    offset, length = at
    assert skeleton[:offset] + turn.items[-length:] + skeleton[offset:] == turn.response
    for response, items in [
        (b'{"output":[]}', b'"a"'),
        (b'{"id":"x"}', b'"a"'),
        (b'{"output":["b"]}', b'"a"'),
        (b'{"output":["a","a"]}', b'"a","a"'),
        (b'{"output":["a"],"x":1}', b'"a","a"'),
    ]:
        skeleton, at = split_output(response, items)
        if at is None:
            assert skeleton == response
        else:
            o, n = at
            assert skeleton[:o] + items[-n:] + skeleton[o:] == response


@pytest.mark.parametrize("fill", ["none", "after the output", "before the output"])
async def test_a_turn_that_knows_where_its_output_is_is_kept_as_one_that_does_not(
    fill: str,
) -> None:
    """build_turn finds a turn's output in its response's bytes (Turn.output_at): the store
    cuts it there instead of looking for it, and keeps what it keeps when it looks, with
    or without the members the envelope filled in (after the output, or after the brace
    where `spliced` puts them)."""
    turn = make_turn("r1", "hi", filled=fill == "after the output")
    if fill == "before the output":
        assert turn.output_at is not None
        start, length = turn.output_at
        encoded = b"".join((b"{", FILL, b",", turn.response[1:]))
        turn = replace(turn, response=encoded, fill=FILL, fill_at=1)
        turn = replace(turn, output_at=(start + len(FILL) + 1, length))
    kept = []
    for this in (turn, replace(turn, output_at=None)):
        store = make_store(None)
        record = store.put(this, None)
        assert await store.response_bytes(record) == turn.response
        assert isinstance(record.response, Segment) and store.check() == []
        kept.append((record.response.data, record.output_at, record.fill_at, record.fill))
    assert kept[0][:3] == kept[1][:3] and kept[0][1] is not None
    assert (kept[0][3] is None) == (kept[1][3] is None) == (fill == "none")


async def test_a_locked_state_dir_is_refused(tmp_path: Path) -> None:
    first = make_store(tmp_path, offload=inline)
    await first.start()
    second = make_store(tmp_path, offload=inline)
    with pytest.raises(StateDirUnusable, match="another ocxproxy process holds it"):
        await second.start()
    assert not second.durable
    build_chain(first, 2)  # the first one keeps the dir, and writes to it
    assert await first.flush()
    await first.close()
    third = make_store(tmp_path, offload=inline)  # free again once the first one stopped
    await third.start()
    assert await items_of(third, "r1") == expected_items("r", 2)
    await third.close()


async def test_a_checkpoint_waits_for_as_much_journal_as_it_holds(tmp_path: Path) -> None:
    """A checkpoint costs CPU in proportion to the records: the next is written once the
    journal since it passes the checkpoint's own size where that exceeds
    `checkpoint_bytes`, and at twice `checkpoint_bytes` at the latest (replay at start-up
    stays bounded)."""
    store = make_store(tmp_path, checkpoint_bytes=4096, checkpoint_age=3600.0)
    await store.start()
    build_chain(store, 80)
    await store.flush()
    await asyncio.sleep(0.3)  # (a checkpoint the turns called for is written)
    disk = store.disk
    assert disk is not None and disk.checkpoint_size > 2 * 4096
    written = sample(store.metrics.snapshot_writes)
    i = 0

    async def journal_past(n: int) -> None:
        nonlocal i
        while disk.since_checkpoint < n:
            await store.commit(store.put(make_turn(f"more{i}", f"more turn {i}"), None))
            i += 1

    await journal_past(4096)
    await asyncio.sleep(0.3)
    assert sample(store.metrics.snapshot_writes) == written  # not yet: the checkpoint is larger
    assert disk.since_checkpoint < 2 * 4096
    await journal_past(2 * 4096)
    for _ in range(100):
        if sample(store.metrics.snapshot_writes) > written:
            break
        await asyncio.sleep(0.05)
    assert sample(store.metrics.snapshot_writes) == written + 1
    await store.close()
    assert store.check() == []


async def test_gauges_follow_the_tiers(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_resident_bytes=500, offload=inline)
    await store.start()
    build_chain(store, 10)
    await store.flush()
    m = store.metrics
    stats = store.stats()
    assert sample(m.store_entries, tier="records") == 10
    assert sample(m.store_bytes, tier="resident") == stats.resident_bytes
    assert sample(m.store_bytes, tier="disk") == stats.disk_bytes > 0
    assert sample(m.snapshot_writes) >= 1
    assert b"ocxproxy_snapshot_age_seconds" in m.render()
    assert "Journal" in repr(store)
    await store.close()


async def test_files_evicted_by_a_checkpoint_outlive_it(tmp_path: Path) -> None:
    """A crash right after an eviction's checkpoint: what it names is still there, the
    newest turns resolve, the evicted ones say so."""
    store = make_store(tmp_path, max_disk_bytes=6000, max_resident_bytes=1, offload=inline)
    await store.start()
    for i in range(16):
        await store.commit(store.put(make_turn(f"t{i}", f"turn {i} words"), None))
    assert await store.flush()  # evicts the oldest, compacts, checkpoints
    assert sample(store.metrics.store_evictions, reason="disk_bytes") > 0
    await store.abandon()
    store = make_store(tmp_path, offload=inline)  # a roomier cap
    await store.start()
    assert store.check() == []
    assert len(await items_of(store, "t15")) == 2
    with pytest.raises(StoreFailure):
        await items_of(store, "t0")
    await store.close()


async def test_state_dir_is_private_and_defaults_to_the_user_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stat

    import platformdirs

    from ocxproxy import store as store_module
    from ocxproxy.config import Config
    from ocxproxy.store.local import store as local_store

    assert store_module.default_state_dir() == platformdirs.user_state_path("ocxproxy")
    root = tmp_path / "deep" / "state"
    monkeypatch.setattr(local_store, "default_state_dir", lambda: root)
    store = Store.from_config(Config(snapshot_delay=0.01))
    assert store.state_dir == root
    await store.start()
    build_chain(store, 2)
    await store.close()
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "journal").st_mode) == 0o700
    for name in ("journal/00000001.log", "lock"):
        assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o600
    assert Store.from_config(Config(zdr=True, state_dir=root)).state_dir is None


async def test_new_turns_wait_while_the_journal_is_behind(tmp_path: Path) -> None:
    """Backpressure: bytes queued for the journal beyond half the resident budget hold
    new turns back until a commit lands."""
    gate = asyncio.Event()
    gate.set()

    async def slow_disk(fn: Any, /, *args: Any) -> Any:
        await gate.wait()
        return fn(*args)

    store = make_store(tmp_path, max_resident_bytes=2048, offload=slow_disk)
    await store.start()
    gate.clear()
    build_chain(store, 40)  # one commit in flight (stuck), the rest queued behind it
    await asyncio.sleep(0.01)
    build_chain(store, 10, prefix="more")
    assert store.stats().pending_bytes > 1024
    waiting = asyncio.ensure_future(store.wait_for_room())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    gate.set()
    await asyncio.wait_for(waiting, 5.0)
    assert store.stats().pending_bytes <= 1024
    await store.close()


async def test_backpressure_gives_up_after_its_timeout(tmp_path: Path) -> None:
    gate = asyncio.Event()
    gate.set()

    async def stuck_disk(fn: Any, /, *args: Any) -> Any:
        await gate.wait()
        return fn(*args)

    store = make_store(tmp_path, max_resident_bytes=2048, offload=stuck_disk)
    await store.start()
    gate.clear()
    build_chain(store, 40)
    await asyncio.sleep(0.01)
    build_chain(store, 10, prefix="more")
    store.backpressure_timeout = 0.1
    await asyncio.wait_for(store.wait_for_room(), 2.0)  # returns, does not hang
    assert store.stats().pending_bytes > 1024
    gate.set()
    await store.close()


async def test_a_turn_acknowledged_after_its_twin_was_deleted_uncommitted_survives(
    tmp_path: Path,
) -> None:
    # The deleted turn's segment is still queued for the journal when an identical turn
    # (the same items, so the same digest) arrives: the new turn must queue its own.
    store = make_store(tmp_path, offload=inline)
    await store.start()
    store.put(make_turn("r1", "same", answer="same"), None)
    assert store.delete_nowait("scope-a", "r1")
    twin = store.put(make_turn("r2", "same", answer="same"), None)
    await store.commit(twin)  # acknowledged
    await store.close()
    reopened = make_store(tmp_path, offload=inline)
    await reopened.start()
    assert sample(reopened.metrics.spill_failures, reason="missing") == 0
    record = reopened.lookup_nowait("scope-a", "r2")
    assert len(await reopened.history(record)) == 1
    assert reopened.check() == []
    await reopened.close()


@pytest.mark.parametrize("kind", ["memory-only", "store-false"])
async def test_a_response_kept_in_memory_only_is_not_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Content addressing pays for what records share (a turn's items, the filled-in
    members); a response object carries its own id, so one that never reaches disk is
    named without hashing its bytes, and GET still answers it byte for byte."""
    store = make_store(None if kind == "memory-only" else tmp_path, offload=inline)
    await store.start()
    durable = kind == "memory-only"
    parent = store.put(make_turn("r1", "first", filled=True, durable=durable), None)
    hashed: list[bytes] = []
    sha256 = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda data: hashed.append(data) or sha256(data))
    turn = make_turn("r2", "second", filled=True, durable=durable)
    record = store.put(turn, parent)
    assert hashed == [turn.items]  # its own segment's: the fill's are known already
    assert await store.response_bytes(record) == turn.response
    again = make_turn("r3", "second", filled=True, durable=durable)
    assert store.put(again, parent).response is not record.response
    assert store.delete_nowait("scope-a", "r3")
    assert await store.response_bytes(record) == turn.response
    assert store.check() == []
    await store.close()


async def test_the_shared_fill_stays_resident_while_turns_use_it() -> None:
    """A memory-only store loses what leaves memory: the members every turn's Response
    shares (Turn.fill) are used again by each turn, so they are never the oldest there."""
    store = make_store(None, max_resident_bytes=4_000)
    first = store.put(make_turn("r0", "turn 0", filled=True), None)
    for i in range(1, 40):
        record = store.put(make_turn(f"r{i}", f"turn {i}", filled=True), None)
        assert record.fill is first.fill and first.fill is not None
        assert first.fill.data is not None, i
    assert sample(store.metrics.store_evictions, reason="resident_bytes") > 0  # (a cap felt)
    assert await store.response_bytes(record) == make_turn("r39", "turn 39", filled=True).response
