"""SharedStore: the store on a Valkey/Redis server that several replicas share (--shared-store).

A sibling of the single-node Store (local/store.py): both provide the store interface
(interface.py), and the handlers cannot tell them apart. Durable turns (store:true) live
on the server (keys: keys.py; values and scripts: layout.py); what must stay in the
process (store:false turns kept with --retain-unstored, a store:false Idempotency-Key's
response) lives in `local`, never on the server: a memory-only single-node Store the
façade (store/__init__.py's `shared_store`) hands this one, typed as process.py's
`ProcessStore`.

Round trips: `lookup` (a continuation, GET, input_items) is one script returning the
record and its chain's newest digests (a chain's list only grows, a fork being another
chain, so the older ones this replica read or wrote before are still the server's; a
chain it does not know that far costs one LRANGE more), plus one MGET of the segments
this replica does not hold (the resident cache, an LRU by digest: segments never
change, so it is never stale; each fetched one is checked against its digest). `put`
builds the record in memory; `commit` is one script writing segments, record, chain
append (or fork) and TTLs atomically, plus WAIT/WAITAOF in the same round trip when
replicas are asked for. The handlers release an answer only after `commit` returned
(ack mode's contract).

A server that cannot be reached answers StorageUnavailable (503, Retry-After) before
anything is forwarded; `available` says so until a probe (every second) succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ocxproxy.config import Config
from ocxproxy.errors import FailureReason, StorageUnavailable, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import NO_CALLS, Chain, Record, Segment, Turn
from ocxproxy.store.background import Job, take_back
from ocxproxy.store.idempotency import ProcessKeys
from ocxproxy.store.interface import Conversations, IdempotencyKeys
from ocxproxy.store.output import split_output
from ocxproxy.store.process import KEPT_PREFIXES, ProcessStore
from ocxproxy.store.records import own_segment, turn_record
from ocxproxy.store.resident import ResidentTier
from ocxproxy.store.shared import background_scripts, conversation_scripts, layout
from ocxproxy.store.shared.background import SharedBackgrounds
from ocxproxy.store.shared.chains import Chains, Newest
from ocxproxy.store.shared.checks import SharedStoreRefused
from ocxproxy.store.shared.conversation_store import ServerConversations
from ocxproxy.store.shared.conversations import (
    ConversationHead,
    ConversationRecord,
    Joined,
    SharedConversations,
    SharedWrite,
    as_parent,
)
from ocxproxy.store.shared.idempotency import ServerKeys
from ocxproxy.store.shared.keys import Keys, compaction_key_name, item_field
from ocxproxy.store.shared.layout import SharedRecord
from ocxproxy.store.shared.server import Server, register_scripts

__all__ = ["SharedStore"]

log = logging.getLogger("ocxproxy.store.shared")

register_scripts(conversation_scripts.SCRIPTS)
register_scripts(background_scripts.SCRIPTS)

START_TIMEOUT = 10.0  # how long start() waits for the server before giving up
_STAGED = 10_000


class SharedStore:
    """Records and segments on a shared Valkey/Redis server; local turns in `local`."""

    def __init__(
        self,
        url: str,
        *,
        local: ProcessStore,
        max_resident_bytes: int,
        max_entries: int,
        ttl: float,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        durability: str = "ack",
        prefix: str = "ocx:",
        max_bytes: int = 1024**3,
        wait_replicas: int = 0,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        metrics = metrics or Metrics()
        self.server = Server(url, metrics, wait_replicas=wait_replicas)
        # What never leaves this process, in memory only (no state dir: nothing on disk).
        self.local = local
        self.metrics, self.clock, self.ttl, self.durability = metrics, clock, ttl, durability
        self.state_dir: Path | None = None  # no files: what lasts is on the server
        self.url = url
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.shared_bytes = 0  # the server's count, as the last write here saw it
        self.start_timeout = start_timeout
        self.cache = ResidentTier(max_resident_bytes)  # segments by digest, any scope
        self.chains = Chains()
        self.newest = Newest()
        self.on_server = SharedConversations(  # conversations, leases, keys on the server
            self.server, prefix, budget=max_bytes, counted=self._counted
        )
        self.on_server.join = self.commit_with
        self._keys_of = self.on_server.keys  # the scopes' key names, built once
        self.conversations: Conversations = ServerConversations(self, self.on_server)
        self.idempotency: IdempotencyKeys = ServerKeys(self.on_server, ProcessKeys(self.local))
        self._staged: dict[str, tuple[SharedRecord, Record | None]] = {}
        m = self.metrics
        self._hits, self._misses = m.shared_cache.labels("hit"), m.shared_cache.labels("miss")
        m.shared_available.set_function(lambda: 1.0 if self.available else 0.0)
        m.store_available.set_function(lambda: 1.0 if self.available else 0.0)
        m.store_bytes.labels(tier="shared").set_function(lambda: self.shared_bytes)
        m.store_capacity_bytes.labels(tier="shared").set(max_bytes)

    @staticmethod
    def settings(config: Config) -> dict[str, Any]:
        """The configuration's settings for `SharedStore` (but `local` and `metrics`)."""
        return {
            "max_resident_bytes": config.resident_bytes(journaled=False),
            "max_entries": config.max_entries,
            "ttl": config.ttl,
            "durability": config.durability,
            "prefix": config.shared_prefix,
            "max_bytes": config.shared_max_bytes,
            "wait_replicas": config.shared_wait_replicas,
        }

    def __repr__(self) -> str:
        return f"<SharedStore {self.url!r} {self.cache!r}>"

    @property
    def available(self) -> bool:
        """The server answers; False from a failed round trip until one succeeds."""
        return self.server.available

    @property
    def full(self) -> bool:
        """Never: past its byte budget a commit evicts chains (a conversation write that
        cannot be taken is refused on its own)."""
        return False

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, check the server's configuration against the durability profile
        (SharedStoreRefused when it does not fit) and load the scripts."""
        await self.local.start()
        await self.server.start(self.durability, self.start_timeout)

    async def claim_compaction_key(self, fingerprint: str) -> None:
        """Record the compaction key's fingerprint (the first replica's), or refuse to
        start when another replica's key differs: an item it sealed would not open here."""
        key = compaction_key_name(self.prefix)
        await self.server.command("compaction_key", "SET", key, fingerprint, "NX")
        recorded = await self.server.command("compaction_key", "GET", key)
        if recorded is not None and recorded.decode() != fingerprint:
            raise SharedStoreRefused(
                "shared store: this replica's --compaction-key differs from the one the "
                "other replicas use (fingerprints differ): give every replica the same key"
            )

    async def close(self) -> None:
        await self.server.close()
        await self.local.close()

    abandon = close  # nothing is queued: a crash and a close leave the server alike

    def backgrounds(self, config: Config) -> SharedBackgrounds:
        """Background responses on the server, readable from every replica."""
        return SharedBackgrounds(
            self.server, self.url, self.prefix, self.metrics,
            log_bytes=config.background_log_bytes, ttl=self.ttl, stored=self._stored_response,
            forget=partial(self._forget_run, config.read_timeout),
        )  # fmt: skip

    async def _forget_run(self, lock_for: float, job: Job) -> None:
        """A background turn stored, then cancelled: deleted, out of its conversation."""
        await take_back(self, self.conversations, job, lock_for, self.metrics)

    async def _stored_response(self, scope: str, response_id: str) -> bytes | None:
        try:
            return await self.response_bytes(await self.retrieve(scope, response_id))
        except StoreFailure:
            return None

    # -- lookups -------------------------------------------------------------------------

    async def lookup(self, scope: str, response_id: str) -> Record:
        """The caller's record (a turn kept in this process, else the server's), with
        every segment of its chain in hand."""
        return await self._lookup(scope, response_id, alone=False)

    async def retrieve(self, scope: str, response_id: str) -> Record:
        """`lookup`, or a record kept alone (layout.KEEP_LOST: its chain went while its
        turn ran), with no segments: its response object is whole in its value."""
        return await self._lookup(scope, response_id, alone=True)

    async def _lookup(self, scope: str, response_id: str, *, alone: bool) -> Record:
        with contextlib.suppress(StoreFailure):
            return self.local.lookup_nowait(scope, response_id)
        if response_id.startswith(KEPT_PREFIXES):
            raise StoreFailure(FailureReason.UNKNOWN)
        keys = self._keys_of(scope)
        tail = 0 if self.newest.held(response_id, self.cache) else layout.TAIL
        args = (tail, keys.base, layout.WINDOW)
        found = await self.server.script("begin", (keys.record(response_id),), args)
        if found is None:
            raise StoreFailure(FailureReason.UNKNOWN)
        value, window, tail = found
        return await self._build(keys, response_id, value, window, tail, alone=alone)

    async def find_item(self, scope: str, item_id: str, *, unstored: bool = False) -> Record:
        """The newest record whose own segment holds the item (kept here, else the
        server's); only that segment is fetched: the record serves `item_bytes` alone."""
        with contextlib.suppress(StoreFailure):
            return self.local.find_item_nowait(scope, item_id, unstored=unstored)
        keys = self._keys_of(scope)
        args = (item_field(item_id), keys.base)
        found = await self.server.script("item", (keys.buckets(),), args)
        if found is None:
            raise StoreFailure(FailureReason.UNKNOWN)
        value, digests, tail, record_id = found
        record = await self._build(keys, record_id.decode(), value, digests[-1:], tail, own=True)
        if record.segments[-1].item_ids.span(item_id) is None:
            raise StoreFailure(FailureReason.UNKNOWN)
        return record

    async def _build(
        self,
        keys: Keys,
        record_id: str,
        value: bytes,
        window: list[bytes],
        tail: list[bytes | None],
        *,
        own: bool = False,
        alone: bool = False,
    ) -> SharedRecord:
        """The record from BEGIN's answer (ITEM's: `own`, its own segment alone); with
        `alone`, one kept alone too (layout.ALONE: its chain is gone), without segments."""
        try:
            head = layout.read_head(record_id, value)
        except ValueError as exc:
            raise self._corrupt(exc, record_id) from None
        if head.expires_at <= self.clock():
            self.metrics.store_evictions.labels(reason="expired").inc()
            raise StoreFailure(FailureReason.EXPIRED)
        if head.chain == layout.ALONE:
            if not alone:
                raise StoreFailure(FailureReason.EVICTED, "chain")  # went while it ran
            return layout.decode_record(keys, record_id, head, ())
        if len(window) != (1 if own else min(head.length, layout.WINDOW)):
            raise StoreFailure(FailureReason.EVICTED, "chain")  # its chain went (budget)
        names = [d.hex() for d in window]
        if not own:
            chain = keys.chain(head.chain)
            if head.length > len(names):
                names = await self._older(chain, head.length - len(names)) + names
            self.chains.put(chain, names)
            self.newest.put(record_id, names[-layout.TAIL :])
        segments = await self._gather(keys, names, tail)
        return layout.decode_record(keys, record_id, head, segments)

    async def _older(self, chain: bytes, n: int) -> list[str]:
        """The chain's first `n` digests: held here, else fetched (one LRANGE)."""
        held = self.chains.get(chain)
        if held is None or len(held) < n:
            older = await self.server.command("chain", "LRANGE", chain, 0, n - 1)
            if len(older) != n:
                raise StoreFailure(FailureReason.EVICTED, "chain")
            return [d.hex() for d in older]
        return held[:n]

    async def _gather(
        self, keys: Keys, digests: list[str], tail: list[bytes | None]
    ) -> tuple[Segment, ...]:
        """The segments, from the resident cache, else from `tail` (the newest ones'
        values, sent along by BEGIN), the rest fetched with one MGET."""
        cache = self.cache
        found = cache.get_all(digests)
        if None not in found:  # the usual continuation: every segment in hand
            self._hits.inc(len(found))
        else:  # only from the first one missing on (on another replica's chain: the newest)
            first, n = found.index(None), len(digests)
            absent = [i for i in range(first, n) if found[i] is None]
            missing = list(dict.fromkeys(digests[i] for i in absent))
            self._hits.inc(n - len(missing))
            self._misses.inc(len(missing))
            sent = dict(zip(digests[n - len(tail) :], tail, strict=True))
            got = self._decode({d: sent[d] for d in missing if sent.get(d) is not None})
            rest = [d for d in missing if d not in got]
            if rest:
                values = await self.server.command("fetch", "MGET", *map(keys.segment, rest))
                got.update(self._decode(dict(zip(rest, values, strict=True))))
            for i in absent:
                found[i] = got[digests[i]]
        cache.touch_all(found)  # type: ignore[arg-type]
        return tuple(found)  # type: ignore[arg-type]

    def _decode(self, values: dict[str, bytes | None]) -> dict[str, Segment]:
        got: dict[str, Segment] = {}
        for digest, value in values.items():
            if value is None:  # evicted with a chain this one was forked from
                raise StoreFailure(FailureReason.EVICTED, digest)
            try:
                segment = layout.decode_segment(digest, value)
            except ValueError as exc:
                raise self._corrupt(exc, digest) from None
            got[digest] = segment
            self._cache(segment)
        return got

    def _corrupt(self, exc: ValueError, name: str) -> StoreFailure:
        """A value that does not decode (or whose digest does not match): counted, logged."""
        self.metrics.spill_failures.labels(reason=str(FailureReason.CORRUPT)).inc()
        log.warning("shared store: %s", exc)
        return StoreFailure(FailureReason.CORRUPT, name)

    def _cache(self, segment: Segment) -> None:
        self.cache.admit(segment)
        self.cache.evict_over_budget()  # the segments stay whole for whoever holds them

    async def history(self, record: Record) -> list[bytes]:
        if not isinstance(record, SharedRecord):
            return await self.local.history(record)
        if record.links is None:  # kept alone (`retrieve`): its chain went while it ran
            raise StoreFailure(FailureReason.EVICTED, "chain")
        return [s.data for s in record.segments if s.data]

    async def response_bytes(self, record: Record) -> bytes:
        if not isinstance(record, SharedRecord):
            return await self.local.response_bytes(record)
        return layout.response_of(record)

    async def item_bytes(self, found: Sequence[tuple[Record, str]]) -> list[bytes]:
        result = []
        for record, item_id in found:
            if not isinstance(record, SharedRecord):
                result += await self.local.item_bytes([(record, item_id)])
                continue
            segment = record.segments[-1]
            span = segment.item_ids.span(item_id)
            if span is None or segment.data is None:
                raise StoreFailure(FailureReason.UNKNOWN)
            result.append(segment.data[span[0] : span[1]])
        return result

    # -- changes -------------------------------------------------------------------------

    def put(self, turn: Turn, parent: Record | None) -> Record:
        """A durable turn on a durable (shared) parent is built here and written by
        `commit`; any other stays in this process's memory (never on the server). A turn
        on a shared conversation chains on the conversation's items (`as_parent`)."""
        if isinstance(parent, ConversationRecord):
            parent = as_parent(parent, self._keys_of(turn.scope))
        shared_parent = parent is None or isinstance(parent, SharedRecord)
        if not turn.durable or not shared_parent:
            return self.local.put(turn, parent)
        now = self.clock()
        own = own_segment(turn, durable=True)
        skeleton, output_at = split_output(turn.response, turn.items)
        response = Segment.restore("", len(skeleton), 0, NO_CALLS, durable=True, data=skeleton)
        segments = (own,) if parent is None else (*parent.segments, own)
        record = turn_record(
            SharedRecord, turn, parent, now=now, ttl=self.ttl, durable=True,
            links=Chain(parent.links if parent else None, own), segments=segments,
            response=response, output_at=output_at,
        )  # fmt: skip
        record.length = len(segments)
        self._staged[record.id] = (record, parent)
        if len(self._staged) > _STAGED:  # put, then never committed (cannot happen)
            del self._staged[next(iter(self._staged))]
        return record

    async def commit(self, record: Record | None = None) -> None:
        """Write a record `put` built, atomically (one round trip); StoreFailure when it
        could not be written: the turn must not be acknowledged."""
        if isinstance(record, SharedWrite) and record.pending is not None:
            await record.pending()  # a conversation's append, an Idempotency-Key
            return
        staged = self._staged.get(record.id) if record is not None else None
        if staged is None or staged[0] is not record:
            if type(record) is SharedRecord and not record.chain:  # put, not written
                raise StoreFailure(FailureReason.WRITE_FAILED, "its conversation's write failed")
            await self.local.commit(record)  # (or written already, with its conversation's)
            return
        del self._staged[staged[0].id]
        await self._write(*staged)

    async def commit_with(self, response_id: str, append: Joined) -> int | None:
        """The record staged for `response_id` and its conversation's `append`, both or
        neither: the conversation's new version (0: it changed), None: no record staged."""
        staged = self._staged.pop(response_id, None)
        if staged is None:
            return None
        await self._write(*staged, append)
        return append.version

    async def _write(self, shared: SharedRecord, parent: Record | None, append: Any = None) -> None:
        lost = False
        try:
            try:
                chain = await self._commit(shared, parent, append)
            except StoreFailure as failure:
                if failure.reason != FailureReason.MISSING or append is not None:
                    raise  # (a conversation's turn gets a chain of its own: _commit)
                # Its parent's chain went while it ran (evicted, expired): the backend's
                # answer is valid, and a stream's is out already, so the turn is kept and
                # acknowledged as on one node, and its continuations answer `evicted`.
                chain, lost = await self._keep_lost(shared), True
        except StorageUnavailable:
            self.metrics.shared_commits.labels("unavailable").inc()
            raise StoreFailure(FailureReason.WRITE_FAILED, "shared store unavailable") from None
        except StoreFailure as failure:
            self.metrics.shared_commits.labels(str(failure.reason)).inc()
            raise
        if chain:  # (else its conversation changed: nothing was written)
            shared.chain = chain
            self.metrics.shared_commits.labels("ok").inc()
            if lost:  # (nothing of it can be read: no segments or digests to hold)
                return
            self._cache(shared.segments[-1])
            names = [s.key for s in shared.segments]
            self.chains.put(shared.chain, names)
            self.newest.put(shared.id, names[-layout.TAIL :])

    async def _commit(
        self, record: SharedRecord, parent: Record | None, append: Joined | None = None
    ) -> bytes:
        """The record's chain; with an `append`, TURN: b'' when the conversation changed."""
        script_keys, args = layout.commit_call(
            self._keys_of(record.scope),
            record,
            parent,
            int(self.clock() * 1000),
            self.max_bytes,
        )
        op, command = ("commit", self.server.commit_command) if append is None else append.call
        try:
            reply = await self.server.write(op, lambda: command(script_keys, args))
        except StoreFailure as failure:
            if failure.reason != FailureReason.MISSING or not isinstance(parent, ConversationHead):
                raise
            # the conversation's last turn's chain was evicted while this turn ran: every
            # segment is in hand, so the record gets a chain of its own
            return await self._commit(record, None, append)
        chain, total, evicted, expired = reply[:4]
        self._counted(total, expired, evicted)
        if append is not None:
            append.version = int(reply[4])
        return bytes(chain)

    async def _keep_lost(self, record: SharedRecord) -> bytes:
        """`record` written on a chain that is gone (layout.KEEP_LOST): its chain key."""
        script_keys, args = layout.keep_lost_call(self._keys_of(record.scope), record)
        command = partial(self.server.script_command, "keep_lost", script_keys, args)
        self._counted(int(await self.server.write("keep_lost", command)), 0)
        return script_keys[1]

    def _counted(self, total: int, expired: int, evicted: int = 0) -> None:
        """The server's byte count after a write here, and what it dropped."""
        self.shared_bytes = total
        if evicted:
            self.metrics.store_evictions.labels(reason="shared_bytes").inc(evicted)
        if expired:
            self.metrics.store_evictions.labels(reason="shared_expired").inc(expired)

    async def delete(self, scope: str, response_id: str) -> bool:
        """Forget a response (kept here, else on the server); True when there was one."""
        if self.local.delete_nowait(scope, response_id):
            return True
        if response_id.startswith(KEPT_PREFIXES):
            return False
        key = self._keys_of(scope).record(response_id)
        return bool(await self.server.write("delete", lambda: ("DEL", key)))

    # -- what stays in this process: `local`'s -----------------------------------------

    def delete_nowait(self, scope: str, response_id: str, *, kept: bool = False) -> bool:
        return self.local.delete_nowait(scope, response_id, kept=kept)

    async def wait_for_room(self) -> None:
        """Nothing queues: a commit is its own round trip."""

    async def sweep(self) -> int:
        return await self.local.sweep()
