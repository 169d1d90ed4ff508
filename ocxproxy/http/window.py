"""A create's input against its backend's context window (CONTRACT.md C10): estimated on
every turn (no round trip), counted by the backend only near the window; with
`truncation: "auto"`, whole items dropped from the front (continuation/window.py says
how and why); with `disabled`, a counted overflow refused before any generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ocxproxy.continuation.expand import Request, expand, raw_input_items, tail_as_sent
from ocxproxy.continuation.window import (
    NO_CUT,
    Cut,
    Fact,
    drop_point,
    estimate,
    inner_point,
    kept,
    kept_sizes,
    room,
    step_target,
)
from ocxproxy.errors import InvalidRequest
from ocxproxy.http.context import Proxy
from ocxproxy.model import Record
from ocxproxy.upstream.fleet import Backend
from ocxproxy.upstream.window import Window

MAX_STEPS = 4  # drop, count again: a step whose estimate fell short is followed by another


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"

    def __init__(self) -> None:
        super().__init__(
            "Your input exceeds the context window of this model. "
            "Please adjust your input and try again.",
            param="input",
        )


@dataclass(frozen=True, slots=True)
class BookKeys:
    """Where a turn finds its predecessor's fact (`get`) and leaves its own (`put`; None:
    under its response id, which its continuation names)."""

    get: str | None
    put: str | None


def book_keys(
    scope: str, request: Request, parent: Record | None, conversation_id: str | None
) -> BookKeys:
    """A chain's turn follows its parent's response id; a conversation's turn, the
    conversation; an input sent in full (Codex over HTTP), the caller's
    `prompt_cache_key`, its session's name."""
    if conversation_id is not None:
        return BookKeys(conversation_id, conversation_id)
    if parent is not None:
        return BookKeys(parent.id, None)
    cache_key = request.body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        key = f"{scope}:{cache_key}"
        return BookKeys(key, key)
    return BookKeys(None, None)


async def fit_window(
    proxy: Proxy,
    request: Request,
    parent: Record | None,
    key: str | None,
    history: list[bytes],
    tail: list[bytes] | None,
    body: bytes,
    raw: bytes | None,
) -> tuple[bytes, Cut]:
    """The body to forward, and the items it leaves out. `key`: where the fact of the turn
    before is (`BookKeys.get`)."""
    found = proxy.pool.window_for(parent.backend if parent is not None else None)
    if found is None:
        return body, NO_CUT  # no window known: the backend's answer decides
    backend, window = found
    assert window.tokens is not None
    book = proxy.book
    fact = book.get(key) if key is not None else None
    auto = request.body.get("truncation") == "auto"
    fit = room(window.tokens, request.body.get("max_output_tokens"))
    dropped, skipped = (fact.cut.dropped, fact.cut.skipped) if fact is not None and auto else (0, 0)
    items: list[bytes] | None = None
    if dropped or skipped:
        items = _items(request, history, tail, raw)
        assert fact is not None
        if dropped >= len(items) or hash(items[dropped]) != fact.cut.mark:
            fact, dropped, skipped = None, 0, 0  # another input than the fact's
        else:
            skipped = min(skipped, max(0, len(items) - dropped - 2))
            body = expand(request.body, kept(items, dropped, skipped), [])
    tokens, margin = estimate(fact, len(body), book.ratio(backend.url))
    # The common case, no round trip: it fits (auto), or is short of the window, which
    # is all that disabled refuses at.
    if tokens + margin <= (fit if auto else window.tokens - 1):
        return body, _cut(items, dropped, skipped)
    if not auto:
        counted = await _count(proxy, backend, window, body)
        if counted is not None and counted >= window.tokens:
            proxy.metrics.context_refusals.labels(truncation="disabled").inc()
            raise ContextLengthExceeded
        return body, NO_CUT  # an estimate alone refuses nothing
    if tokens - margin <= fit:  # it may fit: the backend's count decides
        counted = await _count(proxy, backend, window, body)
        tokens = counted if counted is not None else tokens
        if tokens <= fit:
            return body, _cut(items, dropped, skipped)
    if items is None:
        items = _items(request, history, tail, raw)
    parsed = orjson.loads(b"[" + b",".join(items) + b"]")
    sizes = [len(item) + 1 for item in items]
    last_user = _last_user_message(parsed)
    target = step_target(window.tokens, fit)
    for _ in range(MAX_STEPS):
        forwarded = sum(kept_sizes(sizes, dropped, skipped))
        cut = drop_point(
            parsed,
            kept_sizes(sizes, dropped, skipped),
            tokens,
            dropped,
            len(items) - last_user,
            target,
        )
        if cut is not None and cut < len(items):
            dropped, skipped = cut, 0
        else:  # the turn in progress alone is too long: cut inside it
            if last_user != dropped:
                dropped, skipped = last_user, 0
            at_turn = sum(kept_sizes(sizes, dropped, skipped)) * tokens // max(1, forwarded)
            inner = inner_point(parsed, sizes, at_turn, dropped, skipped, target)
            if inner is None:
                proxy.metrics.context_refusals.labels(truncation="auto").inc()
                raise ContextLengthExceeded
            skipped = inner
        body = expand(request.body, kept(items, dropped, skipped), [])
        tokens = sum(kept_sizes(sizes, dropped, skipped)) * tokens // max(1, forwarded)
        counted = await _count(proxy, backend, window, body)
        if counted is None or counted <= fit:
            break
        tokens = counted
    proxy.metrics.truncations.inc()
    return body, _cut(items, dropped, skipped)


def _cut(items: list[bytes] | None, dropped: int, skipped: int) -> Cut:
    if items is None or not (dropped or skipped):
        return NO_CUT
    return Cut(dropped, skipped, hash(items[dropped]))


async def passes_threshold(
    proxy: Proxy, parent: Record | None, key: str | None, body: bytes, threshold: int
) -> bool:
    """Whether a forwarded body passes `context_management`'s `threshold` tokens: the
    estimate `fit_window` makes, and the backend's count when the estimate cannot tell."""
    found = proxy.pool.window_for(parent.backend if parent is not None else None)
    url = found[0].url if found is not None else parent.backend if parent is not None else None
    fact = proxy.book.get(key) if key is not None else None
    tokens, margin = estimate(fact, len(body), proxy.book.ratio(url))
    if tokens + margin <= threshold or tokens - margin > threshold:
        return tokens > threshold
    if found is not None and found[1].tokens is not None:
        counted = await _count(proxy, found[0], found[1], body)
        if counted is not None:
            return counted > threshold
    return tokens > threshold


def remember_usage(
    proxy: Proxy,
    response: Any,
    backend: str,
    body: bytes,
    cut: Cut,
    input_tokens: int,
    key: str | None,
) -> None:
    """A finished turn's usage: the fact its continuation is estimated from (kept under
    `key`, `BookKeys.put`, or its response id), and the backend's bytes per token."""
    usage = response.get("usage")
    output = usage.get("output_tokens") if isinstance(usage, dict) else None
    response_id = response.get("id")
    if not isinstance(output, int) or not isinstance(response_id, str):
        return
    book = proxy.book
    book.learn(backend, len(body), input_tokens)
    size = len(body) + int(output * book.ratio(backend))
    book.put(key or response_id, Fact(input_tokens + output, size, cut))


async def _count(proxy: Proxy, backend: Backend, window: Window, body: bytes) -> int | None:
    return await proxy.pool.windows.count(backend, window, orjson.loads(body))


def _items(
    request: Request, history: list[bytes], tail: list[bytes] | None, raw: bytes | None
) -> list[bytes]:
    """The expanded input, one serialized item each."""
    stored = raw_input_items(b'{"input":[' + b",".join(history) + b"]}") if history else []
    if tail is None:
        tail = tail_as_sent(raw, request) if raw is not None else []
    return [*(stored or []), *tail]


def _last_user_message(items: list[Any]) -> int:
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if isinstance(item, dict) and item.get("role") == "user":
            return index
    return max(0, len(items) - 1)
