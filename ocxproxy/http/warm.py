"""Warm resume on the request path (CONTRACT.md C12): a continuation the backend has lost
gets its chain's saved KV state restored first (upstream/kvsave.py), and every
continuation's cached tokens are compared with the prefix its parent left, a shortfall
counted by reason (upstream/misses.py); an acknowledged durable turn is saved off the
reply path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from ocxproxy.model import Record, shared
from ocxproxy.upstream.misses import Served, head_of, miss_of

if TYPE_CHECKING:
    from ocxproxy.http.exchange import Exchange

PIN: Final = b'{"id_slot":0,'  # the restored slot (the embedded backend has one)


async def resume(exchange: Exchange) -> None:
    """Before a continuation is sent: when its chain's longest saved prefix is not in the
    backend's cache (the backend started since), restore it into the slot and pin the
    request there. A save of another fingerprint is dropped and noted; any failure
    leaves the turn to a full prefill."""
    saves, parent = exchange.proxy.kv_saves, exchange.parent
    if saves is None or parent is None:
        return
    save = saves.saved_for(parent.id)
    if save is None:
        return
    exchange.cache_expect = save.tokens
    if saves.mismatched(save):
        exchange.cache_note = "fingerprint_mismatch"
        return
    if not saves.restoring:
        return
    outcome = await saves.restore(save)
    if outcome is not None and exchange.body[:1] == b"{" and exchange.body[1:2] != b"}":
        exchange.restored = outcome
        exchange.body = PIN + exchange.body[1:]


def check_cache(exchange: Exchange, response: Any, input_tokens: int, cached: int | None) -> None:
    """Verify a restore by the cached tokens; compare a continuation's cached tokens with
    the prefix its parent left (the parent's window fact and `Served`, in memory; else
    what a save held), count a shortfall by reason; then remember where this turn left
    its own prefix. Called with the usage `observe_usage` read, after the window's fact
    of this turn is put."""
    backend = exchange.backend
    response_id = response.get("id")
    if backend is None or not isinstance(response_id, str):
        return
    proxy = exchange.proxy
    book = proxy.cache_book
    head = shared(head_of(exchange.request.body))  # (kept in the book: one object a value)
    parent = exchange.parent
    if cached is not None and parent is not None:
        restored = exchange.restored
        saves = proxy.kv_saves
        took = restored is not None and saves is not None and saves.verify(restored, cached)
        if restored is not None and not took:
            exchange.cache_note = "restore_failed"
        served, fact = book.get(parent.id), proxy.book.get(parent.id)
        found: tuple[Served, int, int] | None = None
        if served is not None and fact is not None:
            found = served, fact.tokens, fact.cut.items
        elif exchange.cache_expect is not None:  # the proxy restarted: what was saved
            # Served in an earlier start of the backend (-1: no epoch of this one).
            found = Served(backend.url, -1, head), exchange.cache_expect, exchange.cut.items
        if found is not None:
            served, prefix, dropped = found
            if took and restored is not None:  # the tail since the chain's last save is
                prefix = min(prefix, restored.tokens)  # not saved: computed again by design
            metrics = proxy.metrics
            metrics.cache_checks.inc()
            miss = miss_of(
                served,
                prefix,
                dropped,
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
    book.put(response_id, Served(backend.url, backend.epoch, head, exchange.scope))


def save_after(exchange: Exchange, record: Record) -> None:
    """`record`, the turn, is durable and about to be acknowledged: its chain's KV state
    is saved off the reply path when it grew enough. store:false turns, and every turn
    under --zdr, are never durable, so never saved."""
    saves = exchange.proxy.kv_saves
    if saves is None or record is None or not record.durable or exchange.backend is None:
        return
    if exchange.backend.url != saves.url:
        return
    fact = exchange.proxy.book.get(record.id)
    if fact is None:
        return
    parent = exchange.parent.id if exchange.parent is not None else None
    saves.after_turn(
        record.id,
        parent,
        record.scope,
        fact.tokens,
        lambda: (segment.key for segment in record.segments),
    )
