"""The resident tier's byte cap bounds the memory it holds, not only its segments' payload."""

from __future__ import annotations

import sys
import tracemalloc

from ocxproxy.model import NO_CALLS, Segment
from ocxproxy.store.resident import ResidentTier

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
