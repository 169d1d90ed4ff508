"""Records the store keeps for others (`Store.kept`): conversations are pinned (no expiry,
no cap drops them, a write that would need that is refused), share segments with the
responses that chain on them, and persist like responses."""

from __future__ import annotations

from pathlib import Path

import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Segment
from ocxproxy.store.local.store import NEVER
from ocxproxy.store.resident import ENTRY_BYTES
from tests.store.helpers import Clock, make_store, make_turn


def segment(text: str) -> Segment:
    data = b'{"role":"user","content":"%s"}' % text.encode()
    return Segment(data, 1, frozenset(), durable=False)


async def test_a_kept_record_is_no_response_and_outlives_every_ttl(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    conv = store.kept.keep("conv_a", "scope-a", (segment("hi"),), b"{}", created_at=clock.now)
    with pytest.raises(StoreFailure):
        store.lookup_nowait("scope-a", "conv_a")  # not a response: no chain, GET or delete by it
    assert not store.delete_nowait("scope-a", "conv_a")
    with pytest.raises(StoreFailure):
        store.record("scope-b", "conv_a")  # another credential's: unknown
    clock.now += 10 * 365 * 86400
    assert await store.sweep() == 0
    assert store.record("scope-a", "conv_a") is conv and conv.expires_at == NEVER
    assert store.delete_nowait("scope-a", "conv_a", kept=True)
    with pytest.raises(StoreFailure):
        store.record("scope-a", "conv_a")


async def test_rewriting_shares_segments_with_the_responses_on_top(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    first = segment("first")
    conv = store.kept.keep("conv_a", "scope-a", (first,), b"{}", created_at=1)
    response = store.put(make_turn("resp_1", "turn"), conv)
    assert response.segments[0] is conv.segments[0]
    again = store.kept.keep(
        "conv_a", "scope-a", (*conv.segments, response.segments[-1]), b"{}", created_at=1
    )
    assert again.segments == response.segments  # the same objects: stored once
    assert await store.history(again) == await store.history(response)
    assert store.check() == []
    store.delete_nowait("scope-a", "conv_a", kept=True)
    assert await store.history(response)  # the response keeps what it holds
    assert store.check() == []


async def test_count_cap_evicts_responses_never_conversations(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_entries=3)
    store.kept.keep("conv_a", "scope-a", (segment("a"),), b"{}", created_at=1)
    store.kept.keep("conv_b", "scope-a", (segment("b"),), b"{}", created_at=1)
    for i in range(3):
        store.put(make_turn(f"r{i}", f"u{i}"), None)
    assert store.record("scope-a", "conv_a") and store.record("scope-a", "conv_b")
    assert len(store) == 3
    store.kept.keep("conv_a", "scope-a", (segment("a"), segment("a2")), b"{}", created_at=1)
    store.kept.keep("conv_c", "scope-a", (), b"{}", created_at=1)
    with pytest.raises(StoreFailure) as full:  # only conversations left: a fourth is refused
        store.kept.keep("conv_d", "scope-a", (), b"{}", created_at=1)
    assert full.value.reason == FailureReason.FULL
    assert {"conv_a", "conv_b", "conv_c"} == {
        r for r in ("conv_a", "conv_b", "conv_c") if store.record("scope-a", r)
    }


async def test_a_write_past_the_byte_cap_is_refused_not_evicting(tmp_path: Path) -> None:
    # No disk: memory is the cap, each segment's entry in the resident tier counted too.
    store = make_store(None, max_resident_bytes=200 + 4 * ENTRY_BYTES)
    small = store.kept.keep("conv_a", "scope-a", (segment("x" * 50),), b"{}", created_at=1)
    with pytest.raises(StoreFailure) as full:
        store.kept.keep("conv_b", "scope-a", (segment("y" * 150),), b"{}", created_at=1)
    assert full.value.reason == FailureReason.FULL
    assert store.record("scope-a", "conv_a") is small
    assert await store.history(small)  # still whole


async def test_kept_records_persist_and_stay_pinned(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    conv = store.kept.keep("conv_a", "scope-a", (segment("a"),), b'{"m":1}', created_at=7)
    store.put(make_turn("resp_1", "turn"), conv)
    store.kept.keep("conv_empty", "scope-a", (), b"{}", created_at=8)  # no items: still a chain
    await store.close()

    again = make_store(tmp_path, max_entries=1)
    await again.start()
    restored = again.record("scope-a", "conv_a")
    assert restored.created_at == 7 and restored.expires_at == NEVER
    assert await again.response_bytes(restored) == b'{"m":1}'
    assert await again.history(restored) == [segment("a").data]
    assert await again.history(again.record("scope-a", "conv_empty")) == []
    with pytest.raises(StoreFailure):  # the cap of one took the response, not the conversation
        again.lookup_nowait("scope-a", "resp_1")
    await again.close()
