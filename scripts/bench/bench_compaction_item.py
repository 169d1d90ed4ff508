"""What a compaction item in a turn's input costs the proxy, next to the same turn with the
summary as a plain message: in-process, no sockets (bench_hotpath.py's harness).

A client that keeps its own history (Codex over HTTP, `store:false`) sends the compaction
item back by value every turn, after the retained messages and before the new ones; the
proxy opens it (cached by its `encrypted_content`) and puts its summary message in its
place. The baseline sends that summary message itself, which the proxy forwards as it
came. Both run the same history (~8k and ~128k tokens), interleaved round by round. Two
figures per path: the whole turn (µs, the fastest round: on a busy machine the medians
swing by more than the difference), and `prepare_exchange` alone (the median call of the
fastest round), the only step whose work differs; the overhead is the difference.

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
from typing import Any

import orjson
from bench_hotpath import SIZES, Backend, Client, _connected
from benchkit import make_items, user_message

from ocxproxy.config import Config
from ocxproxy.continuation.compaction import new_item
from ocxproxy.http import exchange
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
        prepared: list[float] = []
        prepare = exchange.prepare_exchange

        async def timed(*args: Any, **kwargs: Any) -> exchange.Exchange:
            start = time.perf_counter()
            try:
                return await prepare(*args, **kwargs)
            finally:
                prepared.append(time.perf_counter() - start)

        exchange.prepare_exchange = timed
        try:
            print("µs per store:false turn sent by value, in-process, memory-only store (--zdr)")
            print(f"(fastest of {args.rounds} rounds of {args.n} turns: turn / prepare_exchange)")
            print(f"{'history':<8} {'plain summary':>16} {'compaction item':>16} {'overhead':>16}")
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
                turns: list[list[float]] = [[], []]
                prepares: list[list[float]] = [[], []]
                for _ in range(args.rounds):
                    for which, body in enumerate(bodies):
                        prepared.clear()
                        start = time.perf_counter()
                        for _ in range(args.n):
                            await client.post(body)
                        turns[which].append((time.perf_counter() - start) / args.n * 1e6)
                        prepares[which].append(statistics.median(prepared) * 1e6)
                turn, prep = [min(t) for t in turns], [min(p) for p in prepares]
                cells = [f"{t:>7.1f} / {p:>5.1f}" for t, p in zip(turn, prep, strict=True)]
                diff = f"{turn[1] - turn[0]:>+7.1f} / {prep[1] - prep[0]:>+5.1f}"
                print(f"{name:<8} {cells[0]:>16} {cells[1]:>16} {diff:>16}")
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
