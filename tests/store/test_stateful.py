"""Store against a reference model: random puts (acknowledged or not), continuations,
deletes, clock moves, checkpoints, graceful restarts, crashes at every journal and
checkpoint step (a store abandoned mid-work, a commit torn mid-write, a checkpoint or its
file removal cut short; then a new store on the same dir) and power losses (powerloss.py:
what was not fsynced is lost, at any call the store makes through its file layer, while
it commits, checkpoints, compacts or removes files), under small caps. Deterministic:
blocking I/O runs inline on the loop.

Model: each id has its chain of user texts. A chain that resolves must return exactly its
items in order. It *must* resolve when nothing may legally have taken it (big caps, not
deleted or expired, and for restarts: durable, and for crashes: acknowledged, i.e. its
commit returned); ids expired, store:false across a restart, or deleted (for crashes: with
the delete acknowledged) must *never* resolve. After every crash and power loss each id
is checked, and `Store.check()` must be clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
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
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import Segment
from ocxproxy.store import Store, records
from ocxproxy.store.local import files
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.upkeep import DISK_KEEP
from tests.store.helpers import (
    HYPOTHESIS,
    Clock,
    inline,
    journal_files,
    make_store,
    make_turn,
    sample,
)
from tests.store.powerloss import Mode, PowerLossFS

# The deep profile runs (and shrinks) far longer than the suite's default timeout.
pytestmark = pytest.mark.timeout(3600 if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else 300)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of the records' order of 3: runs fill, empty and shrink them."""
    monkeypatch.setattr(records, "CHUNK", 3)


TTL = 100.0
# NOISE: a text zstd barely shrinks, so its turn's segment passes LARGE (a file of its own)
NOISE = random.Random(7).randbytes(400).hex()
LARGE = 512  # compressed bytes from which a segment gets its own file, here
TEXTS = st.sampled_from(["hi", "hello", "a longer message " * 3, "x" * 60, "CALL", NOISE])
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


# A conversation's state: its texts (a segment each, as make_turn builds them), its item
# ids (a list per segment) and its head; None: it does not exist.
ConvState = tuple[tuple[str, ...], tuple[tuple[str, ...], ...], bytes] | None


@dataclass
class ConvExpect:
    scope: str
    states: list[ConvState]  # every state written, in order; the last is the live one
    acked: int = 0  # states[acked:] may be what a crash leaves (an ack of one acks those before)


def conv_segment(text: str, index: int) -> Segment:
    turn = make_turn("_", text, answer=f"{index}:{text}")
    return Segment(turn.items, turn.n_items, turn.call_ids, durable=False)


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
    convs = Bundle("convs")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # renames there are cheap
        self.base = Path(tempfile.mkdtemp(prefix="ocx-store-", dir=shm))
        self.dir = self.base / "state"  # the store creates it
        self.metrics = Metrics()
        self.clock = Clock()
        self.model: dict[str, Expect] = {}
        self.conversations: dict[str, ConvExpect] = {}
        self.counter = 0
        self.store: Store | None = None
        # Every change the store makes to its files goes through the power-loss layer,
        # which keeps what was not synced yet apart (and does not sync for real).
        self.layer = PowerLossFS(self.base, random.Random(0))
        self._fs, files.fs = files.fs, self.layer

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
            large_segment_bytes=LARGE,
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
        files.fs = self._fs
        shutil.rmtree(self.base, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------

    def resolve(self, response_id: str) -> list[Any] | None:
        """The chain's items, or None when the store refuses (checked against the model)."""
        assert self.store is not None
        exp = self.model[response_id]
        try:
            record = self.store.lookup_nowait(exp.scope, response_id)
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

    def commit_queued(self) -> None:
        """`await commit()` in the step of the event loop that queued the change, as the
        DELETE routes call it. Here the loop may run the committer first (woken by a
        change queued outside it): the outcome of the commit queued now is read too, so
        one that failed before commit() looked is not taken for an acknowledgement."""
        assert self.store is not None and self.store._committer is not None
        queued = self.store._committer.pending()
        self.run(self.store.commit())
        if queued is not None and (error := queued.result()) is not None:
            raise StoreFailure(FailureReason.WRITE_FAILED, str(error))

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
            record = self.store.lookup_nowait(exp.scope, parent)
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
        answer = f"{len(texts) - 1}:{text}"  # (its members filled in: stored once for all)
        turn = make_turn(rid, text, scope=scope, durable=durable, answer=answer, filled=True)
        record = self.store.put(turn, parent)
        must = self.roomy and (durable or self.resident_cap > 10**5)
        self.model[rid] = exp = Expect(scope, texts, durable, self.clock.now, must=must)
        if ack:  # the HTTP layer answers only after this returns
            try:
                self.run(self.store.commit(record))
            except StoreFailure as failure:  # over the disk cap, nothing to evict: refused
                if failure.reason != FailureReason.FULL:
                    raise
                assert not self.roomy
                return rid
            exp.committed = durable
        return rid

    @rule(response_id=ids)
    def read(self, response_id: str) -> None:
        self.resolve(response_id)
        assert self.store is not None
        other = SCOPES[1] if self.model[response_id].scope == SCOPES[0] else SCOPES[0]
        try:
            self.store.lookup_nowait(other, response_id)
        except StoreFailure:
            pass
        else:
            raise AssertionError("another scope resolved the id")

    @rule(response_id=ids)
    def get_response(self, response_id: str) -> None:
        assert self.store is not None
        exp = self.model[response_id]
        try:
            record = self.store.lookup_nowait(exp.scope, response_id)
            body = self.run(self.store.response_bytes(record))
        except StoreFailure:
            return
        text = exp.texts[-1]
        turn = make_turn(response_id, text, answer=f"{len(exp.texts) - 1}:{text}", filled=True)
        assert body == turn.response

    @rule(response_id=consumes(ids), ack=st.booleans())
    def delete(self, response_id: str, ack: bool) -> None:
        assert self.store is not None
        exp = self.model[response_id]
        self.store.delete_nowait(exp.scope, response_id)
        exp.must, exp.never, exp.committed, exp.deleted = False, True, False, True
        if ack:
            self.commit_all()

    def commit_all(self) -> None:
        """`await commit()`: everything queued so far is durable."""
        self.commit_queued()
        for exp in self.model.values():
            exp.deleted = False
            if exp.durable and not exp.never:
                exp.committed = True
        for conv in self.conversations.values():
            conv.acked = len(conv.states) - 1

    @rule(seconds=st.sampled_from([1.0, 30.0, 70.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        for exp in self.model.values():
            if exp.created + TTL <= self.clock.now:
                exp.must, exp.never, exp.committed, exp.deleted = False, True, False, False

    @rule()
    def sweep(self) -> None:
        assert self.store is not None
        self.run(self.store.sweep())

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
        # a checkpoint brings what the store keeps on disk back under its cap, unless only
        # conversations are left, which no cap drops (a tiny segment compresses to more
        # than its bytes, which is what their room is counted in)
        store = self.store
        assert (
            store.stats().disk_segments == 0
            or store.table.keydir.live_bytes <= self.disk_cap * DISK_KEEP
            or all(r.id in store.index.pinned for r in store.records() if r.durable)
        )

    @rule()
    def restart(self) -> None:
        assert self.store is not None
        self.run(self.store.close())  # writes what is queued: all of it is acknowledged
        for exp in self.model.values():
            exp.deleted = False
            exp.committed = exp.durable and not exp.never
        for conv in self.conversations.values():
            conv.acked = len(conv.states) - 1
        self._reopen(crashed=False)

    @rule(steps=st.integers(0, 4))
    def crash(self, steps: int) -> None:
        assert self.store is not None
        self.yield_to_writer(steps)
        self.killed()
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
        self.killed()
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
        self.killed()
        self._reopen(crashed=True)

    @rule(
        during=st.sampled_from(["idle", "commit", "checkpoint", "turns", "deletes"]),
        at=st.integers(0, 30),
        mode=st.sampled_from(list(Mode)),
        seed=st.integers(0, 2**32 - 1),
        steps=st.integers(0, 4),
    )
    def power_loss(self, during: str, at: int, mode: Mode, seed: int, steps: int) -> None:
        """The power goes at the `at`-th file call from now, while the store does `during`
        (when that is done before, right after it): what was not fsynced is gone."""
        assert self.store is not None
        self.layer.rng = random.Random(seed)
        self.layer.arm(at, mode)
        # (after the power goes every file call fails: a commit fails, unacknowledged)
        with contextlib.suppress(StoreFailure, OSError):
            if during == "commit":
                self.commit_all()
            elif during == "checkpoint":
                self.commit_all()
                self.run(self.store.flush())
            elif during == "turns":
                for i, text in enumerate(("hi", NOISE, "hello")):
                    self._put(None, text, True, SCOPES[i % 2], ack=i != 1)
            elif during == "deletes":
                live = [r for r, e in self.model.items() if e.durable and not e.never]
                for rid in live[-2:]:
                    self.delete(rid, ack=True)
            self.yield_to_writer(steps)
        self.layer.lose(mode)
        self.run(self.store.abandon())
        self.layer.restore()
        self._reopen(crashed=True)

    def killed(self) -> None:
        """The process dies (as `kill -9`): the page cache keeps what it wrote, and no
        file changes as the abandoned store's last tasks run."""
        assert self.store is not None
        with self.layer.process_dead():
            self.run(self.store.abandon())

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
        for conv_id, conv in self.conversations.items():
            # What start-up rebuilt is one of the states written since the last acked one
            # (the journal keeps their order), and is on disk: the only one from now on.
            state = self.conversation_state(conv_id, conv.scope)
            assert state in conv.states[conv.acked :], (conv_id, state, conv.states)
            conv.states, conv.acked = [state], 0
        if crashed:  # every acknowledged turn and delete held, nothing half-made
            for response_id in self.model:
                self.resolve(response_id)
        assert self.store.check() == []
        # a crash at any step never leaves the index naming bytes that are gone
        assert sample(self.metrics.spill_failures, reason="missing") == missing
        if not crashed:  # a graceful stop leaves no torn tail
            assert sample(self.metrics.journal_cut) == cut
        # and start-up keeps no journal file that nothing needs (check() also compares)
        assert set(journal_files(self.dir)) == set(self.store.packs())

    # -- conversations (Store.kept): created, appended a turn at a time, deleted ---------

    def conversation_state(self, conv_id: str, scope: str) -> ConvState:
        assert self.store is not None
        try:
            record = self.store.record(scope, conv_id)
            history = self.run(self.store.history(record))
            head = self.run(self.store.response_bytes(record))
        except StoreFailure:
            return None
        assert record.ids is not None
        items = orjson.loads(b"[" + b",".join(history) + b"]")
        texts = tuple(item["content"] for item in items[::2])
        assert items == expected(list(texts)), conv_id
        return texts, tuple(tuple(i) for i in record.ids), head

    def write_conversation(
        self, conv_id: str, state: ConvState, ack: bool, own: Segment | None = None
    ) -> None:
        """Keep `state` (pinned, journaled) as the local store's conversation writes do: the
        segments the conversation holds reused, `own` (a turn's, its record's) or new
        ones after them. A write the caps refuse changes nothing."""
        assert self.store is not None and state is not None
        conv = self.conversations[conv_id]
        texts, ids, head = state
        old = self.store._records.get(conv_id)
        chain = list(old.segments[: len(texts)] if old is not None and old.ids else ())
        chain += [conv_segment(t, i) for i, t in enumerate(texts) if i >= len(chain)]
        if own is not None:
            chain[-1] = own
        try:
            record = self.store.kept.keep(
                conv_id, conv.scope, chain, head, ids=[list(i) for i in ids], created_at=1
            )
        except StoreFailure as failure:
            assert failure.reason == FailureReason.FULL and not self.roomy
            return
        conv.states.append(state)
        if ack:
            self.run(self.store.commit(record))
            conv.acked = len(conv.states) - 1

    @rule(target=convs, text=st.one_of(st.none(), TEXTS), scope=st.sampled_from(SCOPES))
    def new_conversation(self, text: str | None, scope: str) -> str:
        self.counter += 1
        conv_id = f"conv_{self.counter}"
        self.conversations[conv_id] = ConvExpect(scope, [None])
        texts = (text,) if text is not None else ()
        ids = ((f"i{self.counter}", f"o{self.counter}"),) if text is not None else ()
        self.write_conversation(conv_id, (texts, ids, b'{"m":0}'), ack=True)
        return conv_id

    @rule(target=ids, conv_id=convs, text=TEXTS, ack=st.booleans(), steps=st.integers(0, 3))
    def conversation_turn(self, conv_id: str, text: str, ack: bool, steps: int) -> str:
        """A create turn on the conversation (exchange.py's order): its response put on
        the conversation's record, then the conversation appended with the very segment
        the response added."""
        assert self.store is not None
        conv = self.conversations[conv_id]
        state = conv.states[-1]
        if state is None:  # deleted (or refused at creation): a turn of its own
            return self._put(None, text, True, conv.scope, ack=ack)
        texts, ids, head = state
        parent = self.store.record(conv.scope, conv_id)
        self.yield_to_writer(steps)  # the turn streams while the committer works
        pexp = Expect(conv.scope, list(texts), True, self.clock.now)
        rid = self._put(parent, text, True, conv.scope, pexp, ack=ack)
        own = self.store._records[rid].segments[-1] if rid in self.store._records else None
        self.counter += 1
        new_ids = (*ids, (f"i{self.counter}", f"o{self.counter}"))
        self.write_conversation(conv_id, ((*texts, text), new_ids, head), ack, own)
        return rid

    @rule(conv_id=convs, value=st.integers(1, 3), ack=st.booleans())
    def set_conversation_metadata(self, conv_id: str, value: int, ack: bool) -> None:
        conv = self.conversations[conv_id]
        if conv.states[-1] is not None:
            texts, ids, _ = conv.states[-1]
            self.write_conversation(conv_id, (texts, ids, b'{"m":%d}' % value), ack)

    @rule(conv_id=convs, ack=st.booleans())
    def delete_conversation(self, conv_id: str, ack: bool) -> None:
        assert self.store is not None
        conv = self.conversations[conv_id]
        if conv.states[-1] is None:
            return
        assert self.store.delete_nowait(conv.scope, conv_id, kept=True)
        conv.states.append(None)
        if ack:
            self.commit_queued()
            conv.acked = len(conv.states) - 1

    @rule(conv_id=convs)
    def read_conversation(self, conv_id: str) -> None:
        conv = self.conversations[conv_id]
        assert self.conversation_state(conv_id, conv.scope) == conv.states[-1]

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


POWER_LOSSES = 10_000 if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else 1_000
LOSSES_PER_STORE = 25
WORK = ("idle", "commit", "checkpoint", "turns", "deletes")
CONFIGS = (  # roomy caps (every acknowledged turn must resolve), and small ones
    {"resident_cap": 300, "disk_cap": 10**9, "max_entries": 10_000, "checkpoint_bytes": 1},
    {"resident_cap": 1_000_000, "disk_cap": 10**9, "max_entries": 10_000, "checkpoint_bytes": 1},
    {"resident_cap": 300, "disk_cap": 10**9, "max_entries": 10_000, "checkpoint_bytes": 10**9},
    {"resident_cap": 1200, "disk_cap": 1500, "max_entries": 6, "checkpoint_bytes": 1},
)


def test_power_losses() -> None:
    """POWER_LOSSES power losses (1,000; 10,000 in the deep profile), each at a random
    file call while the store commits, checkpoints, compacts sparse files, removes files,
    or right after, between random acknowledged and unacknowledged turns, continuations,
    deletes and conversation writes: after each, every acknowledged turn and delete held,
    nothing unacknowledged is half-made, conversations are in a state that was written,
    and `Store.check()` is clean (`StoreMachine._reopen`). A seeded walk through the state
    machine's rules: the same losses every run."""
    rng = random.Random(POWER_LOSSES)  # (the deep profile walks other losses too)
    losses = stores = 0
    while losses < POWER_LOSSES:
        machine = StoreMachine()
        try:
            machine.start(**CONFIGS[stores % len(CONFIGS)])
            walk(machine, rng, LOSSES_PER_STORE)
        finally:
            losses += machine.layer.losses
            machine.teardown()
        stores += 1
    assert losses >= POWER_LOSSES


def walk(m: StoreMachine, rng: random.Random, losses: int) -> None:
    """Random rules of `m`, with a power loss every few, until `losses` happened."""
    texts = ["hi", "hello", "a longer message " * 3, "x" * 60, "CALL", NOISE]
    ids: list[str] = []
    convs: list[str] = []
    while m.layer.losses < losses:
        for _ in range(rng.randint(1, 8)):
            ack, steps = rng.random() < 0.6, rng.randint(0, 3)
            step = rng.choices(
                ["new", "continue", "delete", "conv", "conv_turn", "conv_meta", "conv_delete",
                 "commit", "run", "tick"],
                weights=[4, 6, 2, 1, 3, 1, 1, 1, 2, 1],
            )[0]  # fmt: skip
            if step == "new" or (step in ("continue", "delete") and not ids):
                ids.append(m.new_chain(rng.choice(texts), rng.random() < 0.8, "scope-a", ack))
            elif step == "continue":
                parent = rng.choice(ids)
                ids.append(m.continue_chain(parent, rng.choice(texts), True, steps, ack))
            elif step == "delete":
                m.delete(ids.pop(rng.randrange(len(ids))), ack)
            elif step == "conv" or (step.startswith("conv_") and not convs):
                convs.append(m.new_conversation(rng.choice([None, *texts]), "scope-b"))
            elif step == "conv_turn":
                ids.append(m.conversation_turn(rng.choice(convs), rng.choice(texts), ack, steps))
            elif step == "conv_meta":
                m.set_conversation_metadata(rng.choice(convs), rng.randint(1, 3), ack)
            elif step == "conv_delete":
                m.delete_conversation(rng.choice(convs), ack)
            elif step == "commit":
                m.commit()
            elif step == "run":
                m.let_the_writer_run(steps + 1)
            else:
                m.tick(1.0)
        m.power_loss(
            rng.choice(WORK), rng.randint(0, 30), rng.choice(list(Mode)), rng.getrandbits(32),
            rng.randint(0, 4),
        )  # fmt: skip
        m.within_caps_and_consistent()
