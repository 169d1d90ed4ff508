"""Conversations on the Store: read one, create, append, rewrite, delete.

A conversation is a record the store keeps until deleted (`Store.keep`): its chain holds
the items (segments, bytes as forwarded), its response segment the `Meta`'s head
(created_at, metadata), `Record.ids` the item ids per segment. Every write replaces the
record; segments are shared, so appending a turn adds one segment (and journals its ids
only) and deleting an item rewrites only the segment that holds it.
Used by the routes (http/conversations.py) and by a create turn's `ConversationTurn`
(http/conversation_turn.py). With a shared store, the conversation and its writes are on
the server instead (store/shared/conversations.py): each write names the version it was
computed from, so one made after its lock lapsed and the conversation changed is refused
(409 `conversation_changed`).
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
from ocxproxy.model import Record, Segment
from ocxproxy.store import Store
from ocxproxy.store.shared.conversations import (
    ConversationRecord,
    SharedConversations,
    conversation_record,
    encode_entry,
    shared_conversations,
)

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


async def load(
    store: Store, scope: str, conversation_id: str, token: str = "", ttl: float = 0.0
) -> Conversation:
    """The caller's conversation, or NotFound (another credential's is unknown too); on a
    shared store, with its lease taken by `token` in the same round trip."""
    if not is_conversation_id(conversation_id):
        raise _not_found(conversation_id)
    shared = shared_conversations(store)
    try:
        if shared is not None:
            found = await shared.load(scope, conversation_id, token, ttl)
            if found is None:
                raise _not_found(conversation_id)
            return Conversation(found, _meta(found))
        record = store.record(scope, conversation_id)
        meta = Meta.decode(await store.response_bytes(record), record.ids)
    except StoreFailure as failure:
        if failure.reason == FailureReason.UNKNOWN:
            raise _not_found(conversation_id) from None
        raise unreadable(failure) from None
    return Conversation(record, meta)


def _meta(record: ConversationRecord) -> Meta:
    doc = orjson.loads(record.head)
    return Meta(doc["created_at"], doc["metadata"], [list(ids) for ids in record.ids])


def head_of(conversation_id: str, meta: Meta, backend: str | None) -> bytes:
    """A shared conversation's head: what the single-node store keeps in its record."""
    head = {"created_at": meta.created_at, "metadata": meta.metadata, "backend": backend}
    return orjson.dumps({**head, "affinity": ROOT_KEY + conversation_id})


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


async def create(
    store: Store, scope: str, items: list[Any], metadata: dict[str, str]
) -> Conversation:
    """A new conversation, durable when returned."""
    conversation_id = new_conversation_id()
    meta = Meta(int(time.time()), metadata)
    chain: tuple[Segment, ...] = ()
    if items:
        chain = (new_segment(items),)
        meta.ids.append(assign_ids(items, set()))
    shared = shared_conversations(store)
    if shared is not None:
        first = (chain[0], meta.ids[0]) if chain else None
        try:
            record = await shared.create(
                scope, conversation_id, head_of(conversation_id, meta, None), first
            )
        except StoreFailure as failure:
            raise _refused(failure) from None
        return Conversation(record, meta)
    return await _durable(store, _write(store, conversation_id, scope, chain, meta, backend=None))


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
    meta = appended(conversation, items)
    chain = (*conversation.segments, segment)
    return _write(
        store, conversation.id, conversation.record.scope, chain, meta, backend=backend, force=force
    )


def appended(conversation: Conversation, items: list[Any]) -> Meta:
    old = conversation.meta
    return Meta(old.created_at, old.metadata, [*old.ids, assign_ids(items, old.all_ids())])


async def add_items(store: Store, conversation: Conversation, items: list[Any]) -> Conversation:
    """The items appended (one segment), durable when returned."""
    segment = new_segment(items)
    shared = shared_conversations(store)
    if shared is None:
        return await _durable(store, append(store, conversation, segment, items))
    meta = appended(conversation, items)
    entries = [*entries_of(conversation), (segment, meta.ids[-1])]
    entry = encode_entry(segment, meta.ids[-1])
    return await _write_shared(shared, conversation, meta, entries, "append", entry)


async def set_metadata(
    store: Store, conversation: Conversation, metadata: dict[str, str]
) -> Conversation:
    meta = Meta(conversation.meta.created_at, metadata, conversation.meta.ids)
    record = conversation.record
    shared = shared_conversations(store)
    if shared is not None:
        return await _write_shared(shared, conversation, meta, entries_of(conversation), "meta")
    return await _durable(
        store,
        _write(store, record.id, record.scope, conversation.segments, meta, backend=record.backend),
    )


async def delete(store: Store, conversation: Conversation) -> None:
    shared = shared_conversations(store)
    if shared is not None:
        await _write_shared(shared, conversation, conversation.meta, [], "delete")
        return
    store.delete_nowait(conversation.record.scope, conversation.id, kept=True)
    await _commit(store, None)


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
    shared = shared_conversations(store)
    if shared is not None:
        entry = encode_entry(chain[seg_index], ids[seg_index]) if spans else b""
        entries = list(zip(chain, ids, strict=True))
        return await _write_shared(shared, conversation, meta, entries, "replace", seg_index, entry)
    written = _write(store, record.id, record.scope, tuple(chain), meta, backend=record.backend)
    return await _durable(store, written)


def entries_of(conversation: Conversation) -> list[tuple[Segment, list[str]]]:
    return list(zip(conversation.segments, conversation.meta.ids, strict=True))


async def _write_shared(
    shared: SharedConversations,
    conversation: Conversation,
    meta: Meta,
    entries: list[tuple[Segment, list[str]]],
    op: str,
    *args: Any,
) -> Conversation:
    """A write on the server, computed from `conversation` as read: refused (409) when
    it changed since (its lock lapsed and another writer got in)."""
    record = conversation.record
    assert isinstance(record, ConversationRecord)
    head = head_of(record.id, meta, record.backend)
    try:
        version = await shared.write(record, op, *args, head=head)
    except StoreFailure as failure:
        raise _refused(failure) from None
    if not version:
        raise changed()
    return Conversation(conversation_record(record.id, record.scope, head, version, entries), meta)


async def _durable(store: Store, conversation: Conversation) -> Conversation:
    """Ack mode: a write is durable before it is answered."""
    await _commit(store, conversation.record)
    return conversation


async def _commit(store: Store, record: Record | None) -> None:
    """(None: everything queued, a deletion.)"""
    try:
        await store.commit(record)
    except StoreFailure:
        raise StorageUnavailable(
            "The conversation could not be stored: the proxy's storage is unavailable. Retry later."
        ) from None


def _refused(failure: StoreFailure) -> OcxError:
    """A shared write the server refused: 507 when the byte budget could not take it."""
    if failure.reason == FailureReason.FULL:
        return store_full()
    return StorageUnavailable(
        "The conversation could not be stored: the proxy's storage is unavailable. Retry later."
    )


def store_full() -> StoreFull:
    return StoreFull(
        "The store is full: taking this write would drop conversation items. "
        "Delete conversations or raise --max-disk-bytes / --max-entries "
        "(--shared-max-bytes with a shared store)."
    )


def changed() -> Conflict:
    return Conflict(
        "The conversation changed while this response was generated (its lock ran "
        "out and another request wrote to it); the response was not added to it. "
        "Retry the request.",
        param="conversation",
        code="conversation_changed",
    )


async def items(store: Store, conversation: Conversation) -> list[tuple[str, Any]]:
    """(id, item) of every item, oldest first."""
    datas = await _read(store, conversation.segments)
    pairs: list[tuple[str, Any]] = []
    for ids, data in zip(conversation.meta.ids, datas, strict=True):
        values = orjson.loads(b"[" + data + b"]")
        pairs.extend(zip(ids, values, strict=True))
    return pairs


async def _read(store: Store, segments: tuple[Segment, ...]) -> list[bytes]:
    if shared_conversations(store) is not None:  # read whole with the conversation
        return [s.data or b"" for s in segments]
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
            ids=meta.ids,
            created_at=meta.created_at,
            backend=backend,
            affinity_key=ROOT_KEY + conversation_id,
            force=force,
        )
    except StoreFailure as failure:
        if failure.reason == FailureReason.FULL:
            raise store_full() from None
        raise unreadable(failure) from None
    return Conversation(record, meta)
