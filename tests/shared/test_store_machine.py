"""The shared tier against a reference model, on a real Valkey server: random begins and
commits (new chains, continuations, siblings that fork a chain) on three replicas that
share one server, deletes, item references, clock moves past the TTL, and a replica
restart (its resident cache gone). Every lookup, on any replica, must answer exactly what
the model says: the chain's items in order, or the failure's reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.store import shared_store
from ocxproxy.store.shared.store import SharedStore
from tests.shared.conftest import require
from tests.shared.servers import KvServer
from tests.shared.test_store import turn
from tests.store.helpers import HYPOTHESIS, Clock

pytestmark = pytest.mark.timeout(600)
TTL = 100.0
SCOPES = ("scope-a", "scope-b")
TEXTS = st.sampled_from(["hi", "hello", "a longer message " * 4, "x" * 90])
REPLICAS = st.integers(0, 2)


@dataclass
class Expect:
    scope: str
    lineage: list[tuple[str, str]]  # (id, user text) of each turn, oldest first
    expires: float
    item_id: str


def item_id_of(rid: str) -> str:
    return f"msg_{rid}"


class SharedMachine(RuleBasedStateMachine):
    url = ""  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock(time.time())
        self.model: dict[str, Expect] = {}
        self.items: dict[tuple[str, str], str] = {}  # (scope, item id) -> newest holder
        self.n = 0
        self.replicas: list[SharedStore] = []

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def replica(self) -> SharedStore:
        store = shared_store(
            self.url,
            max_resident_bytes=600,  # a few segments: the cache evicts and refetches
            max_entries=1000,
            ttl=TTL,
            metrics=Metrics(),
            clock=self.clock,
            start_timeout=5.0,
        )
        self.run(store.start())
        return store

    @initialize()
    def start(self) -> None:
        client = aioredis.Redis.from_url(self.url)
        self.run(client.flushall())
        self.run(client.aclose())
        self.replicas = [self.replica() for _ in range(3)]

    def teardown(self) -> None:
        for store in self.replicas:
            self.run(store.close())
        self.loop.close()

    ids = Bundle("ids")

    def new_id(self) -> str:
        self.n += 1
        return f"resp_{self.n}"

    def commit(self, store: SharedStore, rid: str, scope: str, text: str, parent: Any) -> None:
        item_id = item_id_of(rid)
        record = store.put(turn(rid, text, scope=scope, item_id=item_id), parent)
        self.run(store.commit(record))
        base = self.model[parent.id].lineage if parent is not None else []
        self.model[rid] = Expect(scope, [*base, (rid, text)], self.clock.now + TTL, item_id)
        self.items[scope, item_id] = rid

    @rule(target=ids, replica=REPLICAS, scope=st.sampled_from(SCOPES), text=TEXTS)
    def new_chain(self, replica: int, scope: str, text: str) -> str:
        rid = self.new_id()
        self.commit(self.replicas[replica], rid, scope, text, None)
        return rid

    @rule(target=ids, parent=ids, replica=REPLICAS, text=TEXTS)
    def continue_chain(self, parent: str, replica: int, text: str) -> str:
        """Also a sibling (a fork) when the parent already has a child."""
        store = self.replicas[replica]
        rid = self.new_id()
        expect = self.model.get(parent)
        try:
            record = self.run(store.lookup(expect.scope if expect else "scope-a", parent))
        except StoreFailure as failure:
            assert self.failure_of(parent, "scope-a" if expect is None else expect.scope) == (
                failure.reason
            )
            return rid
        assert expect is not None and self.live(parent)
        self.commit(store, rid, expect.scope, text, record)
        return rid

    @rule(rid=ids, replica=REPLICAS, scope=st.sampled_from(SCOPES))
    def lookup(self, rid: str, replica: int, scope: str) -> None:
        store = self.replicas[replica]
        try:
            record = self.run(store.lookup(scope, rid))
        except StoreFailure as failure:
            assert failure.reason == self.failure_of(rid, scope), rid
            return
        assert self.failure_of(rid, scope) is None, rid
        history = self.run(store.history(record))
        assert orjson.loads(b"[" + b",".join(history) + b"]") == self.items_of(rid)
        assert record.n_items == 2 * len(self.model[rid].lineage)

    @rule(rid=ids, replica=REPLICAS)
    def delete(self, rid: str, replica: int) -> None:
        expect = self.model.get(rid)
        scope = expect.scope if expect else "scope-a"
        removed = self.run(self.replicas[replica].delete(scope, rid))
        assert removed == (expect is not None)  # an expired one is still on the server
        self.model.pop(rid, None)

    @rule(rid=ids, replica=REPLICAS)
    def find_item(self, rid: str, replica: int) -> None:
        expect = self.model.get(rid)
        if expect is None:
            return
        key = (expect.scope, expect.item_id)
        holder = self.items[key]
        store = self.replicas[replica]
        try:
            record = self.run(store.find_item(*key))
        except StoreFailure as failure:
            assert self.failure_of(holder, expect.scope) == failure.reason
            return
        assert record.id == holder and self.live(holder)
        (data,) = self.run(store.item_bytes([(record, expect.item_id)]))
        assert orjson.loads(data)["id"] == expect.item_id

    @rule(seconds=st.sampled_from([1.0, TTL / 3, TTL]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(replica=REPLICAS)
    def restart_replica(self, replica: int) -> None:
        self.run(self.replicas[replica].close())
        self.replicas[replica] = self.replica()

    def live(self, rid: str) -> bool:
        expect = self.model.get(rid)
        return expect is not None and expect.expires > self.clock.now

    def failure_of(self, rid: str, scope: str) -> FailureReason | None:
        expect = self.model.get(rid)
        if expect is None or expect.scope != scope:
            return FailureReason.UNKNOWN
        if expect.expires <= self.clock.now:
            return FailureReason.EXPIRED
        return None

    def items_of(self, rid: str) -> list[Any]:
        items: list[Any] = []
        for turn_id, text in self.model[rid].lineage:
            made = turn(turn_id, text, item_id=item_id_of(turn_id))
            items += orjson.loads(b"[" + made.items + b"]")
        return items


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvServer]:
    require("valkey")
    server = KvServer("valkey", Path(tmp_path_factory.mktemp("machine")))
    server.start()
    yield server
    server.close()


def test_the_shared_tier_matches_its_model(valkey: KvServer) -> None:
    SharedMachine.url = valkey.url
    run_state_machine_as_test(SharedMachine, settings=HYPOTHESIS)
