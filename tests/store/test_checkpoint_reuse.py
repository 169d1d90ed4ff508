"""A checkpoint copies the previous checkpoint's rows of a journal file that did not change
since (no segment left it or learnt its item ids there, none came back to it) instead of
encoding them again, and comes out exactly as a checkpoint encoded whole would: after
deletes, eviction and compaction too. A copied entry that is not what was written fails
the checkpoint (the next one is encoded whole)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ocxproxy.model import ItemIds
from ocxproxy.store import Store
from ocxproxy.store.local import codec, journal
from ocxproxy.store.local.segment_files import FILES
from tests.store.helpers import durable_ids, make_store, make_turn


def entries(state_dir: Path) -> list[tuple[int, bytes]]:
    """The checkpoint's entries but its head (which says when it was written)."""
    raw = (state_dir / journal.CHECKPOINT).read_bytes()
    return [(kind, bytes(payload)) for kind, payload, _ in codec.entries(raw) if kind != codec.HEAD]


class Encoded:
    """Counts the segment rows encoded (not copied) from journal files."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows = 0
        encode = codec.checkpoint_segment_rows

        def counted(found: Any, pack: int) -> Any:
            rows = encode(found, pack)
            self.rows += len(rows) if pack != FILES else 0
            return rows

        monkeypatch.setattr(codec, "checkpoint_segment_rows", counted)


async def as_if_encoded_whole(store: Store, state_dir: Path) -> None:
    """The checkpoint just written is the one a checkpoint encoded whole writes now."""
    assert store.disk is not None
    written = entries(state_dir)
    store.disk.rows, store.disk.record_rows = {}, {}  # (nothing to copy from)
    assert await store.flush()
    assert entries(state_dir) == written


async def chains(store: Store, prefix: str, n: int, depth: int = 10) -> None:
    parent = None
    for i in range(n):
        turn = make_turn(f"{prefix}{i}", f"{prefix} turn {i}")
        parent = store.put(turn, parent if i % depth else None)
        if i % 50 == 49:
            await store.commit()
    await store.commit()


async def test_an_unchanged_journal_file_is_copied_not_encoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    await store.start()
    await chains(store, "r", 600)
    assert await store.flush()
    encoded = Encoded(monkeypatch)
    assert await store.flush()
    assert encoded.rows == 0  # every segment row copied from the previous file
    await chains(store, "s", 50)
    assert await store.flush()
    assert 0 < encoded.rows <= 100  # only the new file's (each turn adds a segment)
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert len(durable_ids(tmp_path)) == 650


async def test_files_that_lost_segments_are_encoded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path, max_entries=900)
    await store.start()
    await chains(store, "r", 600)
    assert await store.flush()
    for i in range(0, 300, 10):  # whole chains: their segments leave the journal files
        for k in range(10):
            store.delete_nowait("scope-a", f"r{i + k}")
    await store.commit()
    await chains(store, "s", 700)  # past max_entries: the oldest 100 are evicted
    encoded = Encoded(monkeypatch)
    assert await store.flush()
    assert encoded.rows > 0
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert len(durable_ids(tmp_path)) == 900


async def test_a_segment_that_learns_its_item_ids_is_encoded_again(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    turn = make_turn("r0", "hello")
    store.put(turn, None)
    await chains(store, "x", 30)
    assert await store.flush()
    # The same items again, now with the id one of them carries: the located segment
    # learns it, and its row in the checkpoint must say so.
    start = len(b'{"role":"user","content":"hello"},')
    ids = ItemIds([("msg_1", start, len(turn.items))])
    store.put(dataclasses.replace(turn, response_id="r1", item_ids=ids), None)
    await store.commit()
    assert await store.flush()
    loaded = codec.Loaded()
    codec.load_checkpoint((tmp_path / journal.CHECKPOINT).read_bytes(), loaded)
    learnt = [s for s in loaded.segments.values() if s.item_id_list == ("msg_1",)]
    assert len(learnt) == 1
    await as_if_encoded_whole(store, tmp_path)
    await store.close()


async def test_a_copied_entry_that_changed_fails_the_checkpoint_not_the_store(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path)
    await store.start()
    await chains(store, "r", 300)
    assert await store.flush()
    path = tmp_path / journal.CHECKPOINT
    raw = bytearray(path.read_bytes())
    offset = next(at for kind, _, at in codec.entries(bytes(raw)) if kind == codec.SEGS)
    raw[offset + codec.FRAME.size + 10] ^= 1  # bit rot in a segment row
    path.write_bytes(bytes(raw))
    failures = store.metrics.snapshot_failures.labels(reason="write_failed")
    before = failures.get()
    assert not await store.flush()
    assert failures.get() == before + 1
    assert await store.flush()  # encoded whole
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert len(durable_ids(tmp_path)) == 300


async def test_a_segment_taken_back_into_its_file_is_encoded_again(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_resident_bytes=1)  # (bytes only in the journal)
    await store.start()
    first = store.put(make_turn("r0", "first"), None)
    await chains(store, "x", 30)  # (the file keeps live segments: it stays)
    assert await store.flush()
    assert first.own is not None and first.own.data is None
    # An exchange continuing r0 is in flight when r0 is deleted: its segment is forgotten
    # (its file keeps its bytes), and the exchange's turn then takes it back where it was,
    # before the next checkpoint, which encodes the file's rows again.
    first_pack = first.own.pack
    store.delete_nowait("scope-a", "r0")
    await store.commit()
    child = store.put(make_turn("r1", "second"), first)
    await store.commit()
    (taken_back, _) = child.segments
    assert taken_back is not first.own and taken_back.digest == first.own.digest
    assert taken_back.pack == first_pack
    assert await store.flush()
    await as_if_encoded_whole(store, tmp_path)
    await store.close()
    assert "r1" in durable_ids(tmp_path)
