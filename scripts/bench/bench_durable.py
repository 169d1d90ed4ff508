"""The durable store at deployment scale: its figures from one run, black-box.

Everything runs against real `python -m ocxproxy serve` processes on the default durable
configuration (no --zdr, default budgets, each with a fresh --state-dir) in front of
scripts/bench/instant_backend.py, driven from outside over loopback HTTP:

  1. latency: fill a store to N records through the proxy (16 closed-loop chains of 100
     turns), then continuation turns open loop at --rate turns/s over 64 chains for
     --duration s; latency counts from each turn's scheduled send time. Both N in this run
     (--small-records, --records), each its own proxy; the small store is the baseline of
     the ratio. Each store runs alone, as a deployed proxy does: the small store's window
     is split around the big one's (A B A), so both are centred on the same moment and a
     slow minute of the shared disk or box falls on both alike. With --together both run
     in the same seconds instead, their commits reaching the disk in the same instants.
  2. RSS of the filled proxy (VmRSS, and peak VmHWM); allocated bytes of its state dir
     (st_blocks * 512) ÷ the bytes the store counts (ocxproxy_store_bytes in /metrics, every
     tier that is not memory) once its writes have settled.
  3. kill -9: on the big store, --kills rounds of open-loop traffic killed with SIGKILL at a
     random moment, restarted on the same dir; every turn whose 200 arrived must be there
     after the restart (GET /v1/responses/{id}, and each chain continues).
  4. start-up: a SIGTERM (timed), then a fresh start on the big store, timed to /readyz 200.
  5. throughput: 16 closed-loop clients for --throughput-duration s, durable and --zdr in
     --throughput-rounds ABBA rounds, each run counted until its graceful stop completes
     (until the state is durable); durable ÷ zdr of the pooled runs, and the CPU time the
     proxy and its fsync helper used per turn in each window (from /proc: CPU time, not
     wall time, so the other load on a shared box is not counted), durable ÷ zdr, with
     the helper's part of it and the turns each fsync carried.

Beside all of it, a canary in the state dirs' file system (disk_canary.Watch) writes 550
bytes and fdatasyncs them every 25 ms, and each latency and throughput window is reported
with the disk's own syncs in the same seconds: no durable turn is answered before its sync,
so a window's max cannot be below the disk's worst stall in it (--no-disk-watch: off).
Beside the absolute latency figures, the promise relative to the disk (`--durability
ack`, the default), at both store sizes, against the canary's syncs in the same window:
continuation p99 ≤ 2x the canary's p99 + 2 ms and max ≤ the canary's max + 20 ms, each
with the number of turns and of syncs its percentile is taken over.

Flags the proxy does not know are detected from `serve --help` (so the script also runs
against older versions of the proxy, for an A/B). The box has 2 cores shared with
everything else running on it: the load generator shares them with the proxy and the
backend, so figures are noisy.

    .venv/bin/python scripts/bench/bench_durable.py              # ~5 min at 100,000 records
    .venv/bin/python scripts/bench/bench_durable.py --quick      # smoke, seconds
    .venv/bin/python scripts/bench/bench_durable.py --only-throughput   # part 5 alone
    .venv/bin/python scripts/bench/bench_durable.py --only-latency      # part 1 alone
    .venv/bin/python scripts/bench/bench_durable.py --only-latency --zdr  # its floor: no sync
    .venv/bin/python scripts/bench/bench_durable.py --only-rss --turn-bytes 1000 \
        --chain-turns 10 --unique-item-ids       # part 2 alone: ~1 KB turns, chains of 10
                                                 # (filled, then restarted on its state dir;
                                                 # who holds what: --tracemalloc N, slow;
                                                 # --rss-turns 200000: at its cap a while)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from benchkit import (  # noqa: E402
    BENCH,
    PYTHON,
    Child,
    Summary,
    add_common_options,
    cpu_seconds,
    raise_priority,
    start_backend,
    start_child,
    status_kib,
    table,
    verdict,
)
from disk_canary import STALL, Watch, describe, tail  # noqa: E402

READY = r"ocxproxy listening on (http://\S+?)/v1"
_ID = re.compile(rb'"id":"(resp_[^"]*)"')
_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.I)
_CLOSE = re.compile(rb"\r\nconnection: *close", re.I)
_STORE_BYTES = re.compile(r'^ocxproxy_store_bytes\{tier="([^"]+)"\} (\S+)$', re.M)
MEMORY_TIERS = ("resident", "pending")  # ocxproxy_store_bytes tiers that are not on disk
MAX_IN_FLIGHT = 256  # open-loop arrivals beyond this are skipped (serve's --max-connections: 512)
STARTED: list[Child] = []  # every proxy process, stopped at the end whatever happens


# -- HTTP ------------------------------------------------------------------------------------


class Http:
    """HTTP/1.1 keep-alive requests to one server over a pool of raw connections: far less
    CPU per request than an aiohttp client, which shares the 2 cores with the proxy."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.last_error = ""  # the last failed create's status and body, for messages

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """(status, body); raises OSError / IncompleteReadError if the server goes away."""
        if self.idle:
            try:
                return await self._request(self.idle.pop(), method, path, body)
            except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
                if getattr(exc, "partial", b""):
                    raise
                # The server closed this idle connection (--keepalive-timeout) as it was
                # reused, before reading a byte of the request: send it on a new one, as
                # HTTP clients do.
        connection = await asyncio.open_connection(self.host, self.port)
        return await self._request(connection, method, path, body)

    async def _request(
        self,
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        method: str,
        path: str,
        body: bytes,
    ) -> tuple[int, bytes]:
        reader, writer = connection
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer sk-bench"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        try:
            writer.write(head.encode() + body)
            response = await reader.readuntil(b"\r\n\r\n")
            status = int(response[9:12])
            m = _LENGTH.search(response)
            if m is not None:
                data = await reader.readexactly(int(m.group(1)))
            else:  # chunked
                chunks = []
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    chunk = await reader.readexactly(size + 2)
                    if size == 0:
                        break
                    chunks.append(chunk[:-2])
                data = b"".join(chunks)
        except BaseException:
            writer.close()
            raise
        if _CLOSE.search(response):
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, data

    async def create(self, body: dict[str, object]) -> tuple[int, str | None]:
        """POST /v1/responses: (status, response id); status 0 if the connection failed."""
        try:
            status, data = await self.request("POST", "/v1/responses", orjson.dumps(body))
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self.last_error = repr(exc)
            return 0, None
        m = _ID.search(data)
        if status != 200 or m is None:
            self.last_error = f"{status} {data[:300]!r}"
            return status, None
        return status, m.group(1).decode()

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


def turn_body(prev: str | None, text: str) -> dict[str, object]:
    body: dict[str, object] = {"model": "bench", "input": [{"role": "user", "content": text}]}
    if prev is not None:
        body["previous_response_id"] = prev
    return body


async def gather_limited(n: int, jobs: list[Callable[[], Awaitable[None]]]) -> None:
    queue = list(reversed(jobs))

    async def run() -> None:
        while queue:
            await queue.pop()()

    await asyncio.gather(*(run() for _ in range(n)))


# -- proxy processes -------------------------------------------------------------------------


def serve_flags() -> str:
    out = subprocess.run(
        [PYTHON, "-m", "ocxproxy", "serve", "--help"], capture_output=True, text=True, check=True
    )
    return out.stdout


@dataclass
class Proxy:
    """One `ocxproxy serve` process on a state dir, with how long it took to be ready."""

    child: Child
    state: Path
    startup: float  # seconds from spawn to /readyz 200

    @property
    def pid(self) -> int:
        return self.child.pid

    def kill9(self) -> None:
        self.child.proc.send_signal(signal.SIGKILL)
        self.child.proc.wait(10)

    def stop(self) -> float:
        """SIGTERM; the seconds until the process has exited (its graceful stop)."""
        start = time.perf_counter()
        self.child.proc.send_signal(signal.SIGTERM)
        try:
            self.child.proc.wait(600)
        except subprocess.TimeoutExpired:
            self.child.proc.kill()
            self.child.proc.wait(10)
        return time.perf_counter() - start

    async def metrics(self) -> str:
        http = Http(self.child.url)
        try:
            _, data = await http.request("GET", "/metrics")
        finally:
            http.close()
        return data.decode()


async def start_proxy(
    upstream: str, state: Path, name: str, *extra: str, memory: Memory | None = None
) -> Proxy:
    """With `memory`, the proxy runs under memory_proxy.py, which reports its memory."""
    program = [str(BENCH / "memory_proxy.py")] if memory else ["-m", "ocxproxy"]
    argv = [PYTHON, *program, "serve", "--upstream", upstream, "--port", "0"]
    argv += ["--state-dir", str(state), "--log-level", "warning", *extra]
    start = time.perf_counter()
    # Bytecode cached, as an installed package has it: where PYTHONDONTWRITEBYTECODE is
    # set (this box), every start would compile ocxproxy's modules again (~0.2 s CPU).
    env = {"PYTHONDONTWRITEBYTECODE": ""}
    if memory:
        env |= {"OCXPROXY_MEMORY_OUT": str(memory.out), "OCXPROXY_TRACEMALLOC": memory.frames}
    child = await asyncio.to_thread(start_child, name, argv, READY, timeout=600, env=env)
    STARTED.append(child)
    http = Http(child.url)
    try:
        while True:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                if (await http.request("GET", "/readyz"))[0] == 200:
                    break
            if child.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {child.log.read_text()[-2000:]}")
            await asyncio.sleep(0.01)
    finally:
        http.close()
    return Proxy(child, state, time.perf_counter() - start)


# -- load ------------------------------------------------------------------------------------


async def closed_loop(
    http: Http,
    clients: int,
    chain_turns: int,
    *,
    turns: int = 0,
    seconds: float = 0.0,
    turn_bytes: int = 0,
) -> tuple[int, int]:
    """`clients` chains back to back, each restarting after `chain_turns` turns, until
    `turns` turns were sent or `seconds` passed. (turns acknowledged, failures)."""
    done = [0, 0]
    sent = 0
    end = time.perf_counter() + seconds
    report = [time.perf_counter() + 10]

    def more() -> bool:
        nonlocal sent
        now = time.perf_counter()
        if now > report[0]:
            report[0] = now + 10
            progress(f"{done[0]:,} turns")
        sent += 1
        return sent <= turns if turns else now < end

    async def client(n: int) -> None:
        while True:
            head: str | None = None
            for turn in range(chain_turns):
                if not more():
                    return
                text = f"client {n} turn {turn} "
                text += "x" * (turn_bytes - len(text))  # (no padding when turn_bytes is 0)
                status, rid = await http.create(turn_body(head, text))
                if rid is None:
                    done[1] += 1
                    if status == 0:
                        await asyncio.sleep(0.05)
                    break
                head = rid
                done[0] += 1

    await asyncio.gather(*(client(n) for n in range(clients)))
    return done[0], done[1]


@dataclass
class OpenLoop:
    """Continuations at a fixed rate over `chains` chains, timed from the scheduled send."""

    http: Http
    rate: float
    chains: int
    heads: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    acked: list[str] = field(default_factory=list)
    skipped: int = 0  # arrivals dropped because too many were in flight

    async def start_chains(self) -> None:
        """A first turn per chain; a refusal (a proxy still busy with the last phase) is
        retried for up to a minute."""
        deadline = time.perf_counter() + 60
        for n in range(self.chains):
            while (rid := (await self.http.create(turn_body(None, f"chain {n}")))[1]) is None:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"could not start a chain: {self.http.last_error}")
                await asyncio.sleep(0.5)
            self.heads.append(rid)

    async def run(self, seconds: float, stop: asyncio.Event | None = None) -> None:
        clock = time.perf_counter  # not loop.time(): uvloop's ticks in whole milliseconds
        start = clock()
        pending: set[asyncio.Task[None]] = set()
        n = 0
        while n < seconds * self.rate and not (stop and stop.is_set()):
            at = start + n / self.rate
            delay = at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(pending) >= MAX_IN_FLIGHT:
                self.skipped += 1
            else:
                task = asyncio.ensure_future(self._one(n % self.chains, at, n))
                pending.add(task)
                task.add_done_callback(pending.discard)
            n += 1
        if pending:
            await asyncio.wait(pending)

    async def _one(self, chain: int, at: float, n: int) -> None:
        status, rid = await self.http.create(turn_body(self.heads[chain], f"turn {n}"))
        self.statuses[status] += 1
        if rid is not None:
            self.latencies.append(time.perf_counter() - at)
            self.heads[chain] = rid
            self.acked.append(rid)


# -- measurements ----------------------------------------------------------------------------


@dataclass
class Store:
    records: int
    fill_seconds: float
    fill_failures: int
    latency: Summary
    over_50ms: float
    statuses: Counter[int]
    skipped: int
    rss_mib: float = 0.0
    hwm_mib: float = 0.0
    allocated: int = 0
    counted: dict[str, float] = field(default_factory=dict)
    disk: list[float] = field(default_factory=list)  # the canary's syncs in the window
    late: list[float] = field(default_factory=list)  # how late the canary woke for them
    commits: int = 0  # the proxy's journal group commits (fsyncs) in the window

    @property
    def errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)


def allocated_bytes(root: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def entries(metrics: str) -> int:
    """Records the store holds (ocxproxy_store_entries{tier="records"})."""
    m = re.search(r'^ocxproxy_store_entries\{tier="records"\} (\S+)$', metrics, re.M)
    return int(float(m.group(1))) if m else -1


def journal_commits(metrics: str) -> int:
    """Journal group commits so far (ocxproxy_journal_commits_total; 0 under --zdr)."""
    m = re.search(r"^ocxproxy_journal_commits_total (\S+)$", metrics, re.M)
    return int(float(m.group(1))) if m else 0


def disk_tiers(metrics: str) -> dict[str, float]:
    return {tier: float(v) for tier, v in _STORE_BYTES.findall(metrics)}


async def settle(proxy: Proxy, limit: float) -> float:
    """Wait (up to `limit` s) until no bytes wait to be written; the seconds it took."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        if disk_tiers(await proxy.metrics()).get("pending", 0.0) == 0.0:
            break
        await asyncio.sleep(0.2)
    return time.perf_counter() - start


def progress(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Filled:
    """A proxy filled to `made` records, ready for its latency window."""

    proxy: Proxy
    http: Http
    made: int
    seconds: float
    failures: int


async def fill_store(
    backend: str,
    state: Path,
    records: int,
    args: argparse.Namespace,
    *,
    memory: Memory | None = None,
) -> Filled:
    extra = ("--zdr",) if args.zdr else ()
    proxy = await start_proxy(backend, state, f"proxy-{records}", *extra, memory=memory)
    http = Http(proxy.child.url)
    start = time.perf_counter()
    made, failures = await closed_loop(
        http, 16, args.chain_turns, turns=records, turn_bytes=args.turn_bytes
    )
    fill = time.perf_counter() - start
    progress(f"{made:,} records in {fill:.1f} s ({made / fill:,.0f}/s)")
    await settle(proxy, 60)
    return Filled(proxy, http, made, fill, failures)


async def latency_windows(
    filled: list[Filled], args: argparse.Namespace, watch: Watch | None
) -> list[Store]:
    """The two filled proxies' open-loop windows, each alone, A B A (or both in the same
    seconds with --together), then each one's RSS and allocation once its writes settled."""
    loads = [OpenLoop(f.http, args.rate, 64) for f in filled]
    for load in loads:
        await load.start_chains()
    before = [journal_commits(await f.proxy.metrics()) for f in filled]
    windows: list[list[tuple[float, float]]] = [[] for _ in loads]
    if args.together:
        start = time.monotonic()
        await asyncio.gather(*(load.run(args.duration) for load in loads))
        windows = [[(start, time.monotonic())] for _ in loads]
    else:
        small, big = range(2)
        for which, seconds in ((small, 0.5), (big, 1.0), (small, 0.5)):
            start = time.monotonic()
            await loads[which].run(args.duration * seconds)
            windows[which].append((start, time.monotonic()))
    stores = []
    for f, load, spans, commits in zip(filled, loads, windows, before, strict=True):
        lat = Summary.of(load.latencies)
        slow = sum(1 for x in load.latencies if x > 0.05) / max(len(load.latencies), 1)
        store = Store(f.made, f.seconds, f.failures, lat, slow, load.statuses, load.skipped)
        if watch:
            store.disk = [sync for span in spans for sync in watch.between(*span)]
            store.late = [late for span in spans for late in watch.late(*span)]
        await settle(f.proxy, 120)
        store.rss_mib = status_kib(f.proxy.pid, "VmRSS") / 1024
        store.hwm_mib = status_kib(f.proxy.pid, "VmHWM") / 1024
        metrics = await f.proxy.metrics()
        store.counted = disk_tiers(metrics)
        store.commits = journal_commits(metrics) - commits
        store.allocated = allocated_bytes(f.proxy.state)
        f.http.close()
        stores.append(store)
    return stores


@dataclass
class Kills:
    rounds: int = 0
    acked: int = 0
    lost: int = 0
    chains_broken: int = 0
    restarts: list[float] = field(default_factory=list)  # start-up after each kill
    examples: list[str] = field(default_factory=list)


async def kill_rounds(
    backend: str, proxy: Proxy, args: argparse.Namespace, rng: random.Random
) -> tuple[Kills, Proxy]:
    """Open-loop traffic killed with SIGKILL at a random moment, restarted on the same
    state dir; every acknowledged turn must be there afterwards (from every round)."""
    result = Kills()
    everything: list[str] = []
    for n in range(args.kills):
        http = Http(proxy.child.url)
        load = OpenLoop(http, args.rate, 16)
        await load.start_chains()
        if (await http.request("GET", f"/v1/responses/{load.heads[0]}"))[0] != 200:
            raise RuntimeError("GET of a stored response failed: the check below would be void")
        everything += load.heads  # acknowledged too
        stop = asyncio.Event()
        traffic = asyncio.ensure_future(load.run(3600, stop))
        await asyncio.sleep(rng.uniform(0.5, args.kill_after))
        proxy.kill9()
        stop.set()
        await traffic
        http.close()
        everything += load.acked
        proxy = await start_proxy(backend, proxy.state, f"proxy-kill{n}")
        result.restarts.append(proxy.startup)
        http = Http(proxy.child.url)
        missing = await missing_ids(http, everything)
        chains = [await http.create(turn_body(head, "after the kill")) for head in load.heads]
        http.close()
        result.rounds += 1
        result.acked = len(everything)
        result.lost = len(missing)
        result.chains_broken += sum(1 for status, _ in chains if status != 200)
        result.examples = missing[:3]
        progress(
            f"kill -9 #{n + 1}: {len(load.acked)} turns acknowledged this round, "
            f"{len(missing)} of {len(everything)} acknowledged so far missing; "
            f"restart to /readyz {proxy.startup:.2f} s"
        )
    return result, proxy


async def missing_ids(http: Http, ids: list[str]) -> list[str]:
    missing: list[str] = []

    def job(rid: str) -> Callable[[], Awaitable[None]]:
        async def get() -> None:
            status, _ = await http.request("GET", f"/v1/responses/{rid}")
            if status != 200:
                missing.append(rid)

        return get

    await gather_limited(16, [job(rid) for rid in ids])
    return missing


@dataclass
class Throughput:
    label: str
    turns: int
    failures: int
    window: float
    stop: float
    cpu: float = 0.0  # CPU seconds the proxy and its fsync helper used in the window
    helper: float = 0.0  # of which the fsync helper's
    fsyncs: int = 0  # journal commits in the window (one write and fdatasync each)
    disk: list[float] = field(default_factory=list)  # the canary's syncs in the window

    @property
    def tps(self) -> float:
        return self.turns / (self.window + self.stop)


def pooled(runs: list[Throughput], label: str) -> float:
    """Turns/s of every run of a configuration together, each counted until stopped."""
    mine = [t for t in runs if t.label == label]
    return sum(t.turns for t in mine) / sum(t.window + t.stop for t in mine)


async def throughput(
    backend: str,
    state: Path,
    label: str,
    args: argparse.Namespace,
    watch: Watch | None,
    *extra: str,
) -> Throughput:
    proxy = await start_proxy(backend, state, f"proxy-{label}", *extra)
    http = Http(proxy.child.url)
    fsyncs = journal_commits(await proxy.metrics())
    start, (cpu, helper) = time.monotonic(), family_cpu(proxy.pid)
    turns, failures = await closed_loop(http, 16, 100, seconds=args.throughput_duration)
    end, (cpu_end, helper_end) = time.monotonic(), family_cpu(proxy.pid)
    cpu, helper = cpu_end - cpu, helper_end - helper
    fsyncs = journal_commits(await proxy.metrics()) - fsyncs
    http.close()
    stop = proxy.stop()
    window = end - start
    progress(f"{label}: {turns / window:,.0f} turns/s in the window, graceful stop {stop:.2f} s")
    return Throughput(
        label, turns, failures, window, stop, cpu, helper, fsyncs,
        watch.between(start, end) if watch else [],
    )  # fmt: skip


def family_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of a process and its children (the fsync helper), and
    of the children alone, as the kernel counts them: CPU time, not wall time, so the
    other load on a shared box does not count against either configuration. A child is
    listed under the thread that started it (the helper is started in a thread), so every
    thread's list is read."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    total = helper = 0.0
    for p in (pid, *children):
        with contextlib.suppress(OSError):
            seconds = cpu_seconds(p)
            total += seconds
            helper += seconds if p != pid else 0.0
    return total, helper


def cpu_per_turn(runs: list[Throughput], label: str) -> float:
    """CPU seconds per acknowledged turn of every run of a configuration together."""
    mine = [t for t in runs if t.label == label]
    return sum(t.cpu for t in mine) / max(1, sum(t.turns for t in mine))


async def throughput_rounds(
    backend: str, root: Path, args: argparse.Namespace, watch: Watch | None
) -> list[Throughput]:
    # zdr, durable, durable, zdr, ...: load that drifts on a shared box cancels out.
    tput = []
    for n in range(args.throughput_rounds):
        for zdr in (True, False) if n % 2 == 0 else (False, True):
            state = root / f"throughput-{n}-{zdr}"
            extra = ("--zdr",) if zdr else ()
            label = "--zdr" if zdr else "durable"
            tput.append(await throughput(backend, state, label, args, watch, *extra))
    return tput


# -- report ------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def disk_max(syncs: list[float]) -> str:
    return ms(max(syncs)) if syncs else "-"


def report_throughput(tput: list[Throughput]) -> tuple[float, float]:
    """The throughput table; pooled turns/s (--zdr, durable)."""
    zdr, durable = pooled(tput, "--zdr"), pooled(tput, "durable")
    print("\n## Throughput, 16 closed-loop clients, counted until the graceful stop completes")
    rows = [
        [
            t.label,
            t.turns,
            t.failures,
            f"{t.window:.1f}",
            f"{t.stop:.2f}",
            f"{t.turns / t.window:,.0f}",
            f"{t.tps:,.0f}",
            disk_max(t.disk),
            f"{sum(s for s in t.disk if s > STALL):.1f}" if t.disk else "-",
            f"{t.cpu / max(1, t.turns) * 1e6:,.0f}",
            f"{t.helper / max(1, t.turns) * 1e6:,.0f}" if t.fsyncs else "-",
            f"{t.turns / t.fsyncs:.1f}" if t.fsyncs else "-",
        ]
        for t in tput
    ]
    headers = ["configuration", "turns", "failures", "window s", "stop s", "in window/s"]
    headers += ["turns/s incl. stop", "disk max sync ms", "disk stalled s", "CPU µs/turn"]
    headers += ["of it helper's"]
    headers += ["turns/fsync"]
    print(table(headers, rows))
    if any(t.disk for t in tput):
        print(
            f"(the disk canary's syncs in each window; stalled: its syncs over "
            f"{STALL * 1000:.0f} ms, summed: durable turns wait those out, --zdr ones do not)"
        )
    print(f"durable ÷ --zdr: {durable / zdr:.2f}x ({durable:,.0f} / {zdr:,.0f} turns/s)")
    cpu_zdr, cpu_durable = cpu_per_turn(tput, "--zdr"), cpu_per_turn(tput, "durable")
    print(
        f"CPU per turn (the proxy and its fsync helper, process CPU time in the window), "
        f"durable ÷ --zdr: {cpu_durable / cpu_zdr:.2f}x "
        f"({cpu_durable * 1e6:,.0f} / {cpu_zdr * 1e6:,.0f} µs)"
    )
    return zdr, durable


def report_latency(small: Store, big: Store, args: argparse.Namespace) -> None:
    when = "both stores in the same seconds" if args.together else "each store alone, A B A"
    print(
        f"\n## Continuation latency, {args.rate:g} turns/s open loop per store, "
        f"{args.duration:g} s, {when}" + (", --zdr (no turn waits for a sync)" if args.zdr else "")
    )
    headers = ["store", "fill turns/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "> 50 ms"]
    headers += ["non-200", "skipped", "fsyncs", "VmRSS", "VmHWM"]
    rows = []
    for s in (small, big):
        codes = ", ".join(f"{n}x{c}" for c, n in sorted(s.statuses.items()) if c != 200)
        rows.append(
            [
                f"{s.records:,} records",
                f"{s.records / s.fill_seconds:,.0f}",
                ms(s.latency.p50),
                ms(s.latency.p90),
                ms(s.latency.p99),
                ms(s.latency.max),
                f"{s.over_50ms:.1%}",
                codes or "0",
                s.skipped,
                f"{s.commits:,}",
                f"{s.rss_mib:,.0f} MiB",
                f"{s.hwm_mib:,.0f} MiB",
            ]
        )
    print(table(headers, rows))
    if big.disk:
        same = "the same seconds" if args.together else "its own windows' seconds"
        for s in (small, big):
            print(f"the disk's own fdatasync in {same} ({s.records:,}): {describe(s.disk)}")
    ratio = big.latency.p99 / small.latency.p99
    print(
        f"p99 {big.records:,} ÷ {small.records:,} records: {ratio:.2f}x (target ≤ 2x); "
        f"max at {big.records:,}: {ms(big.latency.max)} ms (target ≤ 100 ms)"
    )
    if big.disk:
        note = " (--zdr: no turn waited for a sync; the bound for comparison)" if args.zdr else ""
        for row in (*disk_relative(small), *disk_relative(big)):
            print(f"{row[0]}: {row[2]} (target {row[1]}): {row[3]}{note}")


def disk_relative(s: Store) -> list[list[str]]:
    """The latency promise relative to the disk (--durability ack): against the canary's
    syncs in the window's own seconds, p99 ≤ 2x their p99 + 2 ms and max ≤ their max +
    20 ms. Rows of the figures table; none without the canary."""
    syncs, p99, worst = tail(s.disk)
    if not syncs:
        return []
    p99_bound, max_bound = 2 * p99 + 0.002, worst + 0.020
    turns = f"{s.latency.n:,} turns"
    return [
        [
            f"continuation p99 at {s.records:,} records vs the disk's (ack)",
            "≤ 2x disk p99 + 2 ms",
            f"{ms(s.latency.p99)} ms of {turns}; bound {ms(p99_bound)} ms "
            f"(disk p99 {ms(p99)} ms of {syncs:,} syncs)",
            verdict(s.latency.p99 <= p99_bound),
        ],
        [
            f"continuation max at {s.records:,} records vs the disk's (ack)",
            "≤ disk max + 20 ms",
            f"{ms(s.latency.max)} ms of {turns}; bound {ms(max_bound)} ms "
            f"(disk max {ms(worst)} ms of {syncs:,} syncs; the box meanwhile stalled the "
            f"canary up to {ms(max(s.late, default=0.0))} ms, not counted in the bound)",
            verdict(s.latency.max <= max_bound),
        ],
    ]


def report(
    small: Store,
    big: Store,
    kills: Kills,
    startup: float,
    loaded: int,
    stop: float,
    tput: list[Throughput],
    args: argparse.Namespace,
) -> None:
    report_latency(small, big, args)
    counted = sum(v for tier, v in big.counted.items() if tier not in MEMORY_TIERS)
    tiers = ", ".join(f"{tier} {mib(v)}" for tier, v in sorted(big.counted.items()))
    print(f"ocxproxy_store_bytes at {big.records:,} records: {tiers or 'none'}")
    print(f"state dir allocated (st_blocks x 512): {mib(big.allocated)}")
    zdr, durable = report_throughput(tput)

    p99_ratio = big.latency.p99 / small.latency.p99
    alloc_ratio = big.allocated / counted if counted else float("inf")
    alloc = f"{alloc_ratio:.2f}x" if counted else "∞ (the store counts 0 bytes)"
    t_ratio = durable / zdr
    print("\n## Figures (default durable configuration)")
    lost = f"{kills.lost} of {kills.acked} ({kills.rounds} kills)"
    if kills.chains_broken:
        lost += f"; {kills.chains_broken} chain continuations failed"
    figures = [
        [
            f"continuation p99 at {big.records:,} ÷ p99 at {small.records:,} records",
            "≤ 2x",
            f"{p99_ratio:.2f}x ({ms(big.latency.p99)} / {ms(small.latency.p99)} ms)",
            verdict(p99_ratio <= 2),
        ],
        [
            f"continuation max at {big.records:,} records (at {small.records:,})",
            "≤ 100 ms",
            f"{ms(big.latency.max)} ms ({ms(small.latency.max)} ms)"
            + (f"; the disk's worst sync meanwhile {disk_max(big.disk)} ms" if big.disk else ""),
            verdict(big.latency.max <= 0.1),
        ],
        *disk_relative(small),
        *disk_relative(big),
        ["acknowledged turns lost over random kill -9s", "0", lost, verdict(kills.lost == 0)],
        [
            "durable ÷ --zdr throughput, 16 clients, until stopped",
            "≥ 0.85x",
            f"{t_ratio:.2f}x ({durable:,.0f} / {zdr:,.0f} turns/s)",
            verdict(t_ratio >= 0.85),
        ],
        [
            f"RSS at {big.records:,} records, default budgets",
            "≤ 200 MiB",
            f"{big.rss_mib:,.0f} MiB (peak {big.hwm_mib:,.0f})",
            verdict(big.rss_mib <= 200),
        ],
        [
            "state dir allocated ÷ bytes the store counts",
            "≤ 1.5x",
            f"{alloc} ({mib(big.allocated)} / {mib(counted)})",
            verdict(alloc_ratio <= 1.5),
        ],
        [
            f"start-up to /readyz with {big.records:,} records",
            "≤ 2 s",
            f"{startup:.2f} s, {loaded:,} records loaded (after kill -9: "
            + ", ".join(f"{s:.1f}" for s in kills.restarts)
            + " s)",
            verdict(startup <= 2),
        ],
    ]
    print(table(["figure", "target", "measured", ""], figures))
    print(f"graceful stop with {big.records:,} records: {stop:.2f} s")
    if kills.examples:
        print(f"lost, e.g.: {', '.join(kills.examples)}")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def measure(
    backend: str, root: Path, args: argparse.Namespace, rng: random.Random, watch: Watch | None
) -> None:
    if args.only_throughput:
        tput = await throughput_rounds(backend, root, args, watch)
        report_throughput(tput)
        return
    if args.only_rss:
        await rss_only(backend, root, args)
        return
    filled = [
        await fill_store(backend, root / "small", args.small_records, args),
        await fill_store(backend, root / "big", args.records, args),
    ]
    progress("measuring latency" + (" (both stores at once)" if args.together else " (A B A)"))
    small, big = await latency_windows(filled, args, watch)
    filled[0].proxy.stop()
    proxy = filled[1].proxy
    sizes = f"{small.records:,} and {big.records:,} records"
    progress(f"p99 {ms(small.latency.p99)} and {ms(big.latency.p99)} ms at {sizes}")
    if args.only_latency:
        proxy.stop()
        report_latency(small, big, args)
        return
    progress("kill -9 rounds")
    kills, proxy = await kill_rounds(backend, proxy, args, rng)
    stop = proxy.stop()
    proxy = await start_proxy(backend, proxy.state, "proxy-restart")
    startup = proxy.startup
    loaded = entries(await proxy.metrics())
    proxy.stop()
    tput = await throughput_rounds(backend, root, args, watch)
    report(small, big, kills, startup, loaded, stop, tput, args)


@dataclass
class Memory:
    """Reports of a proxy under memory_proxy.py: `out` their path, `frames` what
    tracemalloc keeps per allocation ("0": off)."""

    out: Path
    frames: str = "0"

    async def read(self, proxy: Proxy, label: str) -> dict[str, Any]:
        """Its report now (with tracemalloc, its snapshot kept as
        `ocxproxy-memory-<label>-<pid>.snap` in the temp dir)."""
        self.out.unlink(missing_ok=True)
        proxy.child.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 600  # a snapshot of 100,000s of records takes a while
        while not self.out.exists():
            if time.monotonic() > deadline or proxy.child.proc.poll() is not None:
                raise RuntimeError(f"{proxy.child.name} wrote no memory report")
            await asyncio.sleep(0.05)
        figures: dict[str, Any] = orjson.loads(self.out.read_bytes())
        kept = self.keep_snapshot(f"{label}-{proxy.pid}")
        if kept is not None:
            figures["snapshot"] = kept
        return figures

    def keep_snapshot(self, name: str) -> str | None:
        """The tracemalloc snapshot moved to the temp dir (the state dirs' is removed at
        the end), if there is one."""
        snap = f"{self.out}.snap"
        if not os.path.exists(snap):
            return None
        kept = os.path.join(tempfile.gettempdir(), f"ocxproxy-memory-{name}.snap")
        os.replace(snap, kept)
        return kept


def where(figures: dict[str, Any]) -> str:
    """What a memory report says: RSS, then who holds it."""
    status, heap, py = figures["status"], figures["malloc"], figures["pymalloc"]
    parts = [
        f"RSS {mib(status['VmRSS'])} (anonymous {mib(status['RssAnon'])}, "
        f"files {mib(status['RssFile'])})",
    ]
    if py:  # (it says nothing while tracemalloc traces)
        parts.append(
            f"pymalloc {mib(py['total'])} of arenas holding {mib(py['allocated_blocks'])} "
            "of objects"
        )
    if heap:
        parts.append(
            f"malloc {mib(heap['heap'])} of heap holding {mib(heap['in_use'])} "
            f"({mib(heap['free'])} free in it, {mib(heap['top_free'])} of it at the top), "
            f"{mib(heap['mmapped'])} mmapped"
        )
    if "traced" in figures:
        parts.append(f"tracemalloc {mib(figures['traced'])} traced (RSS inflated by tracing)")
    return "; ".join(parts)


def top_traces(path: str, n: int = 25) -> str:
    """The snapshot's largest holders, by the line that allocated them."""
    import tracemalloc

    stats = tracemalloc.Snapshot.load(path).statistics("lineno")
    lines = [f"  {s.size / 2**20:7.1f} MiB {s.count:>9,}  {s.traceback[0]}" for s in stats[:n]]
    return "\n".join(lines)


async def rss_only(backend: str, root: Path, args: argparse.Namespace) -> None:
    """Part 2 alone, in the two states a store of that size is found in: filled by its
    traffic (writes settled; again --rss-wait s later: the proxy trims its heap every 30 s),
    and restarted on its state dir (--rss-wait s after /readyz: start-up's load settled).
    The proxy runs under memory_proxy.py, which tells who holds what (pymalloc's objects,
    malloc's heap) beside RSS, and with --tracemalloc N what allocated it."""
    memory = Memory(root / "memory.json", str(args.tracemalloc))
    turns = max(args.rss_turns, args.records)
    f = await fill_store(backend, root / "big", turns, args, memory=memory)
    await settle(f.proxy, 120)
    held = entries(await f.proxy.metrics())
    filled = [await memory.read(f.proxy, "filled")]
    await asyncio.sleep(args.rss_wait)
    filled.append(await memory.read(f.proxy, "filled-later"))
    counted = disk_tiers(await f.proxy.metrics())
    on_disk = sum(v for tier, v in counted.items() if tier not in MEMORY_TIERS)
    allocated = allocated_bytes(f.proxy.state)
    hwm = status_kib(f.proxy.pid, "VmHWM") / 1024
    f.http.close()
    f.proxy.stop()
    progress("restarting on the same state dir")
    proxy = await start_proxy(backend, f.proxy.state, "proxy-reloaded", memory=memory)
    loaded = entries(await proxy.metrics())
    await asyncio.sleep(args.rss_wait)
    reloaded = await memory.read(proxy, "restarted")
    proxy.stop()
    rss = [report["status"]["VmRSS"] / 2**20 for report in [*filled, reloaded]]
    print(f"\n## RSS at {held:,} records after {f.made:,} turns ({args.turn_bytes or 'short'}-byte "
          f"user texts, chains of {args.chain_turns}), default budgets")  # fmt: skip
    rows = [
        [f"RSS at {held:,} records, filled by traffic", "≤ 200 MiB",
         f"{rss[0]:,.0f} MiB settled, {rss[1]:,.0f} MiB {args.rss_wait:g} s later "
         f"(peak {hwm:,.0f})",
         verdict(max(rss[:2]) <= 200)],
        [f"RSS restarted on it ({loaded:,} records loaded), {args.rss_wait:g} s after ready",
         "≤ 200 MiB", f"{rss[2]:,.0f} MiB", verdict(rss[2] <= 200)],
        ["state dir allocated ÷ bytes the store counts", "≤ 1.5x",
         f"{allocated / on_disk:.2f}x ({mib(allocated)} / {mib(on_disk)})" if on_disk else "-",
         verdict(bool(on_disk) and allocated / on_disk <= 1.5)],
    ]  # fmt: skip
    print(table(["figure", "target", "measured", ""], rows))
    for label, report in (("filled, later", filled[1]), ("restarted", reloaded)):
        print(f"\n{label}: {where(report)}")
        if "snapshot" in report:
            print(f"largest holders ({report['snapshot']}):\n{top_traces(report['snapshot'])}")


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    flags = serve_flags()
    durability = "--durability" in flags
    print(f"load average at start: {loadavg()} (2 cores, shared with other work: noisy)")
    if args.zdr:
        print(
            f"proxy: --zdr (the latency part without the disk); instant backend; seed {args.seed}"
        )
    else:
        print(
            "proxy: default durable configuration"
            + (" (--durability default)" if durability else " (no --durability flag: older store)")
            + f"; instant backend; seed {args.seed}"
        )
    backend = await asyncio.to_thread(start_backend, unique_item_ids=args.unique_item_ids)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_durable_", dir=args.tmp) as tmp:
            root = Path(tmp)
            watch = Watch(root) if args.disk_watch else None
            with watch or contextlib.nullcontext():
                await measure(backend.url, root, args, rng, watch)
    finally:
        for child in STARTED:
            child.stop()
        backend.stop()
    print(f"load average at end: {loadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_options(parser)
    parser.add_argument("--records", type=int, default=100_000, help="the big store's records")
    parser.add_argument("--small-records", type=int, default=1000, help="the baseline store's")
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop turns/s")
    parser.add_argument("--duration", type=float, default=20.0, help="latency window, s")
    parser.add_argument("--kills", type=int, default=5, help="kill -9 rounds")
    parser.add_argument(
        "--kill-after", type=float, default=6.0, help="longest traffic before a kill, s"
    )
    parser.add_argument("--throughput-duration", type=float, default=15.0)
    parser.add_argument(
        "--throughput-rounds", type=int, default=2, help="rounds of --zdr and durable (ABBA)"
    )
    parser.add_argument("--seed", type=int, default=None, help="random kill moments")
    parser.add_argument(
        "--only-throughput", action="store_true", help="only part 5, the throughput rounds"
    )
    parser.add_argument(
        "--only-latency", action="store_true", help="only part 1, latency at both sizes"
    )
    parser.add_argument(
        "--only-rss", action="store_true", help="only part 2: the big store's RSS once filled"
    )
    parser.add_argument(
        "--zdr",
        action="store_true",
        help="with --only-latency: both stores under --zdr (no journal, no sync), the floor "
        "the latency has on this box without the disk, beside the canary's syncs",
    )
    parser.add_argument(
        "--turn-bytes", type=int, default=0, help="user text per filling turn (default: short)"
    )
    parser.add_argument(
        "--chain-turns", type=int, default=100, help="turns per chain while filling"
    )
    parser.add_argument(
        "--unique-item-ids",
        action="store_true",
        help="the backend gives each output item an id of its own, as real servers do",
    )
    parser.add_argument(
        "--rss-wait", type=float, default=35.0, help="--only-rss: seconds to the second reading"
    )
    parser.add_argument(
        "--rss-turns",
        type=int,
        default=0,
        help="--only-rss: turns sent while filling, if more than --records (past the store's "
        "--max-entries its oldest go, as in a proxy that has run a while)",
    )
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="N",
        help="--only-rss: trace allocations (N frames each) and print the largest holders",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="both stores' latency windows in the same seconds (default: each alone, A B A)",
    )
    parser.add_argument("--tmp", help="where the state dirs go (default: the temp dir)")
    parser.add_argument(
        "--no-disk-watch",
        dest="disk_watch",
        action="store_false",
        help="no canary syncing beside the windows",
    )
    args = parser.parse_args()
    if args.zdr and not args.only_latency:
        parser.error("--zdr goes with --only-latency")
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    if args.quick:
        args.records, args.small_records, args.duration = 400, 100, 2.0
        args.kills, args.kill_after, args.throughput_duration = 2, 1.0, 2.0
        args.throughput_rounds = 1
    if args.nice is not None:
        print(raise_priority(args.nice))
    try:
        import uvloop
    except ImportError:
        asyncio.run(run(args))
    else:
        uvloop.run(run(args))


if __name__ == "__main__":
    main()
