"""Conversations on the single-node store: each one a record the store keeps until
deleted (`Store.kept`), its lock a lease (store/lease.py) over slots in process memory
(`MemorySlots`).

The record's chain holds the items (segments, bytes as forwarded), its response segment
the `Meta`'s head (created_at, metadata), `Record.ids` the item ids per segment. Every
write replaces the record; segments are shared, so appending a turn adds one segment (and
journals its ids only) and deleting an item rewrites only the segment that holds it.
Every write is durable before it returns (ack mode).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocxproxy.continuation.affinity import ROOT_KEY
from ocxproxy.continuation.conversation import Meta
from ocxproxy.errors import ConversationLocked, FailureReason, OcxError, StoreFailure
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store import conversations as common
from ocxproxy.store.conversations import Conversation
from ocxproxy.store.lease import Lease, done, holding
from ocxproxy.store.records import own_segment

if TYPE_CHECKING:
    from ocxproxy.store.local.store import Store

log = logging.getLogger("ocxproxy.responses")


class MemorySlots:
    """The lease's two primitives (store/lease.py's `Slots`) in process memory: by key (a
    conversation id), the token holding it and until when (`clock`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._held: dict[str, tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: str, token: str, ttl: float) -> Awaitable[bool]:
        now = self.clock()
        held = self._held.get(key)
        if held is not None and held[0] != token and held[1] > now:
            return done(False)
        self._held[key] = (token, now + ttl)
        return done(True)

    def drop(self, key: str, token: str) -> Awaitable[None]:
        held = self._held.get(key)
        if held is not None and held[0] == token:
            del self._held[key]
        return done(None)


class LocalConversations:
    """The conversations a Store keeps, and their locks."""

    def __init__(self, store: Store) -> None:
        # A weak reference: the store owns this, and a cycle would keep a connection's
        # memory-only store alive until the garbage collector's next pass.
        self.store: Store = weakref.proxy(store)
        self.slots = MemorySlots()

    async def load(self, scope: str, conversation_id: str) -> Conversation:
        """The caller's conversation, or NotFound (another credential's is unknown too)."""
        store = self.store
        with common.loading(conversation_id):
            record = store.record(scope, conversation_id)
            meta = Meta.decode(await store.response_bytes(record), record.ids)
        return Conversation(record, meta)

    async def create(self, scope: str, items: list[Any], metadata: dict[str, str]) -> Conversation:
        """A new conversation, durable when returned."""
        conversation_id, meta, first = common.new_conversation(items, metadata)
        chain = () if first is None else (first,)
        return await self._durable(self._write(conversation_id, scope, chain, meta, backend=None))

    async def add_items(self, conversation: Conversation, items: list[Any]) -> Conversation:
        """The items appended (one segment), durable when returned."""
        return await self._durable(
            self.append_segment(conversation, common.new_segment(items), items)
        )

    async def set_metadata(
        self, conversation: Conversation, metadata: dict[str, str]
    ) -> Conversation:
        meta = common.with_metadata(conversation, metadata)
        record = conversation.record
        written = self._write(
            record.id, record.scope, conversation.segments, meta, backend=record.backend
        )
        return await self._durable(written)

    async def delete(self, conversation: Conversation) -> None:
        self.store.delete_nowait(conversation.record.scope, conversation.id, kept=True)
        await self._commit(None)

    async def delete_item(self, conversation: Conversation, item_id: str) -> Conversation:
        """Rewrite only the segment holding the item (the later ones stay the same objects)."""
        where = conversation.meta.find(item_id)
        if where is None:
            raise common.item_not_found(item_id)
        seg_index, index = where
        record = conversation.record
        (data,) = await self._read((conversation.segments[seg_index],))
        chain, meta, _ = common.without_item(conversation, seg_index, index, data)
        written = self._write(record.id, record.scope, tuple(chain), meta, backend=record.backend)
        return await self._durable(written)

    async def items(self, conversation: Conversation) -> list[tuple[str, Any]]:
        """(id, item) of every item, oldest first."""
        return common.item_items(conversation, await self._read(conversation.segments))

    def locked(
        self, scope: str, conversation_id: str, duration: float
    ) -> AbstractAsyncContextManager[None]:
        """The conversation's lock around an items or metadata write (ConversationLocked
        while another holds it)."""
        return holding(self.slots, conversation_id, duration)

    async def open_turn(
        self, scope: str, conversation_id: str, duration: float, *, locked: bool = True
    ) -> tuple[LocalTurn, list[bytes]]:
        """A create turn on a conversation: its lock (ConversationLocked while another
        turn or write holds it) and its items' bytes. Without `locked`, a read."""
        lease = await self._lock(conversation_id, duration) if locked else None
        try:
            conversation = await self.load(scope, conversation_id)
            try:
                history = await self.store.history(conversation.record)
            except StoreFailure as failure:
                raise common.unreadable(failure) from None
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return LocalTurn(self, lease, conversation), history

    async def _lock(self, conversation_id: str, duration: float) -> Lease:
        lease = await Lease.take(self.slots, conversation_id, duration)
        if lease is None:
            raise ConversationLocked()
        return lease

    def append_segment(
        self, conversation: Conversation, segment: Segment, items: list[Any], *,
        backend: str | None = None, force: bool = False,
    ) -> Conversation:  # fmt: skip
        """The conversation with one more segment (its `items`, parsed, for their ids);
        `force` for a turn already answered (taken even past the store's caps)."""
        meta = common.appended(conversation, items)
        chain = (*conversation.segments, segment)
        record = conversation.record
        return self._write(conversation.id, record.scope, chain, meta, backend=backend, force=force)

    async def _durable(self, conversation: Conversation) -> Conversation:
        """Ack mode: a write is durable before it is answered."""
        await self._commit(conversation.record)
        return conversation

    async def _commit(self, record: Record | None) -> None:
        """(None: everything queued, a deletion.)"""
        try:
            await self.store.commit(record)
        except StoreFailure:
            raise common.unavailable() from None

    async def _read(self, segments: tuple[Segment, ...]) -> list[bytes]:
        try:
            return await self.store.segment_bytes(segments)
        except StoreFailure as failure:
            raise common.unreadable(failure) from None

    def _write(
        self,
        conversation_id: str,
        scope: str,
        chain: tuple[Segment, ...],
        meta: Meta,
        *,
        backend: str | None,
        force: bool = False,
    ) -> Conversation:
        try:
            record = self.store.kept.keep(
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
                raise common.store_full() from None
            raise common.unreadable(failure) from None
        return Conversation(record, meta)


@dataclass(slots=True)
class LocalTurn:
    """A create turn's hold on its conversation: the lock, from before anything is
    forwarded until the turn ends, and the append of the answered turn."""

    conversations: LocalConversations
    lease: Lease | None
    conversation: Conversation

    @property
    def put_first(self) -> bool:
        return True

    def check_room(self, extra: int) -> None:
        """StoreFull unless the conversation can grow by `extra` bytes (a turn's own items,
        checked before it runs) without a cap having to drop conversation items."""
        if not self.conversations.store.kept.room_for(self.conversation.id, extra):
            raise common.store_full()

    def renew(self) -> None:
        if self.lease is not None:
            self.lease.renew()

    def release(self) -> None:
        """Let the conversation go (idempotent): on completion, failure, cancel, disconnect."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def let_go(self) -> list[Record]:
        """`release` when the turn has its response (nothing left to commit)."""
        self.release()
        return []

    def append(self, scope: str, turn: Turn, items: list[Any], backend: str | None) -> Record:
        """The conversation's new record, with the turn's items appended (as one segment,
        the bytes the turn's record holds too): even past the store's caps (their room was
        checked before the turn, for its own items). A conversation another writer changed
        meanwhile (its lease ran out) is a 409 Conflict; a write the store refused, 503."""
        conversation, conversations = self.conversation, self.conversations
        segment = own_segment(turn, durable=False)
        try:
            current = conversations.store.record(scope, conversation.id)
        except StoreFailure:
            current = None
        if current is not conversation.record:  # deleted, or written by a lease-breaker
            log.warning("conversation %s changed during a turn; not appended", conversation.id)
            raise common.changed()
        try:
            self.conversation = conversations.append_segment(
                conversation, segment, items, backend=backend, force=True
            )
        except OcxError as error:
            log.error("conversation %s: turn not appended: %s", conversation.id, error)
            raise common.not_appended() from None
        return self.conversation.record
