"""The resident tier: its byte cap bounds the memory it holds, not only its segments'
payload; its default budget."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

from ocxproxy.config import Config
from ocxproxy.model import NO_CALLS, Segment
from ocxproxy.store.local.store import Store
from ocxproxy.store.resident import ResidentTier
from ocxproxy.store.shared.store import SharedStore

CAP = 1_000_000


def segments(n: int, size: int) -> list[Segment]:
    return [Segment(b"%08d" % i * (size // 8), 1, NO_CALLS, durable=True) for i in range(n)]


def test_the_cap_bounds_the_bytes_objects_and_the_map_entries() -> None:
    """2,000 segments of 1,000 bytes through a 1 MB tier, shed after each admit as the
    store does: what stays (the bytes objects, their headers, and the ordered map's
    table and nodes, traced) is within the cap."""
    tier = ResidentTier(CAP, by_digest=True)
    batch = segments(2000, 1000)
    tracemalloc.start()
    try:
        for segment in batch:
            tier.admit(segment)
            for victim in tier.evict_over_budget():
                victim.data = None
        mapped = tracemalloc.get_traced_memory()[0]  # only the map's tables and nodes
    finally:
        tracemalloc.stop()
    held = sum(sys.getsizeof(s.data) for s in tier) + mapped
    assert 800 < len(tier) < 1000
    assert held <= CAP and tier.bytes <= CAP
    assert tier.bytes == sum(map(tier.held, tier)) == len(tier) * (1000 + tier.entry_bytes)


def test_hex_keys_count_their_strings() -> None:
    by_key, by_digest = ResidentTier(CAP), ResidentTier(CAP, by_digest=True)
    assert by_key.entry_bytes - by_digest.entry_bytes == sys.getsizeof("0" * 64)
    (segment,) = segments(1, 1000)
    by_key.admit(segment)
    by_key.admit(segment)  # once
    assert by_key.bytes == 1000 + by_key.entry_bytes
    by_key.remove(segment)
    assert by_key.bytes == 0 and len(by_key) == 0


def test_the_default_budget_is_smaller_in_front_of_the_journal(tmp_path: Path) -> None:
    """The state dir's journal holds every turn, so its resident tier only spares a read
    back: 32 MiB by default; a memory-only store (--zdr) is its resident tier: 64 MiB. A
    budget given is taken as it is either way."""
    durable = Store.from_config(Config(state_dir=tmp_path / "state"))
    zdr = Store.from_config(Config(zdr=True))
    assert (durable.resident.max_bytes, zdr.resident.max_bytes) == (32 << 20, 64 << 20)
    # --retain-unstored's store:false turns are in the tier alone, as under --zdr.
    retaining = Store.from_config(Config(state_dir=tmp_path / "state", retain_unstored=True))
    assert retaining.resident.max_bytes == 64 << 20
    # A shared store's cache: what it does not hold is fetched over the network.
    shared = SharedStore.settings(Config(shared_store="redis://127.0.0.1:1/0"))
    assert shared["max_resident_bytes"] == 64 << 20
    for zero_retention in (False, True):
        config = Config(state_dir=tmp_path / "state", zdr=zero_retention, max_resident_bytes=5000)
        assert Store.from_config(config).resident.max_bytes == 5000


def test_the_hot_segment_goes_last() -> None:
    """The hot segment (the members every turn's Response is filled in with) counts as
    the most recently used however long ago it was admitted: the others go first, and it
    goes only when the budget cannot be met without it."""
    a, b, c, d = segments(4, 1000)
    each = 1000 + ResidentTier(CAP, by_digest=True).entry_bytes
    tier = ResidentTier(3 * each, by_digest=True)
    for segment in (a, b, c):
        tier.admit(segment)
    tier.hot = a
    tier.admit(d)
    assert tier.evict_over_budget() == [b]
    assert list(tier) == [a, c, d]
    tier.max_bytes = each // 2
    assert tier.evict_over_budget() == [c, d, a]
    assert tier.bytes == 0
