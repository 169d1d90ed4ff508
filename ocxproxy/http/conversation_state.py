"""Conversations on the Store: read one, create, append, rewrite, and its lock.

A conversation is a record the store keeps until deleted (`Store.keep`): its chain holds
the items (segments, bytes as forwarded), its response segment the `Meta` (created_at,
metadata, item ids). Every write replaces the record; segments are shared, so appending a
turn adds one segment and deleting an item rewrites only the segment that holds it.
Used by the routes (http/conversations.py) and, through `ConversationTurn`, by the create
turn (http/exchange.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from ocxproxy.continuation.affinity import ROOT_KEY
from ocxproxy.continuation.conversation import (
    Meta,
    assign_ids,
    is_conversation_id,
    new_conversation_id,
    not_found_message,
    split_items,
)
from ocxproxy.continuation.expand import call_ids_of, serialize_items
from ocxproxy.continuation.locks import Lease, Leases
from ocxproxy.continuation.record import item_ids_of
from ocxproxy.errors import (
    Conflict,
    ConversationLocked,
    FailureReason,
    NotFound,
    OcxError,
    StorageUnavailable,
    StoreFailure,
    StoreFull,
)
from ocxproxy.http.context import Proxy
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store import Store

log = logging.getLogger("ocxproxy.responses")


@dataclass(slots=True)
class Conversation:
    record: Record
    meta: Meta

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments holding items, one per `meta.ids` entry (the store keeps an empty
        conversation's chain as one empty segment)."""
        segments = self.record.segments
        return () if len(segments) == 1 and not segments[0].size else segments


async def load(store: Store, scope: str, conversation_id: str) -> Conversation:
    """The caller's conversation, or NotFound (another credential's is unknown too)."""
    if not is_conversation_id(conversation_id):
        raise _not_found(conversation_id)
    try:
        record = store.record(scope, conversation_id)
        meta = Meta.decode(await store.response_bytes(record))
    except StoreFailure as failure:
        if failure.reason == FailureReason.UNKNOWN:
            raise _not_found(conversation_id) from None
        raise unreadable(failure) from None
    return Conversation(record, meta)


def _not_found(conversation_id: str) -> NotFound:
    return NotFound(not_found_message(conversation_id), param="conversation_id")


def unreadable(failure: StoreFailure) -> OcxError:
    return OcxError(f"The conversation's stored items could not be read ({failure.reason}).")


def lock(leases: Leases, conversation_id: str) -> Lease:
    lease = leases.acquire(conversation_id)
    if lease is None:
        raise ConversationLocked()
    return lease


def new_segment(items: list[Any]) -> Segment:
    parts = serialize_items(items)
    return Segment(
        b",".join(parts),
        len(parts),
        call_ids_of(items),
        durable=False,
        item_ids=item_ids_of(parts, items),
    )


def create(store: Store, scope: str, items: list[Any], metadata: dict[str, str]) -> Conversation:
    conversation_id = new_conversation_id()
    meta = Meta(int(time.time()), metadata)
    chain: tuple[Segment, ...] = ()
    if items:
        chain = (new_segment(items),)
        meta.ids.append(assign_ids(items, set()))
    return _write(store, conversation_id, scope, chain, meta, backend=None)


def append(
    store: Store,
    conversation: Conversation,
    segment: Segment,
    items: list[Any],
    *,
    backend: str | None = None,
    force: bool = False,
) -> Conversation:
    """The conversation with one more segment (its `items`, parsed, for their ids);
    `force` for a turn already answered (taken even past the store's caps)."""
    meta = Meta(
        conversation.meta.created_at,
        conversation.meta.metadata,
        [*conversation.meta.ids, assign_ids(items, conversation.meta.all_ids())],
    )
    chain = (*conversation.segments, segment)
    return _write(
        store, conversation.id, conversation.record.scope, chain, meta, backend=backend, force=force
    )


def set_metadata(
    store: Store, conversation: Conversation, metadata: dict[str, str]
) -> Conversation:
    meta = Meta(conversation.meta.created_at, metadata, conversation.meta.ids)
    record = conversation.record
    return _write(
        store, record.id, record.scope, conversation.segments, meta, backend=record.backend
    )


async def delete_item(store: Store, conversation: Conversation, item_id: str) -> Conversation:
    """Rewrite only the segment holding the item (the later ones stay the same objects)."""
    where = conversation.meta.find(item_id)
    if where is None:
        raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")
    seg_index, index = where
    record = conversation.record
    segment = conversation.segments[seg_index]
    (data,) = await _read(store, (segment,))
    spans = split_items(data)
    del spans[index]
    ids = [list(ids) for ids in conversation.meta.ids]
    del ids[seg_index][index]
    chain = list(conversation.segments)
    if spans:
        kept = orjson.loads(b"[" + b",".join(spans) + b"]")
        chain[seg_index] = Segment(
            b",".join(spans),
            len(spans),
            call_ids_of(kept),
            durable=False,
            item_ids=item_ids_of(spans, kept),
        )
    else:
        del chain[seg_index], ids[seg_index]
    meta = Meta(conversation.meta.created_at, conversation.meta.metadata, ids)
    return _write(store, record.id, record.scope, tuple(chain), meta, backend=record.backend)


async def items(store: Store, conversation: Conversation) -> list[tuple[str, Any]]:
    """(id, item) of every item, oldest first."""
    datas = await _read(store, conversation.segments)
    pairs: list[tuple[str, Any]] = []
    for ids, data in zip(conversation.meta.ids, datas, strict=True):
        values = orjson.loads(b"[" + data + b"]")
        pairs.extend(zip(ids, values, strict=True))
    return pairs


async def _read(store: Store, segments: tuple[Segment, ...]) -> list[bytes]:
    try:
        return await store.segment_bytes(segments)
    except StoreFailure as failure:
        raise unreadable(failure) from None


def _write(
    store: Store,
    conversation_id: str,
    scope: str,
    chain: tuple[Segment, ...],
    meta: Meta,
    *,
    backend: str | None,
    force: bool = False,
) -> Conversation:
    try:
        record = store.keep(
            conversation_id,
            scope,
            chain,
            meta.encode(),
            created_at=meta.created_at,
            backend=backend,
            affinity_key=ROOT_KEY + conversation_id,
            force=force,
        )
    except StoreFailure as failure:
        if failure.reason == FailureReason.FULL:
            raise _full() from None
        raise unreadable(failure) from None
    return Conversation(record, meta)


def check_room(store: Store, conversation: Conversation, extra: int) -> None:
    """StoreFull unless the conversation can grow by `extra` bytes (a turn's own items,
    checked before it runs) without a cap having to drop conversation items."""
    if not store.room_for(conversation.id, extra):
        raise _full()


def _full() -> StoreFull:
    return StoreFull(
        "The store is full: taking this write would drop conversation items. "
        "Delete conversations or raise --max-disk-bytes / --max-entries."
    )


@dataclass(slots=True)
class ConversationTurn:
    """A create turn's hold on its conversation: the lock, from before anything is
    forwarded until the turn ends, and the append of the answered turn."""

    proxy: Proxy
    lease: Lease | None
    conversation: Conversation

    def renew(self) -> None:
        if self.lease is not None:
            self.proxy.leases.renew(self.lease)

    def release(self) -> None:
        """Let the conversation go (idempotent): on completion, failure, cancel, disconnect."""
        if self.lease is not None:
            self.proxy.leases.release(self.lease)
            self.lease = None

    def append(self, scope: str, turn: Turn, items: list[Any], backend: str | None) -> Record:
        """The conversation's new record, with the turn's items appended (as one segment,
        the bytes the turn's record holds too): even past the store's caps (their room was
        checked before the turn, for its own items). A conversation another writer changed
        meanwhile (its lease ran out) is a 409 Conflict; a write the store refused, 503."""
        conversation, store = self.conversation, self.proxy.store
        try:
            current = store.record(scope, conversation.id)
        except StoreFailure:
            current = None
        if current is not conversation.record:  # deleted, or written by a lease-breaker
            log.warning("conversation %s changed during a turn; not appended", conversation.id)
            raise Conflict(
                "The conversation changed while this response was generated (its lock ran "
                "out and another request wrote to it); the response was not added to it. "
                "Retry the request.",
                param="conversation",
                code="conversation_changed",
            )
        segment = Segment(
            turn.items, turn.n_items, turn.call_ids, durable=False, item_ids=turn.item_ids
        )
        try:
            self.conversation = append(
                store, conversation, segment, items, backend=backend, force=True
            )
        except OcxError as error:
            log.error("conversation %s: turn not appended: %s", conversation.id, error)
            raise StorageUnavailable(
                "The response could not be added to its conversation: the proxy's storage "
                "failed. Nothing was saved; retry later."
            ) from None
        return self.conversation.record


async def open_turn(
    proxy: Proxy, scope: str, conversation_id: str, *, locked: bool = True
) -> tuple[ConversationTurn, list[bytes]]:
    """A create turn on a conversation: its lock (400 conversation_locked while another
    turn or write holds it) and its items' bytes, spliced in front of the input like a
    chain's. Without `locked`, a read (a sibling of create, which appends nothing)."""
    lease = lock(proxy.leases, conversation_id) if locked else None
    try:
        conversation = await load(proxy.store, scope, conversation_id)
        try:
            history = await proxy.store.history(conversation.record)
        except StoreFailure as failure:
            raise unreadable(failure) from None
    except BaseException:
        if lease is not None:
            proxy.leases.release(lease)
        raise
    return ConversationTurn(proxy, lease, conversation), history
