"""Which reason explains a continuation's cache shortfall (upstream/misses.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ocxproxy.metrics import CACHE_MISS_REASONS
from ocxproxy.upstream.misses import CacheBook, Served, head_of, miss_of

HEAD = head_of({"model": "m", "instructions": "be brief"})
PARENT = Served("http://a", 3, HEAD)


def miss(cached: int, **changes: Any) -> str | None:
    args: dict[str, Any] = {
        "backend": "http://a",
        "epoch": 3,
        "head": HEAD,
        "dropped": 0,
        "compacted": False,
        "note": None,
        "input_tokens": 1200,
        "cached": cached,
    }
    found = miss_of(PARENT, 1000, 0, **{**args, **changes})
    return None if found is None else found.reason


def test_a_prefix_covered_within_the_slack_is_no_miss() -> None:
    assert miss(1000) is None
    assert miss(905) is None  # the output re-tokenized, a cache block short
    assert miss(899) == "evicted"
    assert miss(0) == "evicted"


def test_a_short_prefix_allows_the_fixed_slack() -> None:
    found = miss_of(PARENT, 40, 0, backend="http://a", epoch=3, head=HEAD, dropped=0,
                    compacted=False, note=None, input_tokens=60, cached=9)  # fmt: skip
    assert found is None
    found = miss_of(PARENT, 40, 0, backend="http://a", epoch=3, head=HEAD, dropped=0,
                    compacted=False, note=None, input_tokens=60, cached=7)  # fmt: skip
    assert found is not None and (found.expected, found.cached) == (40, 7)


def test_the_expected_prefix_is_at_most_the_input() -> None:
    assert miss(450, input_tokens=500) is None  # after a cut the input is shorter


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"note": "restore_failed", "compacted": True, "epoch": 4}, "restore_failed"),
        ({"note": "fingerprint_mismatch", "backend": "http://b"}, "fingerprint_mismatch"),
        ({"compacted": True, "dropped": 3, "backend": "http://b"}, "compacted"),
        ({"dropped": 3, "backend": "http://b"}, "truncated"),
        ({"backend": "http://b", "epoch": 4}, "rerouted"),
        ({"epoch": 4, "head": HEAD + 1}, "backend_restarted"),
        ({"head": head_of({"model": "m", "instructions": "be long"})}, "diverged"),
        ({}, "evicted"),
    ],
)
def test_the_first_reason_that_explains_it(changes: dict[str, Any], reason: str) -> None:
    assert miss(10, **changes) == reason
    assert reason in CACHE_MISS_REASONS


def test_the_head_sees_the_prompt_before_the_history() -> None:
    base = {"model": "m", "instructions": "x", "tools": [{"type": "function", "name": "ls"}]}
    assert head_of(base) == head_of({**base, "input": "other", "store": False})
    assert head_of(base) != head_of({**base, "tools": [{"type": "function", "name": "cat"}]})
    assert head_of(base) != head_of({**base, "model": "n"})
    assert head_of(base) != head_of({**base, "reasoning": {"effort": "high"}})


def test_the_book_forgets_the_oldest() -> None:
    book = CacheBook(size=2)
    for n in range(3):
        book.put(f"resp_{n}", PARENT)
    assert book.get("resp_0") is None and book.get("resp_2") == PARENT


def test_the_book_forgets_its_oldest_a_batch_at_a_time() -> None:
    book = CacheBook(size=128)  # a slack of 2
    for n in range(130):
        book.put(f"resp_{n}", PARENT)
    assert len(book.served) == 130 and book.get("resp_0") == PARENT
    book.put("resp_130", PARENT)
    assert list(book.served) == [f"resp_{n}" for n in range(3, 131)]


def test_turns_served_alike_share_one_entry() -> None:
    book = CacheBook()
    book.put("resp_a", Served("http://a", 3, HEAD, "s"))
    book.put("resp_b", Served("http://a", 3, HEAD, "s"))
    book.put("resp_c", Served("http://a", 4, HEAD, "s"))
    assert book.get("resp_a") is book.get("resp_b") == Served("http://a", 3, HEAD, "s")
    assert book.get("resp_c") == Served("http://a", 4, HEAD, "s")


def test_a_conversations_entry_keeps_its_own_latest_turn() -> None:
    book = CacheBook()
    book.put("conv_a", Served("http://a", 3, HEAD, "s", turn="resp_1"))
    book.put("conv_b", Served("http://a", 3, HEAD, "s", turn="resp_2"))
    book.put("resp_3", Served("http://a", 3, HEAD, "s"))
    assert [book.get(k).turn for k in ("conv_a", "conv_b", "resp_3")] == ["resp_1", "resp_2", ""]  # type: ignore[union-attr]
