"""What a conversation turn costs next to a previous_response_id turn, at ~8k tokens.

Starts scripts/instant_backend.py and the proxy (`serve`, benchkit's arguments) as
subprocesses. Per block, both get the same ~32 KB (~8k tokens) of realistic items as a
first turn: a chain (`input`, no state) and a conversation (`conversation`, created empty
first). Then --block turns of each, one small user message at a time, interleaved in
random order over one keep-alive connection:
  chain         POST /v1/responses {previous_response_id: <last>, input: [message]}
  conversation  POST /v1/responses {conversation: <id>, input: [message]}
so both histories grow alike. Reported: latency percentiles of each, the median of the
per-pair differences (conversation - chain), and the proxy's CPU per turn of each
(/proc/PID/stat, over runs of --block turns of one kind) and the bytes it wrote a turn
(/proc/PID/io write_bytes: the journal's, which the turn's fdatasync waits for). The
backend costs the same for both, so the difference is what the conversation path adds: its
lock, reading its meta, and writing its record after the turn. With --long N, then a chain
and a conversation grown side by side to N turns, and the bytes written a turn at turns
20-40 and at the last 20: a turn's journal entry should not grow with its history.

    .venv/bin/python scripts/bench/bench_conversation.py              # ~1 min
    .venv/bin/python scripts/bench/bench_conversation.py --long 400   # + the long part
    .venv/bin/python scripts/bench/bench_conversation.py --quick      # smoke, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from benchkit import (  # noqa: E402
    BYTES_PER_TOKEN,
    PYTHON,
    Summary,
    cpu_seconds,
    make_items,
    running,
    start_backend,
    start_proxy,
    table,
    us,
    user_message,
)

HISTORY_BYTES = 32 * 1024


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, data=orjson.dumps(body)) as r:
        data = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {data[:300]!r}")
        result: dict[str, Any] = orjson.loads(data)
        return result


def write_bytes(pid: int) -> int:
    """Bytes the process caused to be written to storage (page cache dirtied), so far."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


async def grow(
    http: aiohttp.ClientSession, base: str, pid: int, items: list[Any], turns: int
) -> dict[str, list[float]]:
    """A chain and a conversation grown side by side to `turns` turns: the bytes written a
    turn of each, at turns 20-40 and over the last 20 (one turn of one kind at a time)."""
    chain = (await post(http, base + "/responses", {"model": "m", "input": items}))["id"]
    conv = (await post(http, base + "/conversations", {}))["id"]
    await post(http, base + "/responses", {"model": "m", "input": items, "conversation": conv})
    windows = [(20, 40), (turns - 20, turns)]
    written: dict[str, list[float]] = {"chain": [0.0, 0.0], "conversation": [0.0, 0.0]}
    for i in range(1, turns + 1):
        for kind in ("chain", "conversation"):
            body: dict[str, Any] = {"model": "m", "input": [user_message(f"long {i}")]}
            body["previous_response_id" if kind == "chain" else "conversation"] = (
                chain if kind == "chain" else conv
            )
            before = write_bytes(pid)
            answer = await post(http, base + "/responses", body)
            took = write_bytes(pid) - before
            if kind == "chain":
                chain = answer["id"]
            for w, (start, end) in enumerate(windows):
                if start < i <= end:
                    written[kind][w] += took / (end - start)
    return written


async def run(args: argparse.Namespace, proxy_url: str, pid: int) -> None:
    base = proxy_url + "/v1"
    items = make_items(HISTORY_BYTES, seed=3)
    size = len(orjson.dumps(items))
    headers = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}
    latency: dict[str, list[float]] = {"chain": [], "conversation": []}
    cpu: dict[str, list[float]] = {"chain": [], "conversation": []}
    wrote: dict[str, list[float]] = {"chain": [], "conversation": []}
    diffs: list[float] = []
    rng = random.Random(1)
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as http:
        for block in range(args.blocks):
            chain = (await post(http, base + "/responses", {"model": "m", "input": items}))["id"]
            conv = (await post(http, base + "/conversations", {}))["id"]
            await post(
                http, base + "/responses", {"model": "m", "input": items, "conversation": conv}
            )
            turns = []
            for i in range(args.block):
                message = [user_message(f"turn {block}.{i}: go on")]
                pair = [("chain", message), ("conversation", message)]
                rng.shuffle(pair)
                turns.append(pair)
            # Latency: pairs in random order; CPU: a run of one kind, then of the other.
            for pair in turns[: args.block // 2]:
                took: dict[str, float] = {}
                for kind, message in pair:
                    body: dict[str, Any] = {"model": "m", "input": message}
                    if kind == "chain":
                        body["previous_response_id"] = chain
                    else:
                        body["conversation"] = conv
                    start = time.perf_counter()
                    answer = await post(http, base + "/responses", body)
                    took[kind] = time.perf_counter() - start
                    if kind == "chain":
                        chain = answer["id"]
                for kind, seconds in took.items():
                    latency[kind].append(seconds)
                diffs.append(took["conversation"] - took["chain"])
            rest = turns[args.block // 2 :]
            for kind in rng.sample(["chain", "conversation"], 2):
                before, bytes_before = cpu_seconds(pid), write_bytes(pid)
                for _ in rest:
                    body = {"model": "m", "input": [user_message("and then?")]}
                    if kind == "chain":
                        body["previous_response_id"] = chain
                    else:
                        body["conversation"] = conv
                    answer = await post(http, base + "/responses", body)
                    if kind == "chain":
                        chain = answer["id"]
                cpu[kind].append((cpu_seconds(pid) - before) / len(rest))
                wrote[kind].append((write_bytes(pid) - bytes_before) / len(rest))
        long = await grow(http, base, pid, items, args.long) if args.long else None
    print(
        f"history: {size} B (~{size // BYTES_PER_TOKEN} tokens) first turn, growing by one "
        f"small turn per request; {args.blocks} blocks of {args.block} turns of each; {PYTHON}"
    )
    rows = []
    for kind in ("chain", "conversation"):
        s = Summary.of(latency[kind])
        c = sum(cpu[kind]) / len(cpu[kind])
        w = sum(wrote[kind]) / len(wrote[kind])
        rows.append([kind, s.n, us(s.p50), us(s.p90), us(s.p99), us(c), f"{w:,.0f} B"])
    print(table(["turn", "n", "p50", "p90", "p99", "proxy CPU/turn", "written/turn"], rows))
    d = Summary.of(diffs)
    c_diff = sum(cpu["conversation"]) / len(cpu["conversation"]) - sum(cpu["chain"]) / len(
        cpu["chain"]
    )
    print(f"conversation - chain: median of per-pair differences {us(d.p50)}, CPU {us(c_diff)}")
    if long is not None:
        print(f"grown to {args.long} turns each, bytes written a turn (write_bytes):")
        rows = [[k, f"{w[0]:,.0f} B", f"{w[1]:,.0f} B"] for k, w in long.items()]
        print(table(["turn", "turns 21-40", f"turns {args.long - 19}-{args.long}"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block", type=int, default=40, help="turns of each kind per block")
    parser.add_argument("--long", type=int, default=0, help="then grow both to N turns (>= 60)")
    parser.add_argument("--quick", action="store_true", help="smoke: 2 blocks of 6")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.block = 2, 6
    if args.long and args.long < 60:
        parser.error("--long needs at least 60 turns (it compares turns 21-40 with the last 20)")
    backend = start_backend()
    with running(backend):
        proxy = start_proxy(backend.url)
        with running(proxy):
            asyncio.run(run(args, proxy.url, proxy.pid))


if __name__ == "__main__":
    main()
