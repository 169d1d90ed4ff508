"""Store benchmarks: what a long chain costs in memory and on disk, and whether memory stays
under the cap while many chains run. Prints figures; asserts nothing.

    python scripts/bench/bench_store.py [--turns 172] [--chains 1000] [--chain-turns 10]
                                  [--cap 1MiB] [--concurrency 64] [--turn-time 0.2]
                                  [--user-words N] [--revisits 200]

1. One chain of --turns turns (~8k tokens, ~32 KB of items in all): bytes of items the
   client sent and the model produced, against what the store holds in memory and on disk.
   A store that kept each turn's full history would hold sum(history) bytes instead.
2. --chains chains x --chain-turns turns, run by --concurrency clients whose turns each
   spend --turn-time at the backend, with a small resident cap: peak resident bytes against
   the cap, the bytes queued for the journal (each turn awaits its commit, as the HTTP
   layer does), the process RSS, and per-continuation latency of Store.history (hot and
   cold). --turn-time 0 is an overload test: turns arrive as fast as commits allow. Then
   --revisits chains picked at random continue once more (clients that come back later):
   with --user-words 165 (~1 KB turns) and 10,000 chains, what a continuation costs when
   its chain is no longer resident, and how many are, under a given --cap.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ocxproxy.config import parse_bytes
from ocxproxy.metrics import Metrics
from ocxproxy.model import Record, Turn
from ocxproxy.store import Store

WORDS = tuple(
    "the a of to and in is it that for on with as this be are was by at from or an not "  # noqa: SIM905
    "function file test error value return import class config store proxy request chain "
    "response model token cache backend stream event item output input call result path "
    "update change check run build write read memory disk segment record snapshot".split()
)


def sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."


def make_turn(rng: random.Random, response_id: str, user_words: int, answer_words: int) -> Turn:
    user = {"role": "user", "content": sentence(rng, user_words)}
    answer = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": sentence(rng, answer_words)}],
    }
    response = {
        "id": response_id,
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed",
        "model": "SmolLM2-135M-Instruct",
        "output": [answer],
        "usage": {
            "input_tokens": 1234,
            "input_tokens_details": {"cached_tokens": 1200},
            "output_tokens": 40,
            "total_tokens": 1274,
        },
    }
    items = orjson.dumps(user) + b"," + orjson.dumps(answer)
    return Turn(response_id, "scope", True, items, 2, frozenset(), orjson.dumps(response))


def new_store(state_dir: Path, cap: int, metrics: Metrics) -> Store:
    return Store(
        max_resident_bytes=cap,
        max_entries=1_000_000,
        ttl=86400.0,
        metrics=metrics,
        state_dir=state_dir,
        snapshot_delay=0.5,
    )


def tree_bytes(root: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in root.glob(pattern) if p.is_file())


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def one_long_chain(turns: int, root: Path) -> None:
    rng = random.Random(1)
    store = new_store(root, 1 << 30, Metrics())
    await store.start()
    raw_items = raw_responses = full_copies = history_bytes = 0
    parent: Record | None = None
    for i in range(turns):
        turn = make_turn(rng, f"resp_{i:032x}", rng.randint(2, 6), rng.randint(4, 10))
        if parent is not None:
            history_bytes = sum(len(p) + 1 for p in await store.history(parent))
        parent = store.put(turn, parent)
        raw_items += len(turn.items)
        raw_responses += len(turn.response)
        full_copies += history_bytes + len(turn.items)  # a store of whole histories
    item_keys = {s.key for s in parent.segments} if parent else set()
    resident_items = sum(s.size for s in store.resident if s.key in item_keys)
    resident_responses = store.resident.bytes - resident_items
    assert await store.flush()
    steady_responses = store.resident.bytes - resident_items
    located = [s for s in store.segments().values() if s.on_disk]
    disk_items = sum(s.length for s in located if s.key in item_keys)
    disk_responses = sum(s.length for s in located) - disk_items
    snapshot_bytes = (root / "checkpoint").stat().st_size
    await store.close()
    print(f"== one chain: {turns} turns, ~{raw_items // 4} tokens of items ==")
    print(f"raw item bytes (sent + produced)      {raw_items:>10,}")
    print(f"raw response objects (for GET)        {raw_responses:>10,}")
    print(f"per-turn full-history copies would be {full_copies:>10,}  "
          f"({full_copies / raw_items:.0f}x raw items)")  # fmt: skip
    print(f"resident: item segments               {resident_items:>10,}  "
          f"({resident_items / raw_items:.2f}x raw items)")  # fmt: skip
    print(f"resident: response objects            {resident_responses:>10,}  "
          f"-> {steady_responses:,} once on disk (outputs cut: they are in the items)")  # fmt: skip
    print(f"disk: item segments (zstd, journal)   {disk_items:>10,}  "
          f"({disk_items / raw_items:.2f}x raw items)")  # fmt: skip
    print(f"disk: response segments (zstd)        {disk_responses:>10,}")
    print(f"disk: checkpoint (the index)          {snapshot_bytes:>10,}")
    total_raw = raw_items + raw_responses
    total_mem = resident_items + steady_responses
    total_disk = disk_items + disk_responses + snapshot_bytes
    print(f"memory, steady state                  {total_mem:>10,}  "
          f"({total_mem / raw_items:.2f}x raw items)")  # fmt: skip
    print(f"disk, everything                      {total_disk:>10,}  "
          f"({total_disk / raw_items:.2f}x raw items, {total_disk / total_raw:.2f}x raw items "
          f"+ responses)")  # fmt: skip


async def many_chains(
    chains: int,
    chain_turns: int,
    cap: int,
    root: Path,
    concurrency: int,
    turn_time: float,
    *,
    user_words: int = 0,
    revisits: int = 200,
) -> None:
    """Clients run their chains concurrently; each turn spends `turn_time` at the backend
    and sends `user_words` words (0: 4-14 at random); then `revisits` chains at random
    come back for one more turn."""
    rng = random.Random(2)
    metrics = Metrics()
    store = new_store(root, cap, metrics)
    await store.start()
    peak = {"resident": 0, "pending": 0, "memory": 0}
    hot: list[float] = []
    cold: list[float] = []
    rss_start = rss_mib()
    todo = list(range(chains))
    heads: dict[int, Record] = {}

    async def client() -> None:
        while todo:
            c = todo.pop()
            parent: Record | None = None
            for t in range(chain_turns):
                await store.wait_for_room()  # as the request path does (backpressure)
                if parent is not None:
                    was_resident = all(s.data is not None for s in parent.segments)
                    t0 = time.perf_counter()
                    await store.history(parent)
                    (hot if was_resident else cold).append(time.perf_counter() - t0)
                if turn_time:
                    await asyncio.sleep(turn_time)  # the backend generates
                else:
                    await asyncio.sleep(0)
                words = user_words or rng.randint(4, 14), rng.randint(8, 20)
                parent = store.put(make_turn(rng, f"resp_{c:05d}_{t:03d}", *words), parent)
                await store.commit(parent)  # as the HTTP layer does before answering
                stats = store.stats()
                peak["resident"] = max(peak["resident"], stats.resident_bytes)
                peak["pending"] = max(peak["pending"], stats.pending_bytes)
                memory = stats.resident_bytes + stats.pending_bytes
                peak["memory"] = max(peak["memory"], memory)
            assert parent is not None
            heads[c] = parent

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())
    elapsed = time.perf_counter() - started
    await store.flush()
    revisited = 0
    for c in rng.sample(sorted(heads), min(revisits, len(heads))):  # clients come back later
        parent = heads[c]
        was_resident = all(s.data is not None for s in parent.segments)
        t0 = time.perf_counter()
        await store.history(parent)
        (hot if was_resident else cold).append(time.perf_counter() - t0)
        store.put(make_turn(rng, f"resp_{c:05d}_back", 5, 9), parent)
        peak["resident"] = max(peak["resident"], store.stats().resident_bytes)
        revisited += 1
    await store.flush()
    stats = store.stats()
    reads = metrics.spill_reads.get()
    writes = metrics.spill_writes.get()
    await store.close()
    rate = chains * chain_turns / elapsed
    print(f"\n== {chains} chains x {chain_turns} turns, {concurrency} clients, "
          f"{turn_time * 1000:.0f} ms per turn at the backend, cap {cap:,} bytes ==")  # fmt: skip
    print(f"turns stored                          {chains * chain_turns:>10,} "
          f"in {elapsed:.1f}s ({rate:.0f}/s)")  # fmt: skip
    print(f"peak resident bytes                   {peak['resident']:>10,}  "
          f"({peak['resident'] / cap:.2f}x cap)")  # fmt: skip
    print(f"peak bytes queued for the journal     {peak['pending']:>10,}")
    print(f"peak segment bytes in memory (both)   {peak['memory']:>10,}  "
          f"({peak['memory'] / cap:.2f}x cap)")  # fmt: skip
    print(f"on disk at the end                    {stats.disk_bytes:>10,} in "
          f"{stats.disk_segments:,} segments")  # fmt: skip
    print(f"journal segment writes / reads        {int(writes):>10,} / {int(reads):,}  "
          f"(reads: {revisited} chains revisited later)")  # fmt: skip
    print(f"RSS                                   {rss_start:>9.0f}M -> {rss_mib():.0f}M")
    for name, samples in (("hot (all resident)", hot), ("cold (read from disk)", cold)):
        if len(samples) > 1:
            q = statistics.quantiles(samples, n=100)
            print(f"history() {name:<22} n={len(samples):>6}  p50 {q[49] * 1e6:7.0f}us  "
                  f"p99 {q[98] * 1e6:7.0f}us")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=172)
    parser.add_argument("--chains", type=int, default=1000)
    parser.add_argument("--chain-turns", type=int, default=10)
    parser.add_argument("--cap", type=parse_bytes, default=parse_bytes("1MiB"))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turn-time", type=float, default=0.2, help="seconds per turn")
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument(
        "--user-words", type=int, default=0, help="words a turn sends (0: 4-14 at random)"
    )
    parser.add_argument("--revisits", type=int, default=200, help="chains that come back")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        base = args.state_dir or Path(tmp)
        await one_long_chain(args.turns, base / "long")
        await many_chains(
            args.chains,
            args.chain_turns,
            args.cap,
            base / "many",
            args.concurrency,
            args.turn_time,
            user_words=args.user_words,
            revisits=args.revisits,
        )


if __name__ == "__main__":
    asyncio.run(main())
