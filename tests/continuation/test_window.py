"""continuation/window.py: estimates from a parent's usage, and where truncation cuts
(CONTRACT.md C10)."""

from __future__ import annotations

from typing import Any

from ocxproxy.continuation.window import (
    LOW_RATIO,
    Cut,
    Fact,
    TokenBook,
    drop_point,
    estimate,
    inner_point,
    kept,
    kept_sizes,
    room,
    step_target,
)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


def call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "ok"}


def test_estimate_adds_new_bytes_to_the_parents_reported_tokens() -> None:
    fact = Fact(tokens=1000, size=4000)
    tokens, margin = estimate(fact, 4400, ratio=4.0)
    assert tokens == 1100
    assert margin == 100 // 4 + 16
    fewer, _ = estimate(fact, 3600, ratio=4.0)  # a larger drop: fewer tokens
    assert fewer == 900


def test_without_a_fact_the_estimate_runs_high() -> None:
    tokens, margin = estimate(None, 4000, ratio=4.0)
    assert tokens == 4000 / LOW_RATIO  # the low ratio, not the backend's
    assert margin > 0


def test_the_book_learns_a_ratio_and_forgets_the_oldest() -> None:
    book = TokenBook(size=2)
    assert book.ratio("b") == LOW_RATIO
    book.learn("b", 4000, 1000)
    assert book.ratio("b") == 4.0
    book.learn("b", 3000, 1000)
    assert 3.0 < book.ratio("b") < 4.0
    for n in range(3):
        book.put(f"r{n}", Fact(n, n))
    assert book.get("r0") is None and book.get("r2") == Fact(2, 2)


def test_the_book_forgets_its_oldest_a_batch_at_a_time() -> None:
    """Past its size by its slack (a 64th), the oldest go down to its size at once: one
    delete a put made each put walk the dict's emptied slots, ~100 µs at 100,000 facts."""
    book = TokenBook(size=128)
    for n in range(130):
        book.put(f"r{n}", Fact(n, n))
    assert len(book.facts) == 130 and book.get("r0") == Fact(0, 0)  # within the slack
    book.put("r130", Fact(130, 130))
    assert list(book.facts) == [f"r{n}" for n in range(3, 131)]  # the newest 128 kept
    book.put("r3", Fact(3, 3))  # put again: the newest now, the last to go
    assert list(book.facts)[-1] == "r3" and len(book.facts) == 128


def test_the_book_gives_back_each_fact_as_it_was_put() -> None:
    book = TokenBook()
    facts = {
        "plain": Fact(123_456, 9_876_543_210),
        "zero": Fact(0, 0),
        "cut": Fact(70_000, 300_000, Cut(4, 1, -5)),
        "huge": Fact(1 << 40, 7),
        "negative": Fact(-1, 5),
    }
    for key, fact in facts.items():
        book.put(key, fact)
    assert {key: book.get(key) for key in facts} == facts
    assert type(book.facts["plain"]) is int  # packed: no Fact object kept


def test_room_keeps_space_for_the_answer() -> None:
    assert room(1000, 100) == 900
    assert room(1000, None) == 875
    assert room(1000, 5000) == 500
    assert step_target(1000, 875) == 625


def test_a_cut_lands_on_a_user_message() -> None:
    items = [
        user("a"),
        assistant("b"),
        user("c"),
        assistant("d"),
        user("e"),
        assistant("f"),
        user("g"),
    ]
    sizes = [100] * len(items)
    cut = drop_point(items, sizes, tokens=700, dropped=0, keep=1, target=550)
    assert cut == 2  # one item was enough; the cut moved on to the next user message
    assert drop_point(items, sizes, tokens=700, dropped=2, keep=1, target=600) == 2 + 2


def test_a_cut_never_leaves_an_output_without_its_call() -> None:
    items = [user("a"), call("1"), output("1"), call("2"), output("2"), call("3"), output("3")]
    sizes = [100] * len(items)
    cut = drop_point(items, sizes, tokens=700, dropped=0, keep=1, target=450)
    assert cut is not None
    assert items[cut]["type"] == "function_call"  # past the output whose call is gone
    assert cut == 3


def test_a_turn_that_cannot_fit_is_none() -> None:
    items = [user("a"), user("b")]
    assert drop_point(items, [100, 900], tokens=1000, dropped=0, keep=1, target=500) is None


def test_a_turn_too_long_alone_loses_its_oldest_pairs() -> None:
    items = [user("a"), user("task"), call("1"), output("1"), call("2"), output("2")]
    items += [call("3"), output("3")]
    sizes = [100] * len(items)
    # From the turn's user message (index 1) on: 700 tokens, 450 wanted.
    skipped = inner_point(items, sizes, tokens=700, start=1, skipped=0, target=450)
    assert skipped == 4  # whole pairs: calls 1 and 2 with their outputs
    assert kept(items, 1, skipped) == [user("task"), call("3"), output("3")]
    assert kept_sizes(sizes, 1, skipped) == [0, 100, 0, 0, 0, 0, 100, 100]
    # A cut already made stays; the next one goes on from it.
    assert inner_point(items, sizes, tokens=300, start=1, skipped=4, target=250) is None


def test_a_cut_inside_a_turn_never_parts_parallel_calls() -> None:
    items = [user("task"), call("1"), call("2"), output("1"), output("2"), call("3")]
    items.append(output("3"))
    sizes = [100] * len(items)
    skipped = inner_point(items, sizes, tokens=700, start=0, skipped=0, target=550)
    assert skipped == 4  # one call was enough; both parallel calls and outputs go
    # The last output keeps its call; a parallel pair around it stays whole.
    items = [user("task"), call("1"), call("2"), output("1"), output("2")]
    assert (
        inner_point(items, [10, 10, 10, 10, 1000], tokens=1040, start=0, skipped=0, target=500)
        is None
    )
    assert inner_point(items, [100] * 5, tokens=500, start=0, skipped=0, target=100) is None
