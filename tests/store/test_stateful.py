"""Store against a reference model: random puts (acknowledged or not), continuations,
deletes, clock moves, checkpoints, graceful restarts and crashes at every journal and
checkpoint step (a store abandoned mid-work, a commit torn mid-write, a checkpoint or its
file removal cut short; then a new store on the same dir), under small caps.
Deterministic: blocking I/O runs inline on the loop.

Model: each id has its chain of user texts. A chain that resolves must return exactly its
items in order. It *must* resolve when nothing may legally have taken it (big caps, not
deleted or expired, and for restarts: durable, and for crashes: acknowledged, i.e. its
commit returned); ids expired, store:false across a restart, or deleted (for crashes: with
the delete acknowledged) must *never* resolve.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from ocxproxy.aio import cancel_and_wait
from ocxproxy.errors import StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.store import Store, files
from ocxproxy.store.journal import Journal
from ocxproxy.store.upkeep import DISK_KEEP
from tests.store.helpers import (
    HYPOTHESIS,
    Clock,
    inline,
    journal_files,
    make_store,
    make_turn,
    sample,
)

# The deep profile runs (and shrinks) far longer than the suite's default timeout.
pytestmark = pytest.mark.timeout(3600 if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else 300)
TTL = 100.0
TEXTS = st.sampled_from(["hi", "hello", "a longer message " * 3, "x" * 60, "CALL"])
SCOPES = ("scope-a", "scope-b")


@dataclass
class Expect:
    scope: str
    texts: list[str]
    durable: bool
    created: float
    must: bool = True  # must resolve now
    never: bool = False  # must not resolve, ever
    committed: bool = False  # acknowledged (its commit returned), not deleted since
    deleted: bool = False  # deleted, the delete not yet acknowledged (a crash may undo it)


class Crash(BaseException):
    """The process dies here."""


def expected(texts: list[str]) -> list[Any]:
    items: list[Any] = []
    for i, text in enumerate(texts):
        turn = make_turn("_", text, answer=f"{i}:{text}")
        items.extend(orjson.loads(b"[" + turn.items + b"]"))
    return items


class StoreMachine(RuleBasedStateMachine):
    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # renames there are cheap
        self.dir = Path(tempfile.mkdtemp(prefix="ocx-store-", dir=shm))
        self.metrics = Metrics()
        self.clock = Clock()
        self.model: dict[str, Expect] = {}
        self.counter = 0
        self.store: Store | None = None
        # Crashes here are process-level (an abandoned store), not power loss: skip the
        # fsyncs, which only make the run slow.
        self._fsync, os.fsync = os.fsync, lambda fd: None
        self._fdatasync, os.fdatasync = os.fdatasync, lambda fd: None

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def new_store(self) -> Store:
        store = make_store(
            self.dir,
            max_resident_bytes=self.resident_cap,
            max_disk_bytes=self.disk_cap,
            max_entries=self.max_entries,
            ttl=TTL,
            clock=self.clock,
            checkpoint_bytes=self.checkpoint_bytes,
            offload=inline,
            metrics=self.metrics,
        )
        self.run(store.start())
        return store

    @initialize(
        resident_cap=st.sampled_from([300, 1200, 1_000_000]),
        disk_cap=st.sampled_from([1500, 10**9]),
        max_entries=st.sampled_from([6, 10_000]),
        checkpoint_bytes=st.sampled_from([1, 10**9]),
    )
    def start(
        self, resident_cap: int, disk_cap: int, max_entries: int, checkpoint_bytes: int
    ) -> None:
        self.resident_cap, self.disk_cap = resident_cap, disk_cap
        self.max_entries, self.checkpoint_bytes = max_entries, checkpoint_bytes
        self.roomy = disk_cap > 10**6 and max_entries > 1000
        self.store = self.new_store()

    def teardown(self) -> None:
        if self.store is not None:
            self.run(self.store.abandon())
        self.loop.close()
        os.fsync = self._fsync
        os.fdatasync = self._fdatasync
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------

    def resolve(self, response_id: str) -> list[Any] | None:
        """The chain's items, or None when the store refuses (checked against the model)."""
        assert self.store is not None
        exp = self.model[response_id]
        try:
            record = self.store.lookup(exp.scope, response_id)
            history = self.run(self.store.history(record))
        except StoreFailure as failure:
            alive = exp.created + TTL > self.clock.now
            assert not (exp.must and alive), f"{response_id} must resolve: {failure}"
            return None
        assert not exp.never, f"{response_id} resolved but must not"
        assert exp.created + TTL > self.clock.now, "an expired record resolved"
        items: list[Any] = orjson.loads(b"[" + b",".join(history) + b"]")
        assert items == expected(exp.texts), response_id
        return items

    def yield_to_writer(self, steps: int) -> None:
        for _ in range(steps):
            self.run(asyncio.sleep(0))

    # -- rules -------------------------------------------------------------------------

    @rule(
        target=ids,
        text=TEXTS,
        store_true=st.booleans(),
        scope=st.sampled_from(SCOPES),
        ack=st.booleans(),
    )
    def new_chain(self, text: str, store_true: bool, scope: str, ack: bool) -> str:
        return self._put(None, text, store_true, scope, ack=ack)

    @rule(
        target=ids,
        parent=ids,
        text=TEXTS,
        store_true=st.booleans(),
        steps=st.integers(0, 3),
        ack=st.booleans(),
    )
    def continue_chain(
        self, parent: str, text: str, store_true: bool, steps: int, ack: bool
    ) -> str:
        assert self.store is not None
        if self.resolve(parent) is None:
            return parent
        exp = self.model[parent]
        try:  # background maintenance may have evicted it (small caps) since
            record = self.store.lookup(exp.scope, parent)
        except StoreFailure:
            assert not exp.must
            return parent
        self.yield_to_writer(steps)  # the turn streams while the committer works
        return self._put(record, text, store_true, exp.scope, exp, ack=ack)

    def _put(
        self,
        parent: Any,
        text: str,
        store_true: bool,
        scope: str,
        pexp: Expect | None = None,
        *,
        ack: bool,
    ) -> str:
        assert self.store is not None
        self.counter += 1
        rid = f"r{self.counter}"
        texts = [*(pexp.texts if pexp else []), text]
        durable = store_true and (pexp is None or pexp.durable)
        turn = make_turn(rid, text, scope=scope, durable=durable, answer=f"{len(texts) - 1}:{text}")
        record = self.store.put(turn, parent)
        must = self.roomy and (durable or self.resident_cap > 10**5)
        self.model[rid] = exp = Expect(scope, texts, durable, self.clock.now, must=must)
        if ack:  # the HTTP layer answers only after this returns
            self.run(self.store.commit(record))
            exp.committed = durable
        return rid

    @rule(response_id=ids)
    def read(self, response_id: str) -> None:
        self.resolve(response_id)
        assert self.store is not None
        other = SCOPES[1] if self.model[response_id].scope == SCOPES[0] else SCOPES[0]
        try:
            self.store.lookup(other, response_id)
        except StoreFailure:
            pass
        else:
            raise AssertionError("another scope resolved the id")

    @rule(response_id=ids)
    def get_response(self, response_id: str) -> None:
        assert self.store is not None
        exp = self.model[response_id]
        try:
            record = self.store.lookup(exp.scope, response_id)
            body = self.run(self.store.response_bytes(record))
        except StoreFailure:
            return
        text = exp.texts[-1]
        turn = make_turn(response_id, text, answer=f"{len(exp.texts) - 1}:{text}")
        assert body == turn.response

    @rule(response_id=consumes(ids), ack=st.booleans())
    def delete(self, response_id: str, ack: bool) -> None:
        assert self.store is not None
        exp = self.model[response_id]
        self.store.delete(exp.scope, response_id)
        exp.must, exp.never, exp.committed, exp.deleted = False, True, False, True
        if ack:
            self.commit_all()

    def commit_all(self) -> None:
        """`await commit()`: everything queued so far is durable."""
        assert self.store is not None
        self.run(self.store.commit())
        for exp in self.model.values():
            exp.deleted = False
            if exp.durable and not exp.never:
                exp.committed = True

    @rule(seconds=st.sampled_from([1.0, 30.0, 70.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        for exp in self.model.values():
            if exp.created + TTL <= self.clock.now:
                exp.must, exp.never, exp.committed, exp.deleted = False, True, False, False

    @rule()
    def sweep(self) -> None:
        assert self.store is not None
        self.store.sweep()

    @rule(steps=st.integers(1, 5))
    def let_the_writer_run(self, steps: int) -> None:
        self.yield_to_writer(steps)

    @rule()
    def commit(self) -> None:
        self.commit_all()

    @rule()
    def flush(self) -> None:
        assert self.store is not None
        self.commit_all()
        assert self.run(self.store.flush())
        # a checkpoint brings what the store keeps on disk back under its cap
        assert self.store.stats().disk_segments == 0 or (
            self.store.table.keydir.live_bytes <= self.disk_cap * DISK_KEEP
        )

    @rule()
    def restart(self) -> None:
        assert self.store is not None
        self.run(self.store.close())  # writes what is queued: all of it is acknowledged
        for exp in self.model.values():
            exp.deleted = False
            exp.committed = exp.durable and not exp.never
        self._reopen(crashed=False)

    @rule(steps=st.integers(0, 4))
    def crash(self, steps: int) -> None:
        assert self.store is not None
        self.yield_to_writer(steps)
        self.run(self.store.abandon())
        self._reopen(crashed=True)

    @rule(cut=st.integers(0, 10**6))
    def crash_mid_commit(self, cut: int) -> None:
        """The process dies while writing a commit: a torn final entry (or several)."""
        assert self.store is not None and self.store._committer is not None
        self.quiet()
        real = files.write_at

        def torn(fd: int, data: bytes, offset: int) -> None:
            real(fd, data[: cut % (len(data) + 1)], offset)
            raise Crash

        files.write_at = torn  # type: ignore[assignment]
        try:
            self.run(self.store._committer.write())
        except Crash:
            pass
        finally:
            files.write_at = real  # type: ignore[assignment]
        self.run(self.store.abandon())
        self._reopen(crashed=True)

    @rule(step=st.sampled_from(["rotate", "write_checkpoint", "remove"]))
    def crash_mid_checkpoint(self, step: str) -> None:
        """The process dies during a checkpoint (after compaction's re-appends, before or
        after the checkpoint file is durable, before the old files are removed)."""
        assert self.store is not None
        self.commit_all()
        self.quiet()

        def crash(*args: Any) -> None:
            raise Crash

        real = getattr(Journal, step)
        setattr(Journal, step, crash)
        try:
            self.run(self.store.disk.checkpoint())
        except Crash:
            pass
        finally:
            setattr(Journal, step, real)
        self.run(self.store.abandon())
        self._reopen(crashed=True)

    def quiet(self) -> None:
        """Stop the store's background maintenance, so the crash hits the step we drive."""
        assert self.store is not None
        if self.store.disk._maintainer is not None:
            self.run(cancel_and_wait(self.store.disk._maintainer))
            self.store.disk._maintainer = None

    def _reopen(self, *, crashed: bool) -> None:
        for exp in self.model.values():
            if not exp.durable:
                exp.must, exp.never = False, True
            elif crashed:
                exp.must = exp.must and exp.committed
                if exp.deleted:  # an unacknowledged delete may be undone by a crash
                    exp.never = exp.deleted = False
        missing = sample(self.metrics.spill_failures, reason="missing")
        cut = sample(self.metrics.journal_cut)
        self.store = self.new_store()
        assert self.store.check() == []
        # a crash at any step never leaves the index naming bytes that are gone
        assert sample(self.metrics.spill_failures, reason="missing") == missing
        if not crashed:  # a graceful stop leaves no torn tail
            assert sample(self.metrics.journal_cut) == cut
        # and start-up keeps no journal file that nothing needs (check() also compares)
        assert set(journal_files(self.dir)) == set(self.store.packs())

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def within_caps_and_consistent(self) -> None:
        store = self.store
        if store is None:
            return
        assert store.resident.bytes <= self.resident_cap
        assert len(store) <= self.max_entries
        assert store.check() == []  # also: no store:false content located in the journal


TestStore = StoreMachine.TestCase
TestStore.settings = HYPOTHESIS
