"""A conversation's lock, for a create turn (`ConversationTurn`, `open_turn`) and for the
routes' writes (`locked`): process memory on a single node (continuation/locks.py), a lease
on the server with a shared store (store/shared/conversations.py). The turn's append is
here too: checked against what the turn read, so a conversation changed meanwhile (the
lock lapsed and another writer got in) is a 409 and keeps nothing of the turn.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ocxproxy.continuation.locks import Lease
from ocxproxy.errors import ConversationLocked, OcxError, StorageUnavailable, StoreFailure
from ocxproxy.http.context import Proxy
from ocxproxy.http.conversation_state import (
    Conversation,
    append,
    appended,
    changed,
    entries_of,
    head_of,
    load,
    lock,
    store_full,
    unreadable,
)
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store import Store
from ocxproxy.store.shared.conversations import (
    ConversationRecord,
    SharedConversations,
    conversation_record,
    encode_entry,
    new_token,
    shared_conversations,
    staged_write,
)
from ocxproxy.store.shared.leases import SharedLease, ttl_of

log = logging.getLogger("ocxproxy.responses")


def check_room(store: Store, conversation: Conversation, extra: int) -> None:
    """StoreFull unless the conversation can grow by `extra` bytes (a turn's own items,
    checked before it runs) without a cap having to drop conversation items (on a shared
    store: the kept bytes as the turn read them, against the byte budget)."""
    shared = shared_conversations(store)
    if shared is None:
        if not store.room_for(conversation.id, extra):
            raise store_full()
        return
    record = conversation.record
    assert isinstance(record, ConversationRecord)
    if shared.budget and record.kept + extra > shared.budget:
        raise store_full()


async def _acquire(proxy: Proxy, scope: str, conversation_id: str) -> Lease | SharedLease:
    """The conversation's lock, or 400 conversation_locked while another holds it."""
    shared = shared_conversations(proxy.store)
    if shared is None:
        return lock(proxy.leases, conversation_id)
    lease = await SharedLease.acquire(shared, scope, conversation_id, proxy.leases.duration)
    if lease is None:
        raise ConversationLocked()
    return lease


def _let_go(proxy: Proxy, lease: Lease | SharedLease) -> None:
    if isinstance(lease, SharedLease):
        lease.release()
    else:
        proxy.leases.release(lease)


@contextlib.asynccontextmanager
async def locked(proxy: Proxy, scope: str, conversation_id: str) -> AsyncIterator[None]:
    """The conversation's lock around an items or metadata write (400 while taken)."""
    lease = await _acquire(proxy, scope, conversation_id)
    try:
        yield
    finally:
        if isinstance(lease, SharedLease):
            await lease.let_go()
        else:
            proxy.leases.release(lease)


@dataclass(slots=True)
class ConversationTurn:
    """A create turn's hold on its conversation: the lock, from before anything is
    forwarded until the turn ends, and the append of the answered turn."""

    proxy: Proxy
    lease: Lease | SharedLease | None
    conversation: Conversation
    appending: bool = False  # a shared append is staged: it releases the lease with it

    @property
    def local(self) -> bool:
        """The conversation is on this process's Store (not a shared store's)."""
        return not isinstance(self.conversation.record, ConversationRecord)

    def renew(self) -> None:
        if isinstance(self.lease, SharedLease):
            self.lease.renew()
        elif self.lease is not None:
            self.proxy.leases.renew(self.lease)

    def release(self) -> None:
        """Let the conversation go (idempotent): on completion, failure, cancel, disconnect."""
        if self.lease is not None and not self.appending:
            _let_go(self.proxy, self.lease)
            self.lease = None

    def let_go(self) -> list[Record]:
        """`release` when the turn has its response: a shared lease's release as a write
        `commit` runs before the answer (none when the append releases it)."""
        lease = self.lease
        if not isinstance(lease, SharedLease) or self.appending:
            self.release()
            return []
        record = self.conversation.record  # (`release` still lets it go if this never runs)
        return [staged_write(record.id, record.scope, lease.let_go)]

    def append(self, scope: str, turn: Turn, items: list[Any], backend: str | None) -> Record:
        """The conversation's new record, with the turn's items appended (as one segment,
        the bytes the turn's record holds too): even past the store's caps (their room was
        checked before the turn, for its own items). A conversation another writer changed
        meanwhile (its lease ran out) is a 409 Conflict; a write the store refused, 503.
        On a shared store, a write staged for `commit` (which raises those)."""
        conversation, store = self.conversation, self.proxy.store
        segment = Segment(
            turn.items, turn.n_items, turn.call_ids, durable=False, item_ids=turn.item_ids
        )
        shared = shared_conversations(store)
        if shared is not None:
            return self._stage(shared, segment, items, backend, turn.response_id)
        try:
            current = store.record(scope, conversation.id)
        except StoreFailure:
            current = None
        if current is not conversation.record:  # deleted, or written by a lease-breaker
            log.warning("conversation %s changed during a turn; not appended", conversation.id)
            raise changed()
        try:
            self.conversation = append(
                store, conversation, segment, items, backend=backend, force=True
            )
        except OcxError as error:
            log.error("conversation %s: turn not appended: %s", conversation.id, error)
            raise _not_appended() from None
        return self.conversation.record

    def _stage(
        self,
        shared: SharedConversations,
        segment: Segment,
        items: list[Any],
        backend: str | None,
        response_id: str,
    ) -> Record:
        """The append as a write `SharedStore.commit` runs: fenced by the version the turn
        read, releasing the turn's lease and writing the turn's response record in the
        same script (both or neither; the next turn's record chains on its)."""
        conversation = self.conversation
        record = conversation.record
        assert isinstance(record, ConversationRecord)
        meta = appended(conversation, items)
        head = head_of(record.id, meta, backend)
        entry = encode_entry(segment, meta.ids[-1])
        lease = self.lease if isinstance(self.lease, SharedLease) else None
        metrics = self.proxy.metrics
        self.appending = True

        async def write() -> None:
            try:
                token = lease.token if lease is not None else None
                version = await shared.write(
                    record, "append", entry, head=head, lease=token or "", response_id=response_id
                )
            except (OcxError, StoreFailure) as error:
                log.error("conversation %s: turn not appended: %s", record.id, error)
                metrics.turns_not_recorded.labels(reason="conversation_failed").inc()
                raise _not_appended() from None
            finally:
                self.appending = False
            if lease is not None:
                lease.stop()  # its token was released by the script
            if not version:
                log.warning("conversation %s changed during a turn; not appended", record.id)
                metrics.turns_not_recorded.labels(reason="conversation_changed").inc()
                raise changed()
            entries = [*entries_of(conversation), (segment, meta.ids[-1])]
            self.conversation = Conversation(
                conversation_record(record.id, record.scope, head, version, entries), meta
            )

        return staged_write(record.id, record.scope, write)


def _not_appended() -> StorageUnavailable:
    return StorageUnavailable(
        "The response could not be added to its conversation: the proxy's storage "
        "failed. Nothing was saved: neither the response nor the conversation's new "
        "items (they are written together); the conversation is as before. Retry later."
    )


async def open_turn(
    proxy: Proxy, scope: str, conversation_id: str, *, locked: bool = True
) -> tuple[ConversationTurn, list[bytes]]:
    """A create turn on a conversation: its lock (400 conversation_locked while another
    turn or write holds it) and its items' bytes, spliced in front of the input like a
    chain's. Without `locked`, a read (a sibling of create, which appends nothing)."""
    shared = shared_conversations(proxy.store)
    if shared is not None and locked:  # the lease and the items: one round trip
        token, duration = new_token(), proxy.leases.duration
        found = await load(proxy.store, scope, conversation_id, token, ttl_of(duration))
        held = SharedLease.held(shared, scope, conversation_id, token, duration)
        history = [s.data for s in found.segments if s.data]
        return ConversationTurn(proxy, held, found), history
    lease = await _acquire(proxy, scope, conversation_id) if locked else None
    try:
        conversation = await load(proxy.store, scope, conversation_id)
        try:
            history = await proxy.store.history(conversation.record)
        except StoreFailure as failure:
            raise unreadable(failure) from None
    except BaseException:
        if lease is not None:
            _let_go(proxy, lease)
        raise
    return ConversationTurn(proxy, lease, conversation), history
