"""Random puts (store:true and false, filled members, reused ids), continuations, deletes,
bulk deletes that make compaction move responses, expiry, eviction, conversations' appends
and restarts between checkpoints: every checkpoint that copies rows from the previous
file must be the one encoded whole, byte for byte, and a restart must load every record.
Chunks of eight records (records.CHUNK), so that a few dozen records make many."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ocxproxy.model import Record, Segment
from ocxproxy.store import Store, records
from tests.store.helpers import Clock, make_store, make_turn
from tests.store.test_checkpoint_reuse import as_if_encoded_whole

SEEDS = 8
STEPS = 40


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "CHUNK", 8)


def segment(text: str) -> Segment:
    return Segment(b'{"role":"user","content":"%s"}' % text.encode(), 1, frozenset(), durable=False)


def responses(store: Store) -> list[Record]:
    return [r for r in store.records() if not r.id.startswith("conv")]


async def step(store: Store, rng: random.Random, clock: Clock, n: int) -> int:
    """One random change; the next free number."""
    live = responses(store)
    op = rng.choices(["put", "delete", "bulk", "expire", "conv", "reuse"], [6, 3, 1, 1, 1, 1])[0]
    if op == "put":
        for _ in range(rng.randint(1, 12)):
            parent = rng.choice(live) if live and rng.random() < 0.7 else None
            turn = make_turn(
                f"r{n}", f"t{n} " + "x" * rng.choice((0, 50, 400)),
                durable=rng.random() < 0.9, filled=rng.random() < 0.3,
            )  # fmt: skip
            live.append(store.put(turn, parent))
            n += 1
    elif op == "reuse" and live:  # a reused id: the old record goes, the new one is last
        victim, parent = rng.choice(live), rng.choice(live)
        store.put(make_turn(victim.id, f"again {n}"), None if parent is victim else parent)
        n += 1
    elif op == "delete" and live:
        for r in rng.sample(live, min(len(live), rng.randint(1, 6))):
            store.delete_nowait(r.scope, r.id)
    elif op == "bulk" and live:  # sparse files: compaction moves the responses left
        for r in rng.sample(live, len(live) * 2 // 3):
            store.delete_nowait(r.scope, r.id)
    elif op == "expire":
        clock.now += rng.choice((100.0, 300.0))
        await store.sweep()
    elif op == "conv":
        name = f"conv_{rng.randint(0, 2)}"
        old = store.index.by_id.get(name)
        chain = (*(old.segments if old is not None else ()), segment(f"{name} {n}"))
        ids = [[f"i{k}"] for k in range(len(chain))] if name == "conv_1" else None
        store.kept.keep(name, "scope-a", chain, b"{}", created_at=clock.now, ids=ids)
        n += 1
    await store.commit()
    return n


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_checkpoints_with_copied_rows_are_those_encoded_whole(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    clock = Clock()
    options = {
        "clock": clock, "ttl": 500.0, "max_entries": rng.choice((40, 80, 1000)),
        "max_resident_bytes": rng.choice((1, 64 * 1024)),
    }  # fmt: skip
    store = make_store(tmp_path, **options)
    await store.start()
    n = 0
    for _ in range(STEPS):
        if rng.random() < 0.05:  # a new process: its first checkpoint is encoded whole
            await store.close()
            store = make_store(tmp_path, **options)
            await store.start()
        else:
            n = await step(store, rng, clock, n)
        assert await store.flush()
        await as_if_encoded_whole(store, tmp_path)
        assert store.check() == []
    durable = sorted(r.id for r in store.records() if r.durable)
    await store.close()
    again = make_store(tmp_path, **options)
    await again.start()
    assert sorted(r.id for r in again.records()) == durable
    assert again.check() == []
    await again.close()
