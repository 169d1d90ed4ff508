"""Store against a reference model: random puts, continuations, deletes, clock moves,
flushes, graceful restarts and crashes (a store abandoned mid-work, a new one on the same
dir), under small caps. Deterministic: blocking I/O runs inline on the loop.

Model: each id has its chain of user texts. A chain that resolves must return exactly its
items in order. It *must* resolve when nothing may legally have taken it (big caps, not
deleted or expired, and for restarts: durable, and for crashes: named by a completed
flush); ids deleted, expired, or store:false across a restart must *never* resolve.
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

from ocxproxy.errors import StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.store import Store
from tests.store.helpers import (
    HYPOTHESIS,
    Clock,
    inline,
    make_store,
    make_turn,
    sample,
    spill_files,
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
    committed: bool = False  # named by a completed flush, not deleted since


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
        # fsyncs, which only make the run slow. Their order is covered in test_spill.
        self._fsync, os.fsync = os.fsync, lambda fd: None

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
            snapshot_delay=self.delay,
            offload=inline,
            metrics=self.metrics,
        )
        self.run(store.start())
        return store

    @initialize(
        resident_cap=st.sampled_from([300, 1200, 1_000_000]),
        disk_cap=st.sampled_from([1500, 10**9]),
        max_entries=st.sampled_from([6, 10_000]),
        delay=st.sampled_from([0.0, 60.0]),
    )
    def start(self, resident_cap: int, disk_cap: int, max_entries: int, delay: float) -> None:
        self.resident_cap, self.disk_cap = resident_cap, disk_cap
        self.max_entries, self.delay = max_entries, delay
        self.roomy = disk_cap > 10**6 and max_entries > 1000
        self.store = self.new_store()

    def teardown(self) -> None:
        if self.store is not None:
            self.run(self.store.abandon())
        self.loop.close()
        os.fsync = self._fsync
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

    @rule(target=ids, text=TEXTS, store_true=st.booleans(), scope=st.sampled_from(SCOPES))
    def new_chain(self, text: str, store_true: bool, scope: str) -> str:
        return self._put(None, text, store_true, scope)

    @rule(target=ids, parent=ids, text=TEXTS, store_true=st.booleans(), steps=st.integers(0, 3))
    def continue_chain(self, parent: str, text: str, store_true: bool, steps: int) -> str:
        assert self.store is not None
        if self.resolve(parent) is None:
            return parent
        exp = self.model[parent]
        record = self.store.lookup(exp.scope, parent)
        self.yield_to_writer(steps)  # the turn streams while the writer works
        return self._put(record, text, store_true, exp.scope, exp)

    def _put(
        self, parent: Any, text: str, store_true: bool, scope: str, pexp: Expect | None = None
    ) -> str:
        assert self.store is not None
        self.counter += 1
        rid = f"r{self.counter}"
        texts = [*(pexp.texts if pexp else []), text]
        durable = store_true and (pexp is None or pexp.durable)
        turn = make_turn(rid, text, scope=scope, durable=durable, answer=f"{len(texts) - 1}:{text}")
        self.store.put(turn, parent)
        must = self.roomy and (durable or self.resident_cap > 10**5)
        self.model[rid] = Expect(scope, texts, durable, self.clock.now, must=must)
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

    @rule(response_id=consumes(ids))
    def delete(self, response_id: str) -> None:
        assert self.store is not None
        exp = self.model[response_id]
        self.store.delete(exp.scope, response_id)
        exp.must, exp.never, exp.committed = False, True, False

    @rule(seconds=st.sampled_from([1.0, 30.0, 70.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        for exp in self.model.values():
            if exp.created + TTL <= self.clock.now:
                exp.must, exp.never, exp.committed = False, True, False

    @rule()
    def sweep(self) -> None:
        assert self.store is not None
        self.store.sweep()

    @rule(steps=st.integers(1, 5))
    def let_the_writer_run(self, steps: int) -> None:
        self.yield_to_writer(steps)

    @rule()
    def flush(self) -> None:
        assert self.store is not None
        if self.run(self.store.flush()):
            for exp in self.model.values():
                exp.committed = exp.durable and not exp.never

    @rule()
    def restart(self) -> None:
        assert self.store is not None
        self.run(self.store.close())
        for exp in self.model.values():
            exp.committed = exp.durable and not exp.never
        self._reopen(crashed=False)

    @rule(steps=st.integers(0, 4))
    def crash(self, steps: int) -> None:
        assert self.store is not None
        self.yield_to_writer(steps)
        self.run(self.store.abandon())
        self._reopen(crashed=True)

    def _reopen(self, *, crashed: bool) -> None:
        for exp in self.model.values():
            if not exp.durable:
                exp.must, exp.never = False, True
            elif crashed:
                exp.must = exp.must and exp.committed
        missing = sample(self.metrics.spill_failures, reason="missing")
        self.store = self.new_store()
        assert self.store.check() == []
        # a crash at any step never leaves the index naming a file that is gone
        assert sample(self.metrics.spill_failures, reason="missing") == missing
        # and start-up leaves no file that no record needs
        assert set(spill_files(self.dir)) <= set(self.store._segments)

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def within_caps_and_consistent(self) -> None:
        store = self.store
        if store is None:
            return
        assert store.resident.bytes <= self.resident_cap
        assert store.disk is not None
        assert store.disk.bytes <= self.disk_cap
        assert len(store) <= self.max_entries
        assert store.check() == []
        for key in spill_files(self.dir):  # store:false content never reaches disk
            segment = store._segments.get(key)
            assert segment is None or segment.durable or key in store.disk.doomed


TestStore = StoreMachine.TestCase
TestStore.settings = HYPOTHESIS
