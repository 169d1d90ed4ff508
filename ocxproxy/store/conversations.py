"""Conversations as both stores hold them: the `Conversation` the HTTP layer reads and
writes, and what either implementation builds one from.

A conversation's items are segments (bytes as forwarded) and `Meta` its head (created_at,
metadata) and the ids of each segment's items. local/conversations.py keeps one as a
record the store keeps until deleted; shared/conversation_store.py keeps it on the server,
where each write names the version it was computed from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
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
from ocxproxy.continuation.record import item_ids_of
from ocxproxy.errors import (
    Conflict,
    FailureReason,
    NotFound,
    OcxError,
    StorageUnavailable,
    StoreFailure,
    StoreFull,
)
from ocxproxy.model import Record, Segment


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


def new_segment(items: list[Any]) -> Segment:
    parts = serialize_items(items)
    return Segment(
        b",".join(parts),
        len(parts),
        call_ids_of(items),
        durable=False,
        item_ids=item_ids_of(parts, items),
    )


def new_conversation(
    items: list[Any], metadata: dict[str, str]
) -> tuple[str, Meta, Segment | None]:
    """A new conversation's id, `Meta` and segment of its first items (None: no items)."""
    meta = Meta(int(time.time()), metadata)
    if not items:
        return new_conversation_id(), meta, None
    meta.ids.append(assign_ids(items, set()))
    return new_conversation_id(), meta, new_segment(items)


@contextlib.contextmanager
def loading(conversation_id: str) -> Iterator[None]:
    """Around a conversation's load: NotFound for an id that is none or that the store
    does not know (another credential's included), `unreadable` for any other failure."""
    if not is_conversation_id(conversation_id):
        raise not_found(conversation_id)
    try:
        yield
    except StoreFailure as failure:
        if failure.reason == FailureReason.UNKNOWN:
            raise not_found(conversation_id) from None
        raise unreadable(failure) from None


def with_metadata(conversation: Conversation, metadata: dict[str, str]) -> Meta:
    return Meta(conversation.meta.created_at, metadata, conversation.meta.ids)


def appended(conversation: Conversation, items: list[Any]) -> Meta:
    old = conversation.meta
    return Meta(old.created_at, old.metadata, [*old.ids, assign_ids(items, old.all_ids())])


def entries_of(conversation: Conversation) -> list[tuple[Segment, list[str]]]:
    return list(zip(conversation.segments, conversation.meta.ids, strict=True))


def head_of(conversation_id: str, meta: Meta, backend: str | None) -> bytes:
    """A shared conversation's head: what the single-node store keeps in its record."""
    head = {"created_at": meta.created_at, "metadata": meta.metadata, "backend": backend}
    return orjson.dumps({**head, "affinity": ROOT_KEY + conversation_id})


def without_item(
    conversation: Conversation, seg_index: int, index: int, data: bytes
) -> tuple[list[Segment], Meta, bool]:
    """The conversation's chain and `Meta` with item `index` of segment `seg_index` (whose
    bytes are `data`) cut out: that segment rewritten (the others the same objects), or
    gone when it held only that item (False)."""
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
    return chain, Meta(conversation.meta.created_at, conversation.meta.metadata, ids), bool(spans)


def item_items(conversation: Conversation, datas: list[bytes]) -> list[tuple[str, Any]]:
    """(id, item) of every item, oldest first, from each segment's bytes."""
    pairs: list[tuple[str, Any]] = []
    for ids, data in zip(conversation.meta.ids, datas, strict=True):
        values = orjson.loads(b"[" + data + b"]")
        pairs.extend(zip(ids, values, strict=True))
    return pairs


def not_found(conversation_id: str) -> NotFound:
    return NotFound(not_found_message(conversation_id), param="conversation_id")


def item_not_found(item_id: str) -> NotFound:
    return NotFound(f"Item with id '{item_id}' not found.", param="item_id")


def unreadable(failure: StoreFailure) -> OcxError:
    return OcxError(f"The conversation's stored items could not be read ({failure.reason}).")


def unavailable() -> StorageUnavailable:
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


def not_appended() -> StorageUnavailable:
    return StorageUnavailable(
        "The response could not be added to its conversation: the proxy's storage "
        "failed. Nothing was saved: neither the response nor the conversation's new "
        "items (they are written together); the conversation is as before. Retry later."
    )
