"""The store as `http/` sees it: one interface, two implementations (local/, shared/).

A `typing.Protocol`, no state: the single-node store (local/store.py's Store) and the
Valkey tier (shared/store.py's SharedStore) each provide it, and `http/` calls nothing
else. One verb per operation; what may wait (a round trip to the server, a journal
commit, a read from disk) is async on every implementation, even where one of them
answers at once. A failed lookup is a StoreFailure with its FailureReason; another
scope's record is unknown, never found (CONTRACT.md C5).

Sections, in the order a turn uses them:
- lifecycle: start, close, available;
- responses: lookup, retrieve, history, response_bytes, find_item, item_bytes, put,
  commit, delete, wait_for_room, sweep (expiry);
- conversations and their lock (a lease): `conversations`; Idempotency-Keys:
  `idempotency`;
- background turns' status and event log: `backgrounds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

from ocxproxy.config import Config
from ocxproxy.model import Record, Turn
from ocxproxy.store.background import Backgrounds
from ocxproxy.store.conversations import Conversation
from ocxproxy.store.idempotency import Key

__all__ = ["ConversationTurn", "Conversations", "IdempotencyKeys", "StoreInterface"]


class IdempotencyKeys(Protocol):
    """Idempotency-Keys (the IETF draft), per credential, for 24 hours."""

    async def begin(self, key: Key, duration: float) -> dict[str, Any] | None:
        """The key is in flight until `end` (a retry meanwhile: 409 Conflict, or 422 for
        another body; in flight elsewhere it lapses `duration` after its holder's last
        sign of life); the response a completed request with this key got, to answer
        again, or None."""
        ...

    def end(self, key: Key) -> None:
        """Idempotent: when the response is remembered, and again when the request ends."""
        ...

    def complete(self, key: Key, response: Any | None, *, durable: bool) -> Record | None:
        """The request has its response: a retry from now on gets it (when it is one the
        proxy remembers, else None: a retry runs again). The completed key's record, to
        `commit` before the answer is acknowledged."""
        ...


class ConversationTurn(Protocol):
    """A create turn's hold on its conversation: its lock from before anything is
    forwarded until the turn ends, and the append of the answered turn."""

    conversation: Conversation

    @property
    def put_first(self) -> bool:
        """The turn's own record is put before the append (the single-node store's row
        then names the conversation's record it chains on, while that is live)."""
        ...

    def check_room(self, extra: int) -> None:
        """StoreFull unless the conversation can grow by `extra` bytes (the turn's own
        items, checked before it runs) without a cap dropping conversation items."""
        ...

    def renew(self) -> None:
        """The holder made progress (a chunk from the backend): the lock lasts longer."""
        ...

    def release(self) -> None:
        """Let the conversation go (idempotent, from code that cannot wait)."""
        ...

    def let_go(self) -> list[Record]:
        """`release` when the turn has its response: what `commit` must run before the
        answer (a lease's release on the server), or nothing."""
        ...

    def append(self, scope: str, turn: Turn, items: list[Any], backend: str | None) -> Record:
        """The conversation with the turn's items appended, as a record to `commit` with
        the turn's own: 409 Conflict when another writer changed it meanwhile (its lock
        lapsed), 503 when the store refused the write."""
        ...


class Conversations(Protocol):
    """A store's conversations (CONTRACT.md's conversations): every write durable when it
    returns; NotFound for an unknown id or another credential's; 507 when the store's
    caps cannot take a write without dropping conversation items."""

    async def load(self, scope: str, conversation_id: str) -> Conversation: ...

    async def create(
        self, scope: str, items: list[Any], metadata: dict[str, str]
    ) -> Conversation: ...

    async def add_items(self, conversation: Conversation, items: list[Any]) -> Conversation: ...

    async def set_metadata(
        self, conversation: Conversation, metadata: dict[str, str]
    ) -> Conversation: ...

    async def delete(self, conversation: Conversation) -> None: ...

    async def delete_item(self, conversation: Conversation, item_id: str) -> Conversation: ...

    async def items(self, conversation: Conversation) -> list[tuple[str, Any]]:
        """(id, item) of every item, oldest first."""
        ...

    def locked(
        self, scope: str, conversation_id: str, duration: float
    ) -> AbstractAsyncContextManager[None]:
        """The conversation's lock (store/lease.py's lease, lasting `duration` past the
        holder's last progress) around a write; ConversationLocked while another holds it."""
        ...

    async def open_turn(
        self, scope: str, conversation_id: str, duration: float, *, locked: bool = True
    ) -> tuple[ConversationTurn, list[bytes]]:
        """A create turn on a conversation: its lock (lasting `duration` past the turn's
        last progress) and its items' bytes (spliced in front of the input like a
        chain's). Without `locked`, a read."""
        ...


class StoreInterface(Protocol):
    """What every store provides to the HTTP layer."""

    conversations: Conversations
    idempotency: IdempotencyKeys

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the store cannot take writes: the journal or the server is down,
        or it is `full`."""
        ...

    @property
    def full(self) -> bool:
        """The store takes writes but not what would add to it (a disk cap that nothing
        left to evict can meet): stored turns are read and deleted, a turn to store is
        refused (507 store_full)."""
        ...

    @property
    def state_dir(self) -> Path | None:
        """The directory the store keeps its files in (None: memory only, or a server)."""
        ...

    async def start(self) -> None:
        """Load or connect; a store that cannot start raises (ConfigError: exit 2)."""
        ...

    async def close(self) -> None:
        """Write what is queued and let go of files and connections."""
        ...

    # -- responses -----------------------------------------------------------------------

    async def lookup(self, scope: str, response_id: str) -> Record:
        """The caller's stored response, every segment of its chain in hand or locatable:
        StoreFailure (UNKNOWN, EXPIRED, ...) when there is none to continue."""
        ...

    async def retrieve(self, scope: str, response_id: str) -> Record:
        """The caller's stored response for its Response object (GET, cancel), found while
        `response_bytes` can rebuild that: also a turn kept after its chain went while it
        ran, whose `history` answers EVICTED (as `lookup` does on the shared store)."""
        ...

    async def history(self, record: Record) -> list[bytes]:
        """The record's chain as segment bytes, oldest first (empty segments left out)."""
        ...

    async def response_bytes(self, record: Record) -> bytes:
        """The stored response object, its output items spliced back in."""
        ...

    async def find_item(self, scope: str, item_id: str, *, unstored: bool = False) -> Record:
        """The newest live record of `scope` whose own turn added the item (one a client
        did not ask to store only with `unstored`), or StoreFailure."""
        ...

    async def item_bytes(self, found: Sequence[tuple[Record, str]]) -> list[bytes]:
        """Each (record, item id)'s item, as the bytes its record's own segment holds."""
        ...

    def put(self, turn: Turn, parent: Record | None) -> Record:
        """Remember a finished turn on top of its parent's chain: queued, not yet durable
        (`commit` it before the answer is acknowledged)."""
        ...

    async def commit(self, record: Record | None = None) -> None:
        """Make `record` (None: everything queued, deletions too) durable, or raise
        StoreFailure: the turn must not be acknowledged."""
        ...

    async def delete(self, scope: str, response_id: str) -> bool:
        """Forget the caller's response; True when there was one (`commit` makes it
        durable before it is answered)."""
        ...

    def delete_nowait(self, scope: str, response_id: str) -> bool:
        """`delete` of a record `put` in this process and not yet committed (a turn that
        is not kept after all), at once."""
        ...

    async def wait_for_room(self) -> None:
        """Hold a turn (bounded) while the store's writer is behind."""
        ...

    async def sweep(self) -> int:
        """Drop expired records; how many."""
        ...

    # -- conversations and their lock: `conversations`; idempotency keys: `idempotency` --

    # -- background turns: status and event log ------------------------------------------

    def backgrounds(self, config: Config) -> Backgrounds:
        """The bookkeeping of background responses on this store (store/background.py's
        `Backgrounds`: each one's status and the append-only log of its events), made
        once per proxy: on one node local/background.py's (memory, journaled in the state
        dir), on the shared tier shared/background.py's (on the server, readable from
        every replica, the runner holding a lease)."""
        ...
