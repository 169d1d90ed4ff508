"""The context window (CONTRACT.md C10): how many tokens a forwarded input holds, known
without a backend round trip on most turns, and which items `truncation: "auto"` drops.

Estimates: a finished turn leaves a `Fact` behind, the tokens its backend reported (input
and output: the next turn's history) and the bytes they stand for; the next turn adds
its own bytes at the backend's bytes-per-token ratio. Only an estimate near the window
is worth the backend's own count. Without a fact (the first turn of a chain here, or
after a restart), the whole body is estimated at a low ratio, so estimates run high and a
turn near the window is counted rather than let through.

Dropping: whole items from the front of the expanded input (the instructions are not
items: they stay). A drop point, once chosen, stays for the turns after it (each turn's
fact carries it), so they send the same prefix and the backend's cache hits; only when
the input no longer fits does it move, far enough to free at least a quarter of the
window. A cut never leaves a tool output without its call: it moves to the next user
message when there is one, else past any output at the front.

A turn in progress that alone does not fit (a long tool loop after the last user
message) is cut inside, as the front is: everything before its user message goes, then
its oldest whole items after that message (`skipped`), never a call without its output
nor an output without its call; the instructions and the user message stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from ocxproxy.model import forget_oldest

NEAR = 0.85  # without a parent's usage, an estimate past this share of the room is counted
STEP = 0.25  # a drop frees at least this share of the window
OUTPUT_SHARE = 0.125  # room kept for the answer when the request sets no max_output_tokens
LOW_RATIO = 2.0  # bytes per token assumed before a backend's usage says otherwise
BOOK_SIZE = 100_000  # facts kept (the oldest leave first): ~100 bytes each
BOOK_SLACK = 64  # past its size, a book lets its oldest go in batches of size // this
_TOKENS = (1 << 32) - 1  # a packed fact's tokens (below its size)
_fact = tuple.__new__  # a Fact from its three values, without NamedTuple's Python __new__


@dataclass(frozen=True, slots=True)
class Cut:
    """The items a forwarded input leaves out: `dropped` at the front of the expanded
    input, `skipped` after the first item kept (its turn's user message). `mark` is a hash
    of that first kept item's bytes: a later input is cut the same way only if it still
    has that item there."""

    dropped: int = 0
    skipped: int = 0
    mark: int = 0

    @property
    def items(self) -> int:
        """How many items are left out (it grows whenever the cut moves)."""
        return self.dropped + self.skipped


NO_CUT = Cut()


class Fact(NamedTuple):
    """What a finished turn tells the next one (a tuple: the book makes one from a packed
    int on every lookup, a few times a turn)."""

    tokens: int  # input + output tokens its backend reported
    size: int  # the bytes they stand for: its forwarded body + its output (estimated)
    cut: Cut = NO_CUT  # the items its body left out


class TokenBook:
    """Facts of recent turns and each backend's bytes per token, in memory (a restart
    costs each chain one estimate from bytes). A fact is kept under the key its next turn
    looks it up by: the response id, a conversation's id, or the caller's
    `prompt_cache_key` for inputs sent in full (http/window.py `book_keys`)."""

    def __init__(self, size: int = BOOK_SIZE) -> None:
        self.size = size
        self.most = size + size // BOOK_SLACK  # past this, down to `size` at once
        # A fact without a cut (most) is kept as one int, `size << 32 | tokens`: 32 bytes
        # where a Fact and its two ints are 120 (100,000s of turns).
        self.facts: dict[str, Fact | int] = {}
        self.ratios: dict[str, float] = {}

    def get(self, key: str) -> Fact | None:
        fact = self.facts.get(key)
        if type(fact) is int:
            return _fact(Fact, (fact & _TOKENS, fact >> 32, NO_CUT))
        return fact  # type: ignore[return-value]

    def put(self, key: str, fact: Fact) -> None:
        facts = self.facts
        facts.pop(key, None)  # a key put again is the newest
        tokens, size = fact.tokens, fact.size
        if fact.cut is NO_CUT and 0 <= tokens <= _TOKENS and size >= 0:
            facts[key] = size << 32 | tokens
        else:
            facts[key] = fact
        if len(facts) > self.most:
            forget_oldest(facts, self.size)

    def learn(self, backend: str, n_bytes: int, tokens: int) -> None:
        """A turn's forwarded body was `n_bytes` and `tokens` input tokens: the ratio,
        smoothed over turns."""
        if tokens <= 0 or n_bytes <= 0:
            return
        seen = n_bytes / tokens
        old = self.ratios.get(backend)
        self.ratios[backend] = seen if old is None else 0.8 * old + 0.2 * seen

    def ratio(self, backend: str | None) -> float:
        if backend is not None and backend in self.ratios:
            return self.ratios[backend]
        return min(self.ratios.values(), default=LOW_RATIO)


def estimate(fact: Fact | None, size: int, ratio: float) -> tuple[int, int]:
    """Tokens of a body of `size` bytes whose parent turn left `fact`, and by how much
    the estimate may be off: a quarter of what was estimated from bytes (the parent's
    tokens were reported), or, without a fact, enough to count anything near the window."""
    if fact is None:
        tokens = math.ceil(size / min(ratio, LOW_RATIO))
        return tokens, math.ceil(tokens * (1 - NEAR) / NEAR)
    added = math.ceil((size - fact.size) / ratio)
    return max(0, fact.tokens + added), abs(added) // 4 + 16


def room(window: int, max_output_tokens: Any) -> int:
    """Input tokens that fit: the window less the room the answer needs."""
    if isinstance(max_output_tokens, int) and max_output_tokens > 0:
        reserve = min(max_output_tokens, window // 2)
    else:
        reserve = int(window * OUTPUT_SHARE)
    return window - reserve


def drop_point(
    items: list[Any], sizes: list[int], tokens: int, dropped: int, keep: int, target: int
) -> int | None:
    """How many items to drop from the front of `items` (their serialized `sizes`) so
    that the input, `tokens` long with `dropped` items dropped, is at most `target`
    tokens; the last `keep` items (the turn in progress) are never dropped. None when
    even that is not enough."""
    kept_bytes = sum(sizes[dropped:])
    if kept_bytes <= 0:
        return None
    per_byte = tokens / kept_bytes  # the head's tokens (instructions, tools) spread too
    last = len(items) - keep  # the first item that must stay
    total: float = tokens
    cut = dropped
    while cut < last and total > target:
        total -= sizes[cut] * per_byte
        cut += 1
    if total > target:
        return None
    return _safe_cut(items, cut, last)


def kept(items: list[Any], dropped: int, skipped: int) -> list[Any]:
    """What a cut leaves of `items`: from `dropped` on, less the `skipped` items after the
    first of them."""
    if not skipped:
        return items[dropped:]
    return [*items[dropped : dropped + 1], *items[dropped + 1 + skipped :]]


def kept_sizes(sizes: list[int], dropped: int, skipped: int) -> list[int]:
    """`sizes` with the items a cut leaves out at 0 (so sums over any range count only
    what is forwarded)."""
    start = dropped + 1
    return [*[0] * dropped, *sizes[dropped:start], *[0] * skipped, *sizes[start + skipped :]]


def inner_point(
    items: list[Any], sizes: list[int], tokens: int, start: int, skipped: int, target: int
) -> int | None:
    """The turn in progress alone, `items[start:]` less the `skipped` items after its user
    message at `start`, is `tokens` long: how many items after that message to leave out
    (the oldest first) so that it is at most `target` tokens. The last item stays, with
    its call or output; None when even that is not enough."""
    kept_bytes = sum(sizes[start:]) - sum(sizes[start + 1 : start + 1 + skipped])
    if kept_bytes <= 0:
        return None
    per_byte = tokens / kept_bytes
    pairs = _pairs(items, start + 1)
    last = _paired(pairs, len(items) - 1, forward=False)  # the last item and its call stay
    total: float = tokens
    cut = start + 1 + skipped
    while cut < last and total > target:
        total -= sizes[cut] * per_byte
        cut += 1
    cut = _paired(pairs, cut, forward=True)  # past the output whose call is gone
    if cut > last:
        return None
    total = tokens - sum(sizes[start + 1 + skipped : cut]) * per_byte
    return cut - start - 1 if total <= target else None


def _pairs(items: list[Any], start: int) -> list[tuple[int, int]]:
    """The positions of each tool call from `start` on and of its output."""
    calls: dict[Any, int] = {}
    pairs: list[tuple[int, int]] = []
    for index in range(start, len(items)):
        item = items[index]
        call_id = item.get("call_id") if isinstance(item, dict) else None
        if call_id is None:
            continue
        if _is_output(item):
            if call_id in calls:
                pairs.append((calls[call_id], index))
        else:
            calls.setdefault(call_id, index)
    return pairs


def _paired(pairs: list[tuple[int, int]], cut: int, *, forward: bool) -> int:
    """The nearest cut from `cut` on (or back) that parts no call from its output."""
    while True:
        straddled = [pair for pair in pairs if pair[0] < cut <= pair[1]]
        if not straddled:
            return cut
        if forward:
            cut = max(second for _, second in straddled) + 1
        else:
            cut = min(first for first, _ in straddled)


def _safe_cut(items: list[Any], cut: int, last: int) -> int:
    """The cut moved forward to the next user message (up to the request's own items),
    else past any tool output at the front, whose call would be gone."""
    for index in range(cut, last + 1):
        if index == len(items) or _is_user_message(items[index]):
            return index
    while cut < len(items) and _is_output(items[cut]):
        cut += 1
    return cut


def _is_user_message(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and item.get("role") == "user"
        and item.get("type", "message") == "message"
    )


def _is_output(item: Any) -> bool:
    kind = item.get("type") if isinstance(item, dict) else None
    return isinstance(kind, str) and kind.endswith("_output")


def step_target(window: int, fit: int) -> int:
    """What a drop aims at: `fit`, less a quarter of the window, so the turns after it
    grow into the room freed before the point has to move again."""
    return max(0, fit - int(window * STEP))
