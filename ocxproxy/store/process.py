"""What a store keeps in its own process, whichever store it is: `ProcessStore`, what the
shared store asks of the memory-only store it holds for what must never leave the
process (store:false turns kept with --retain-unstored, a store:false Idempotency-Key's
response), and what idempotency.py's `ProcessKeys` asks of the store whose completed
keys it keeps.

The single-node store (local/store.py's Store) provides it; the façade (store/__init__.py)
hands a memory-only one to the shared store, which never imports the local
implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ocxproxy.metrics import Metrics
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store.records import NEVER

KEPT_PREFIXES = ("conv_", "idem_")  # ids of records a store keeps for others; never a response


class Keeper(Protocol):
    """What `ProcessKeys` asks of the records a store keeps for others (`Store.kept`)."""

    def keep(
        self, record_id: str, scope: str, chain: Sequence[Segment], meta: bytes, *,
        created_at: float, expires_at: float = NEVER, durable: bool = True,
    ) -> Record:  # fmt: skip
        """A record that is not a response (a completed Idempotency-Key), with `meta` as
        its response segment."""
        ...


class ProcessStore(Protocol):
    """Records in this process: the store interface's synchronous forms, and `kept`."""

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def kept(self) -> Keeper: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def lookup_nowait(self, scope: str, response_id: str) -> Record: ...

    def record(self, scope: str, record_id: str) -> Record:
        """The caller's record of any kind (a response, or one `kept` wrote)."""
        ...

    def find_item_nowait(self, scope: str, item_id: str, *, unstored: bool = False) -> Record: ...

    async def history(self, record: Record) -> list[bytes]: ...

    async def response_bytes(self, record: Record) -> bytes: ...

    async def item_bytes(self, found: Sequence[tuple[Record, str]]) -> list[bytes]: ...

    def put(self, turn: Turn, parent: Record | None) -> Record: ...

    async def commit(self, record: Record | None = None) -> None: ...

    def delete_nowait(self, scope: str, response_id: str, *, kept: bool = False) -> bool: ...

    async def sweep(self) -> int: ...
