"""Warm resume on the request path (CONTRACT.md C12): a continuation the backend has lost
gets its chain's saved KV state restored first, on whichever backend of those that
save into the directory it is routed to (upstream/kvsave.py), and every
continuation's cached tokens are compared with the prefix its parent left, a shortfall
counted by reason (upstream/misses.py); an acknowledged durable turn is saved off the
reply path."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from ocxproxy.model import Record, shared
from ocxproxy.upstream.misses import Served, head_of, miss_of

if TYPE_CHECKING:
    from ocxproxy.http.exchange import Exchange
    from ocxproxy.upstream.fleet import Backend

PIN: Final = b'{"id_slot":0,'  # the restored slot (the embedded backend has one)


async def resume(exchange: Exchange, backend: Backend) -> bytes | None:
    """Before a continuation is sent to `backend` (the pool's `prepare`): when its
    chain's longest saved prefix is not in that backend's cache (it started since, or the
    chain was served on another one), restore it into the slot; the request, pinned
    there, is returned. An external llama-server that should hold the chain is asked
    first whether it was started again unseen (`KvSaves.restarted`): a miss there would
    cost the whole prefill, the question one local round trip. A save of another
    fingerprint is noted; any failure leaves the turn to a full prefill."""
    exchange.restored = None  # (one on a backend that failed this request before)
    saves, chain = exchange.proxy.kv_saves, chain_of(exchange)
    if saves is None or chain is None:
        return None
    found = saves.saved_for(chain, backend.url)
    if found is None and saves.unsure(chain, backend.url):
        if await saves.restarted(backend.url):  # a new epoch: its saves are not cached
            exchange.proxy.pool.fleet.restarted(backend)
        found = saves.saved_for(chain, backend.url)
    if found is None:
        return None
    save, slots = found
    exchange.cache_expect = save.tokens
    if saves.mismatched(save, slots):
        exchange.cache_note = "fingerprint_mismatch"
        return None
    if not slots.restoring:
        return None
    outcome = await saves.restore(save, slots)
    body = exchange.body
    if outcome is None or body[:1] != b"{" or body[1:2] == b"}":
        return None
    exchange.restored = outcome
    if not body.startswith(PIN):  # (pinned already when an earlier backend failed)
        exchange.body = PIN + body[1:]
    return exchange.body


def conversation_of(exchange: Exchange) -> str | None:
    """The conversation a turn reads and appends to, if any."""
    held = exchange.conversation
    return held.conversation.id if held is not None else None


def chain_of(exchange: Exchange) -> str | None:
    """What the chain a turn continues is known by, in the cache book, the window's facts
    and the saves: its conversation (a conversation's turns all chain on its record), else
    its parent response; None for a first turn."""
    conversation = conversation_of(exchange)
    if conversation is not None:
        return conversation
    return exchange.parent.id if exchange.parent is not None else None


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
    chain = chain_of(exchange)
    if cached is not None and chain is not None:
        restored = exchange.restored
        saves = proxy.kv_saves
        took = restored is not None and saves is not None and saves.verify(restored, cached)
        if restored is not None and not took:
            exchange.cache_note = "restore_failed"
        served, fact = book.get(chain), proxy.book.get(chain)
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
    here = Served(backend.url, backend.epoch, head, exchange.scope)
    book.put(response_id, here)
    conversation = conversation_of(exchange)
    if conversation is not None and exchange.request.store:  # what its next turn follows
        book.put(conversation, replace(here, turn=response_id))


def save_after(exchange: Exchange, record: Record) -> None:
    """`record`, the turn, is durable and about to be acknowledged: its chain's KV state
    is saved off the reply path when it grew enough. store:false turns, and every turn
    under --zdr, are never durable, so never saved."""
    saves = exchange.proxy.kv_saves
    if saves is None or record is None or not record.durable or exchange.backend is None:
        return
    conversation = conversation_of(exchange)
    key = conversation or record.id  # what the chain's next turn looks its save up by
    fact = exchange.proxy.book.get(key)
    if fact is None:
        return
    saves.after_turn(
        key,
        chain_of(exchange),
        record.scope,
        fact.tokens,
        lambda: (segment.key for segment in record.segments),
        exchange.backend.url,
    )
