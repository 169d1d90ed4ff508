"""What a compaction item in a turn's input costs the proxy, next to the same turn with the
summary as a plain message: in-process, no sockets (bench_hotpath.py's harness).

A client that keeps its own history (Codex over HTTP, `store:false`) sends the compaction
item back by value every turn, after the retained messages and before the new ones; the
proxy opens it (cached by its `encrypted_content`) and puts its summary message in its
place. The baseline sends that summary message itself, which the proxy forwards as it
came. Both run the same history (~8k and ~128k tokens), interleaved round by round; the
figure is the difference of the medians (µs per turn).

    python scripts/bench/bench_compaction_item.py            # ~30 s
    python scripts/bench/bench_compaction_item.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import orjson
from bench_hotpath import SIZES, Backend, Client, _connected
from benchkit import make_items, user_message

from ocxproxy.config import Config
from ocxproxy.continuation.compaction import new_item
from ocxproxy.http.context import PROXY, scope_of
from ocxproxy.http.front import FrontEnd
from ocxproxy.server import build_app

SUMMARY = "The user asked for a refactoring of the parser; tests pass; next: docs. " * 20


async def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as state_dir:
        config = Config(
            upstream=("http://backend.invalid:80",),
            state_dir=Path(state_dir),
            zdr=True,
            health_interval=0,
        )
        proxy = build_app(config)[PROXY]
        await proxy.store.start()
        backend = Backend()
        proxy.pool.http._connect = lambda origin: _connected(backend)  # type: ignore[method-assign]
        client = Client(FrontEnd(proxy, web_server=lambda: None))  # type: ignore[arg-type,return-value]
        scope = scope_of({"Authorization": "Bearer sk-bench"})
        token = proxy.sealer.seal(SUMMARY, scope=scope, model="m")
        item = new_item(token)
        plain = orjson.loads(proxy.sealer.open(token, scope))
        try:
            print("µs per store:false turn sent by value, in-process, memory-only store (--zdr)")
            print(f"(median of {args.rounds} rounds of {args.n} turns; min in parentheses)")
            print(f"{'history':<8} {'plain summary':>16} {'compaction item':>16} {'overhead':>9}")
            for name, size in SIZES.items():
                history = make_items(size)
                bodies = [
                    orjson.dumps(
                        {"model": "m", "store": False, "input": [*history, x, user_message("go")]}
                    )
                    for x in (plain, item)
                ]
                for body in bodies:  # warm-up
                    for _ in range(max(args.n // 5, 1)):
                        await client.post(body)
                rounds: list[list[float]] = [[], []]
                for _ in range(args.rounds):
                    for which, body in enumerate(bodies):
                        start = time.perf_counter()
                        for _ in range(args.n):
                            await client.post(body)
                        rounds[which].append((time.perf_counter() - start) / args.n * 1e6)
                medians = [statistics.median(r) for r in rounds]
                cells = [f"{statistics.median(r):>6.1f} ({min(r):>5.1f})" for r in rounds]
                print(f"{name:<8} {cells[0]:>16} {cells[1]:>16} {medians[1] - medians[0]:>+8.1f}")
        finally:
            await proxy.store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="turns per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds = 100, 3
    try:
        import uvloop
    except ImportError:
        asyncio.run(measure(args))
    else:
        uvloop.run(measure(args))


if __name__ == "__main__":
    main()
