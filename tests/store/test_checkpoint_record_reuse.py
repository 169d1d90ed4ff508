"""A checkpoint copies the previous checkpoint's rows of a chunk of the records' order that
did not change since (as many records, none whose row changed in place, the chunks holding
the parents its rows named copied too) instead of encoding them again, and comes out
exactly as a checkpoint encoded whole would: after deletes, expiry, eviction, compaction
moving responses, conversations' appends, a segment lost, and a restart. Chunks of eight
records here (records.CHUNK), so that a few dozen records make many."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from ocxproxy.errors import StoreFailure
from ocxproxy.model import NO_CALLS, Chain, Record, Segment, chain_of, place, unplace
from ocxproxy.store import Store, records
from ocxproxy.store.local import codec, upkeep
from ocxproxy.store.shards import Shards
from tests.store.helpers import Clock, durable_ids, make_store, make_turn
from tests.store.test_checkpoint_reuse import as_if_encoded_whole, entries

SMALL = 8


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "CHUNK", SMALL)


class Encoded:
    """Counts the records whose rows were encoded (not copied)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.records = 0
        encode = codec.checkpoint_record_rows

        def counted(recs: list[Record], *args: Any) -> Any:
            self.records += len(recs)
            return encode(recs, *args)

        monkeypatch.setattr(codec, "checkpoint_record_rows", counted)


async def chains(store: Store, prefix: str, n: int, depth: int = 10) -> list[Record]:
    out: list[Record] = []
    for i in range(n):
        out.append(
            store.put(
                make_turn(f"{prefix}{i}", f"{prefix} turn {i}"), out[-1] if i % depth else None
            )
        )
    await store.commit()
    return out


def rows_of(written: list[tuple[int, bytes]]) -> dict[str, list[Any]]:
    """The record rows of a checkpoint's entries, by id."""
    return {
        row[0]: row for kind, payload in written if kind == codec.RECS
        for row in orjson.loads(payload)
    }  # fmt: skip


def record_rows(state_dir: Path) -> dict[str, list[Any]]:
    return rows_of(entries(state_dir))


async def test_unchanged_chunks_are_copied_and_load_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    await store.start()
    await chains(store, "r", 100)
    assert await store.flush()
    encoded = Encoded(monkeypatch)
    assert await store.flush()
    assert encoded.records <= SMALL  # the newest chunk's only
    encoded.records = 0
    await chains(store, "s", 20)
    assert await store.flush()
    assert 20 <= encoded.records <= 20 + 2 * SMALL
    await as_if_encoded_whole(store, tmp_path)
    written = record_rows(tmp_path)
    await store.close()
    # a restart loads it back: every record, its chain as it was
    again = make_store(tmp_path)
    await again.start()
    assert sorted(r.id for r in again.records()) == sorted(written)
    assert again.check() == []
    assert await again.flush()  # encoded whole (a new process copies nothing)
    assert record_rows(tmp_path) == written
    assert await again.flush()  # copied, from a restored store's chains
    await as_if_encoded_whole(again, tmp_path)
    await again.close()
    assert len(durable_ids(tmp_path)) == 120


async def test_a_deleted_parent_changes_the_rows_naming_it_in_later_chunks(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    made = await chains(store, "r", 40)
    assert await store.flush()
    # r7 is chunk 0's last, its child r8 chunk 1's first: r8's row names it
    assert made[7].chunk == 0 and made[8].chunk == 1
    assert record_rows(tmp_path)["r8"][4] == ["^", "r7", made[8].own.sid]
    store.delete_nowait("scope-a", "r7")
    await store.commit()
    assert await store.flush()
    assert record_rows(tmp_path)["r8"][4] == [s.sid for s in made[8].segments]
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert len(durable_ids(tmp_path)) == 39


async def test_a_chunk_encoded_again_leaves_the_chunks_after_it_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    await store.start()
    made = await chains(store, "r", 100)  # chains of 10 over chunks of 8: rows name
    assert await store.flush()  # parents in the chunk before theirs
    assert made[5].chunk == 0 and made[9].chunk == 1
    store.delete_nowait("scope-a", "r5")  # chunk 0 changes; r6 is in it, r8 names r7
    await store.commit()
    encoded = Encoded(monkeypatch)
    assert await store.flush()
    assert encoded.records <= 2 * SMALL  # chunk 0 and the newest
    await as_if_encoded_whole(store, tmp_path)
    await store.close()


async def test_the_newest_chunk_is_encoded_again_at_the_same_count(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    await chains(store, "r", 2 * SMALL + 4)  # the newest chunk holds 4
    assert await store.flush()
    store.delete_nowait("scope-a", "r19")
    store.put(make_turn("x", "one more"), None)  # 4 again: other records
    await store.commit()
    assert await store.flush()
    assert "x" in record_rows(tmp_path)
    await as_if_encoded_whole(store, tmp_path)
    await store.close()


async def test_expired_and_evicted_records_leave_their_chunks(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock=clock, ttl=100.0, max_entries=60)
    await store.start()
    await chains(store, "old", 20)  # (chunks 0-2: the third shared with the next)
    clock.now += 50
    await chains(store, "new", 40)
    assert await store.flush()
    clock.now += 60  # the first 20 expire
    assert await store.sweep() == 20
    assert await store.flush()
    await as_if_encoded_whole(store, tmp_path)
    await chains(store, "more", 30)  # past max_entries: the 10 oldest evicted
    assert len(store) == 60
    assert await store.flush()
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert len(durable_ids(tmp_path)) == 60


async def test_responses_moved_by_compaction_are_encoded_again(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    kept = [store.put(make_turn(f"a{i}", f"kept {i}"), None) for i in range(SMALL)]
    await store.commit()
    for i in range(6 * SMALL):
        store.put(make_turn(f"b{i}", f"gone {i} " + "x" * 200), None)
    await store.commit()
    assert await store.flush()
    before = [r.response for r in kept]
    for i in range(6 * SMALL):
        store.delete_nowait("scope-a", f"b{i}")
    await store.commit()
    assert await store.flush()  # compacts the first file: moves the kept responses
    assert all(
        unplace(r.response)[0] != unplace(was)[0] for r, was in zip(kept, before, strict=True)
    )
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert sorted(durable_ids(tmp_path)) == sorted(r.id for r in kept)


async def test_a_conversation_appended_to_leaves_its_chunk(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    conv = store.kept.keep("conv_a", "scope-a", (segment("hi"),), b"{}", created_at=1)
    await chains(store, "r", 30)
    conv = store.kept.keep("conv_b", "scope-a", (segment("b"),), b"{}", created_at=1, ids=[["i1"]])
    await chains(store, "s", 30)
    await store.commit()
    assert await store.flush()
    store.kept.keep("conv_a", "scope-a", (*conv.segments, segment("more")), b"{}", created_at=1)
    store.kept.keep(
        "conv_b", "scope-a", (*conv.segments, segment("b2")), b"{}", created_at=1,
        ids=[["i1"], ["i2"]],
    )  # fmt: skip
    await store.commit()
    assert await store.flush()
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert {"conv_a", "conv_b"} <= set(durable_ids(tmp_path))


def segment(text: str) -> Segment:
    data = b'{"role":"user","content":"%s"}' % text.encode()
    return Segment(data, 1, frozenset(), durable=False)


async def test_a_record_dropped_while_the_checkpoint_encodes_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    await store.start()
    await chains(store, "r", 40)
    assert await store.flush()
    # r9 (chunk 1), a chain's last, goes after the capture, before its chunk is read: its
    # own segment is forgotten with it, so its row is left out (its DEL follows)
    unchanged = records.Records.unchanged

    def dropping(index: records.Records, number: int, *args: Any) -> bool:
        if number == 0:
            store.delete_nowait("scope-a", "r9")
        return unchanged(index, number, *args)

    monkeypatch.setattr(records.Records, "unchanged", dropping)
    assert await store.flush()
    monkeypatch.setattr(records.Records, "unchanged", unchanged)
    written = [entry for entry in entries(tmp_path) if entry[0] == codec.RECS]
    assert "r9" not in rows_of(written)
    assert store.disk is not None
    store.disk.rows, store.disk.record_rows = {}, {}
    assert await store.flush()  # (its segment's row went too, copied before the drop)
    assert [entry for entry in entries(tmp_path) if entry[0] == codec.RECS] == written
    await store.close()


async def test_a_segment_lost_takes_the_rows_holding_it_out(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_resident_bytes=1)  # (bytes only in the journal)
    await store.start()
    made = await chains(store, "r", 40)
    assert await store.flush()
    own = made[3].own
    assert own is not None and own.data is None and own.pack >= 0
    assert store.journal is not None
    path = store.journal.path(own.pack)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\0" * 8, own.offset + 4)  # rot in its zstd frame
    finally:
        os.close(fd)
    with pytest.raises(StoreFailure):
        await store.segment_bytes([own])
    assert own.pack < 0
    assert await store.flush()
    assert "r3" not in record_rows(tmp_path) and "r9" not in record_rows(tmp_path)
    await as_if_encoded_whole(store, tmp_path)
    await store.close()


# -- the rule for a row that names no parent though a link precedes its own -------------


def seg(sid: int) -> Segment:
    s = Segment(b"x%d" % sid, 0, NO_CALLS, durable=True)
    s.sid, s.pack = sid, 1
    s.place(sid * 10, 5)
    return s


def rec(rid: str, links: Chain, response: Any) -> Record:
    return Record(rid, "scope", 1.5, 2.5, True, links, response, n_items=1)


async def encode(
    recs: list[Record], layout: list[tuple[int, int]], before: dict[int, upkeep.ChunkRows]
) -> tuple[list[Any], dict[int, upkeep.ChunkRows]]:
    entries, _, _, kept = await upkeep.encode_checkpoint(
        (1, 0), 0.0, 1, [], Shards(), list(recs), layout, (), None, lambda pack: False,
        before, lambda number, count: True,
    )  # fmt: skip
    return entries, kept


async def test_a_row_naming_no_parent_is_copied_only_if_every_earlier_record_had_a_row() -> None:
    """r1's parent p had no row (its response not committed yet): r1 lists its chain.
    Once p has a row, r1 names it: r1's chunk must not be copied."""
    root = chain_of([seg(1)])
    parent = rec("p", root, b"{}")  # (its bytes: not committed yet)
    child = rec("r1", Chain(root, seg(2)), place(1, 0, 1, 1))
    filler = [rec(f"f{i}", chain_of([seg(10 + i)]), place(1, 0, 1, 1)) for i in range(3)]
    order = [parent, filler[0], child, filler[1], filler[2]]
    layout = [(0, 2), (1, 2), (2, 1)]
    first, kept = await encode(order, layout, {})
    assert 0 not in kept  # (p had no row)
    assert 1 not in kept  # r1 named no parent, and a record before it had no row
    parent.response = place(1, 0, 1, 1)  # committed
    # as the checkpoint file would hold them: each entry where it was written
    for rows in kept.values():
        rows.written([(i, 0, 0) for i in range(len(first))])
    second, _ = await encode(order, layout, kept)
    whole, _ = await encode(order, layout, {})
    copied = [first[e.offset] if isinstance(e, codec.Copied) else e for e in second]
    assert copied == whole
    assert rows_of(whole)["r1"][4] == ["^", "p", 2]
