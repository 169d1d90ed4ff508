"""The continuation store: records of remembered responses and the segments they share.

Owns memory and disk state; never imports aiohttp, ocxproxy.http or ocxproxy.upstream.
Every way a lookup can fail is a StoreFailure with a FailureReason. Two implementations:
local/ (one node: memory and the journal) and shared/ (Valkey/Redis); beside them what
both use: records.py (the records' index and expiry; items.py the item index, shards.py
its shards), resident.py (the memory tier's LRU), output.py (items cut out of an output),
compaction_key.py (the compaction sealing key), compression.py (the plain zstd
set-up), lease.py (a conversation's lock), process.py (what stays in the process:
ProcessStore, KEPT_PREFIXES; idempotency.py's ProcessKeys).
local/: Store (store.py) does every change and owns the records (kept.py its KeptRecords,
the records it keeps for conversations and Idempotency-Keys; expiry.py its Expiry, what
goes and when); segments.py's
SegmentTable alone changes segments (keydir.py where their bytes are); ledger.py queues
a durable record's journal entries and applies each commit's outcome; durable.py owns the
files, the committer (committer.py) and the checkpoint. journal.py holds the files
(journal, packs, checkpoint) and codec.py their entries, restore.py start-up's rebuilding
of the index, upkeep.py the maintenance policy and the checkpoint's encoding, stats.py
the stats and gauges.
shared/ (--shared-store, store.py: SharedStore, a store on Valkey/Redis; every key it
names in keys.py, its values and scripts in layout.py, its connection and round trips in
server.py, its start-up checks in checks.py) is imported only when asked for: its client
is an extra (ocxproxy[shared]).
interface.py declares what `http/` may call on either (StoreInterface).
Public surface: Store, StoreInterface (and the types it names), StoreStats,
default_state_dir, open_store, shared_store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ocxproxy.config import Config, ConfigError
from ocxproxy.metrics import Metrics
from ocxproxy.store.background import (
    IN_PROGRESS,
    QUEUED,
    STORED,
    TERMINAL,
    Backgrounds,
    Inputs,
    Job,
    take_back,
)
from ocxproxy.store.conversations import Conversation
from ocxproxy.store.idempotency import TTL as IDEMPOTENCY_TTL
from ocxproxy.store.idempotency import Key as IdempotencyKey
from ocxproxy.store.interface import (
    Conversations,
    ConversationTurn,
    IdempotencyKeys,
    StoreInterface,
)
from ocxproxy.store.local.background import LocalBackgrounds
from ocxproxy.store.local.store import Store, StoreStats, default_state_dir

__all__ = [
    "IDEMPOTENCY_TTL",
    "IN_PROGRESS",
    "QUEUED",
    "STORED",
    "TERMINAL",
    "Backgrounds",
    "Conversation",
    "ConversationTurn",
    "Conversations",
    "IdempotencyKey",
    "IdempotencyKeys",
    "Inputs",
    "Job",
    "LocalBackgrounds",
    "Store",
    "StoreInterface",
    "StoreStats",
    "default_state_dir",
    "open_store",
    "shared_store",
    "take_back",
]


def open_store(config: Config, metrics: Metrics | None = None) -> StoreInterface:
    """The proxy's store: the single-node one, or with --shared-store the shared tier."""
    if config.shared_store is None:
        return Store.from_config(config, metrics)
    try:
        from ocxproxy.store.shared.store import SharedStore
    except ImportError:
        raise ConfigError(
            "--shared-store needs the Valkey/Redis client: pip install 'ocxproxy[shared]'"
        ) from None
    return shared_store(config.shared_store, metrics=metrics, **SharedStore.settings(config))


_PROCESS = ("max_resident_bytes", "max_entries", "ttl", "clock", "durability")


def shared_store(url: str, *, metrics: Metrics | None = None, **settings: Any) -> SharedStore:
    """A SharedStore (`settings` as it takes them) and, for what must never leave this
    process (store:false turns kept with --retain-unstored, a store:false
    Idempotency-Key's response), the memory-only single-node Store it holds (no state
    dir: nothing on disk), on the same metrics and clock."""
    from ocxproxy.store.shared.store import SharedStore

    metrics = metrics or Metrics()
    local = Store(
        metrics=metrics, **{name: settings[name] for name in _PROCESS if name in settings}
    )
    return SharedStore(url, local=local, metrics=metrics, **settings)


if TYPE_CHECKING:  # mypy: both implementations provide the interface
    from ocxproxy.store.process import ProcessStore
    from ocxproxy.store.shared.store import SharedStore

    def _implements(local: Store, shared: SharedStore) -> list[StoreInterface | ProcessStore]:
        return [local, shared, local]
