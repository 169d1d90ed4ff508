"""Conversations on the shared store: each one on the server (conversations.py's keys and
scripts), its lock a lease (store/lease.py) over slots there, so every replica serves it
alike.

Each write names the version it was computed from, so one made after its lock lapsed and
the conversation changed is refused (409 `conversation_changed`). A turn's append is a
write `SharedStore.commit` runs, with the turn's record, in one script.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from ocxproxy.continuation.conversation import Meta
from ocxproxy.errors import FailureReason, OcxError, StoreFailure
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store import conversations as common
from ocxproxy.store.conversations import Conversation
from ocxproxy.store.lease import Lease, holding, new_token, ttl_of
from ocxproxy.store.records import own_segment
from ocxproxy.store.shared.conversations import (
    ConversationRecord,
    SharedConversations,
    conversation_record,
    encode_entry,
    staged_write,
)

if TYPE_CHECKING:
    from ocxproxy.store.shared.store import SharedStore

log = logging.getLogger("ocxproxy.responses")


def _meta(record: ConversationRecord) -> Meta:
    doc = orjson.loads(record.head)
    return Meta(doc["created_at"], doc["metadata"], [list(ids) for ids in record.ids])


def _refused(failure: StoreFailure) -> OcxError:
    """A write the server refused: 507 when the byte budget could not take it."""
    return common.store_full() if failure.reason == FailureReason.FULL else common.unavailable()


class ServerConversations:
    """The conversations a SharedStore keeps on its server, and their leases."""

    def __init__(self, store: SharedStore, server: SharedConversations) -> None:
        self.store = store
        self.server = server

    async def load(
        self, scope: str, conversation_id: str, token: str = "", ttl: float = 0.0
    ) -> Conversation:
        """The caller's conversation, or NotFound; with its lease taken by `token` in the
        same round trip."""
        with common.loading(conversation_id):
            found = await self.server.load(scope, conversation_id, token, ttl)
        if found is None:
            raise common.not_found(conversation_id)
        return Conversation(found, _meta(found))

    async def create(self, scope: str, items: list[Any], metadata: dict[str, str]) -> Conversation:
        """A new conversation, durable when returned."""
        conversation_id, meta, segment = common.new_conversation(items, metadata)
        first = None if segment is None else (segment, meta.ids[0])
        try:
            record = await self.server.create(
                scope, conversation_id, common.head_of(conversation_id, meta, None), first
            )
        except StoreFailure as failure:
            raise _refused(failure) from None
        return Conversation(record, meta)

    async def add_items(self, conversation: Conversation, items: list[Any]) -> Conversation:
        """The items appended (one segment), durable when returned."""
        segment = common.new_segment(items)
        meta = common.appended(conversation, items)
        entries = [*common.entries_of(conversation), (segment, meta.ids[-1])]
        entry = encode_entry(segment, meta.ids[-1])
        return await self._write(conversation, meta, entries, "append", entry)

    async def set_metadata(
        self, conversation: Conversation, metadata: dict[str, str]
    ) -> Conversation:
        meta = common.with_metadata(conversation, metadata)
        return await self._write(conversation, meta, common.entries_of(conversation), "meta")

    async def delete(self, conversation: Conversation) -> None:
        await self._write(conversation, conversation.meta, [], "delete")

    async def delete_item(self, conversation: Conversation, item_id: str) -> Conversation:
        """Rewrite only the segment holding the item (the later ones stay the same objects)."""
        where = conversation.meta.find(item_id)
        if where is None:
            raise common.item_not_found(item_id)
        seg_index, index = where
        data = conversation.segments[seg_index].data or b""  # read whole with the conversation
        chain, meta, kept = common.without_item(conversation, seg_index, index, data)
        entry = encode_entry(chain[seg_index], meta.ids[seg_index]) if kept else b""
        entries = list(zip(chain, meta.ids, strict=True))
        return await self._write(conversation, meta, entries, "replace", seg_index, entry)

    async def items(self, conversation: Conversation) -> list[tuple[str, Any]]:
        """(id, item) of every item, oldest first (read whole with the conversation)."""
        return common.item_items(conversation, [s.data or b"" for s in conversation.segments])

    def locked(
        self, scope: str, conversation_id: str, duration: float
    ) -> AbstractAsyncContextManager[None]:
        """The conversation's lease around an items or metadata write (ConversationLocked
        while another holds it), let go before the answer."""
        return holding(self.server, self.server.lease_key(scope, conversation_id), duration)

    async def open_turn(
        self, scope: str, conversation_id: str, duration: float, *, locked: bool = True
    ) -> tuple[SharedTurn, list[bytes]]:
        """A create turn on a conversation: its lease and its items in one round trip
        (ConversationLocked while another holds it). Without `locked`, a read."""
        if not locked:
            conversation = await self.load(scope, conversation_id)
            try:
                history = await self.store.history(conversation.record)
            except StoreFailure as failure:
                raise common.unreadable(failure) from None
            return SharedTurn(self, None, conversation), history
        token = new_token()
        found = await self.load(scope, conversation_id, token, ttl_of(duration))
        key = self.server.lease_key(scope, conversation_id)
        held = Lease.held(self.server, key, token, duration)
        history = [s.data for s in found.segments if s.data]
        return SharedTurn(self, held, found), history

    async def _write(
        self,
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
        head = common.head_of(record.id, meta, record.backend)
        try:
            version = await self.server.write(record, op, *args, head=head)
        except StoreFailure as failure:
            raise _refused(failure) from None
        if not version:
            raise common.changed()
        written = conversation_record(record.id, record.scope, head, version, entries)
        return Conversation(written, meta)


@dataclass(slots=True)
class SharedTurn:
    """A create turn's hold on its conversation: the lease, from before anything is
    forwarded until the turn ends, and the append of the answered turn (a staged write)."""

    conversations: ServerConversations
    lease: Lease | None
    conversation: Conversation
    appending: bool = False  # the append is staged: it releases the lease with it

    @property
    def put_first(self) -> bool:
        return False  # the append's script writes the turn's record with it

    def check_room(self, extra: int) -> None:
        """StoreFull unless the kept bytes as the turn read them can grow by `extra`
        within the byte budget."""
        record = self.conversation.record
        assert isinstance(record, ConversationRecord)
        budget = self.conversations.server.budget
        if budget and record.kept + extra > budget:
            raise common.store_full()

    def renew(self) -> None:
        if self.lease is not None:
            self.lease.renew()

    def release(self) -> None:
        """Let the conversation go (idempotent): on completion, failure, cancel, disconnect."""
        if self.lease is not None and not self.appending:
            self.lease.release()
            self.lease = None

    def let_go(self) -> list[Record]:
        """`release` when the turn has its response: the lease's release as a write
        `commit` runs before the answer (none when the append releases it)."""
        lease = self.lease
        if lease is None or self.appending:
            self.release()
            return []
        record = self.conversation.record  # (`release` still lets it go if this never runs)
        return [staged_write(record.id, record.scope, lease.let_go)]

    def append(self, scope: str, turn: Turn, items: list[Any], backend: str | None) -> Record:
        """The append as a write `SharedStore.commit` runs: fenced by the version the turn
        read, releasing the turn's lease and writing the turn's response record in the
        same script (both or neither; the next turn's record chains on its). A
        conversation another writer changed meanwhile is a 409 Conflict there; a write
        the server refused, 503."""
        segment = own_segment(turn, durable=False)
        conversation = self.conversation
        record = conversation.record
        assert isinstance(record, ConversationRecord)
        meta = common.appended(conversation, items)
        head = common.head_of(record.id, meta, backend)
        entry = encode_entry(segment, meta.ids[-1])
        lease = self.lease
        server, metrics = self.conversations.server, self.conversations.store.metrics
        response_id = turn.response_id
        self.appending = True

        async def write() -> None:
            try:
                token = lease.token if lease is not None else None
                version = await server.write(
                    record, "append", entry, head=head, lease=token or "", response_id=response_id
                )
            except (OcxError, StoreFailure) as error:
                log.error("conversation %s: turn not appended: %s", record.id, error)
                metrics.turns_not_recorded.labels(reason="conversation_failed").inc()
                raise common.not_appended() from None
            finally:
                self.appending = False
            if lease is not None:
                lease.stop()  # its token was released by the script
            if not version:
                log.warning("conversation %s changed during a turn; not appended", record.id)
                metrics.turns_not_recorded.labels(reason="conversation_changed").inc()
                raise common.changed()
            entries = [*common.entries_of(conversation), (segment, meta.ids[-1])]
            self.conversation = Conversation(
                conversation_record(record.id, record.scope, head, version, entries), meta
            )

        return staged_write(record.id, record.scope, write)
