"""Store-level figures for the journal at scale. Prints figures; asserts nothing.

    python scripts/bench/bench_journal.py [--records 100000] [--chain 100] [--clients 64]

1. fill: --records durable turns in chains of --chain turns, --clients turns in flight
   (each awaits its commit, as the HTTP layer does): turns/s and commits (fsyncs).
2. checkpoint at full size: its wall time and the longest event-loop stall meanwhile
   (a 1 ms ticker's worst lateness), and the same stall while idle for comparison.
3. restart: start() time (checkpoint + journal replay) and RSS after it, in a fresh process.
4. disk: allocated bytes of the state dir / bytes the store counts (live_bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import orjson

from ocxproxy.model import Turn
from ocxproxy.store import Store


def turn(rid: str, i: int) -> Turn:
    user = orjson.dumps({"role": "user", "content": f"turn {i} of {rid}: please update the config"})
    out = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": f"Done with step {i}; the file is written."}],
    }
    response = {
        "id": rid,
        "object": "response",
        "status": "completed",
        "model": "m",
        "output": [out],
        "usage": {"input_tokens": 50, "output_tokens": 12},
    }
    return Turn(
        rid,
        "scope",
        True,
        user + b"," + orjson.dumps(out),
        2,
        frozenset(),
        orjson.dumps(response),
        backend="http://b",
        affinity_key="root:" + rid,
    )


def make(state: Path) -> Store:
    return Store(
        max_resident_bytes=64 * 1024**2, max_entries=100_000, ttl=30 * 86400.0, state_dir=state
    )


class Ticker:
    """The worst lateness of a 1 ms sleep: how long the loop was kept from running."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - t - 0.001)

    def reset(self) -> None:
        self.worst = 0.0


async def fill(state: Path, n: int, chain: int, clients: int) -> None:
    store = make(state)
    await store.start()
    ticker = Ticker()
    counter = iter(range(n))
    t0 = time.perf_counter()

    async def client() -> None:
        parent, depth = None, 0
        for i in counter:
            if depth == chain:
                parent, depth = None, 0
            record = store.put(turn(f"resp_{i:07d}", depth), parent)
            await store.commit(record)
            parent, depth = record, depth + 1

    await asyncio.gather(*(client() for _ in range(clients)))
    took = time.perf_counter() - t0
    commits = store.metrics.journal_commits.get()
    print(
        f"fill: {n} turns in {took:.1f}s = {n / took:.0f} turns/s, {commits:.0f} commits "
        f"({n / max(commits, 1):.1f} turns per fsync), worst loop stall {ticker.worst * 1e3:.1f} ms"
    )
    await asyncio.sleep(0.2)
    ticker.reset()
    await asyncio.sleep(1.0)
    print(f"idle: worst loop stall {ticker.worst * 1e3:.1f} ms over 1 s")
    ticker.reset()
    t0 = time.perf_counter()
    assert await store.flush()
    took = time.perf_counter() - t0
    print(
        f"checkpoint at {len(store)} records: {took * 1e3:.0f} ms wall, "
        f"worst loop stall meanwhile {ticker.worst * 1e3:.1f} ms"
    )
    # a few more turns so start-up also replays a journal tail
    for i in range(2000):
        await store.commit(store.put(turn(f"tail_{i}", 0), None))
    stats = store.stats()
    t0 = time.perf_counter()
    await store.close()
    print(f"close: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    allocated, n_files = disk_usage(state)
    print(
        f"disk: {allocated / 1e6:.1f} MB allocated, store counts {stats.live_bytes / 1e6:.1f} MB "
        f"-> {allocated / stats.live_bytes:.2f}x; {n_files} files"
    )
    ticker.task.cancel()


def disk_usage(root: Path) -> tuple[int, int]:
    """Allocated bytes (st_blocks) and number of files under `root`."""
    paths = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in paths), len(paths)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def restart(state: Path) -> None:
    before = rss_mib()
    store = make(state)
    t0, cpu = time.perf_counter(), time.process_time()
    await store.start()
    took, cpu = time.perf_counter() - t0, time.process_time() - cpu
    print(
        f"restart: start() {took:.2f}s ({cpu:.2f}s CPU, both threads) for {len(store)} "
        f"records; RSS {rss_mib():.0f} MiB (interpreter + imports {before:.0f} MiB)"
    )
    await store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--chain", type=int, default=100)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--restart-only", metavar="DIR", help="only time a start on DIR")
    parser.add_argument("--keep", metavar="DIR", help="fill DIR/state and keep it")
    args = parser.parse_args()
    if args.restart_only:
        asyncio.run(restart(Path(args.restart_only)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(args.keep or tmp) / "state"
        asyncio.run(fill(state, args.records, args.chain, args.clients))
        subprocess.run([sys.executable, __file__, "--restart-only", str(state)], check=True)


if __name__ == "__main__":
    main()
