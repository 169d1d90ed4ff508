"""The store as `http/` sees it: one interface, two implementations (local/, shared/).

A `typing.Protocol`, no state: the single-node store (local/store.py's Store) and the
Valkey tier (shared/store.py's SharedStore) each provide it, and `http/` calls nothing
else. One verb per operation; what may wait (a round trip to the server, a journal
commit, a read from disk) is async on every implementation, even where one of them
answers at once. A failed lookup is a StoreFailure with its FailureReason; another
scope's record is unknown, never found (CONTRACT.md C5).

Sections, in the order a turn uses them:
- lifecycle: start, close, available;
- responses: lookup, history, response_bytes, find_item, item_bytes, put, commit,
  delete, wait_for_room, sweep (expiry);
- conversations and their lock (a lease), idempotency keys;
- background turns' status and event log (marked below).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ocxproxy.model import Record, Turn

__all__ = ["StoreInterface"]


class StoreInterface(Protocol):
    """What every store provides to the HTTP layer."""

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the store cannot take writes (the journal or the server is down):
        a turn is refused with 503 before anything is forwarded."""
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

    async def wait_for_room(self) -> None:
        """Hold a turn (bounded) while the store's writer is behind."""
        ...

    async def sweep(self) -> int:
        """Drop expired records; how many."""
        ...

    # -- conversations, their lock, idempotency keys -------------------------------------
    # (Their operations are still reached through http/conversation_state.py and
    # http/idempotency.py; they join this interface as they move into the store.)

    # -- background turns: status and event log ------------------------------------------
    # (Reserved: the status of a background response and the append-only log of its
    # events are declared here, beside the responses they belong to.)
