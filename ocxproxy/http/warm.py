"""Warm resume on the request path (CONTRACT.md C12): what a finished turn tells the next
about its backend's cache, and the count of continuations whose prefix was not cached,
by reason (upstream/misses.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ocxproxy.upstream.misses import Served, head_of, miss_of

if TYPE_CHECKING:
    from ocxproxy.http.exchange import Exchange


def check_cache(exchange: Exchange, response: Any, input_tokens: int, cached: int | None) -> None:
    """Compare a continuation's cached tokens with the prefix its parent left (the parent's
    window fact and `Served`: both in memory), count a shortfall by reason; then remember
    where this turn left its own prefix. Called with the usage `observe_usage` read, after
    the window's fact of this turn is put."""
    backend = exchange.backend
    response_id = response.get("id")
    if backend is None or not isinstance(response_id, str):
        return
    proxy = exchange.proxy
    book = proxy.cache_book
    head = head_of(exchange.request.body)
    parent = exchange.parent
    if cached is not None and parent is not None:
        served, fact = book.get(parent.id), proxy.book.get(parent.id)
        if served is not None and fact is not None:
            metrics = proxy.metrics
            metrics.cache_checks.inc()
            miss = miss_of(
                served,
                fact.tokens,
                fact.cut.items,
                backend=backend.url,
                epoch=backend.epoch,
                head=head,
                dropped=exchange.cut.items,
                compacted=exchange.injection is not None or exchange.compaction,
                note=exchange.cache_note,
                input_tokens=input_tokens,
                cached=cached,
            )
            if miss is not None:
                metrics.cache_misses.labels(reason=miss.reason).inc()
                metrics.cache_missed_tokens.labels(reason=miss.reason).inc(
                    miss.expected - miss.cached
                )
    book.put(response_id, Served(backend.url, backend.epoch, head))
