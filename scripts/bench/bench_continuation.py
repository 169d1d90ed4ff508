"""Proxy overhead of a continuation turn (previous_response_id), at the cost of one hop.

Starts an instant backend (scripts/bench/instant_backend.py) and the proxy as subprocesses,
then, one request at a time over keep-alive connections, interleaves (in random order)
  via    POST proxy/v1/responses {previous_response_id, input: [one small user message]}
  direct POST backend/v1/responses with the full body the proxy forwards (byte-identical,
         checked through the backend's /_last)
in blocks of 50 pairs that take turns across the scenarios compared side by side (so a
change in the box's load hits them alike). It reports latency percentiles of both, the
overhead (via - direct, percentile by percentile, and the median of per-pair
differences), the proxy's CPU time per turn (/proc/PID/stat utime+stime over each block)
and the mean of the proxy's own ocxproxy_proxy_overhead_seconds histogram.

Sections:
  size   one big first turn of ~32 KB (~8k tokens) / ~512 KB (~128k tokens) of realistic
         items (messages, function_call, function_call_output); JSON and SSE.
  naive  in-process: a naive expansion (parse the stored history JSON and the request,
         build the dict, orjson.dumps it all) against ocxproxy's (parse the request,
         serialize its items, splice the stored segments) on the same inputs.
  chain  a 172-turn chain (~190 B of items a turn, ~32 KB in all): overhead at turns 1, 50
         and 172, and at a one-segment history holding the same bytes.
  --floor  adds scripts/bench/floor_proxy.py (the same splice, nothing else) on aiohttp and on
         hand-written HTTP, as yardsticks of what the framework costs.
  --profile DIR  per size and for the chain: CPU per turn of ocxproxy next to what-if
         variants (metrics off, the floors), then cProfile
         (CPU clock) of ocxproxy's turns: by package, top functions, inclusive.
  --nice -10  on a shared box, runs the benchmark's processes (and their autogroup) at a
         higher priority; the "others' CPU" column shows what the rest of the box used.

    .venv/bin/python scripts/bench/bench_continuation.py            # a few minutes
    .venv/bin/python scripts/bench/bench_continuation.py --quick    # smoke, < 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import random
import re
import signal
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from benchkit import (
    BYTES_PER_TOKEN,
    Child,
    Summary,
    add_common_options,
    cpu_seconds,
    machine_busy_seconds,
    make_items,
    overhead_metric,
    raise_priority,
    running,
    start_backend,
    start_floor,
    start_profiled,
    start_proxy,
    status_kib,
    summarize_pstats,
    table,
    us,
    user_message,
    verdict,
)
from instant_backend import OUTPUT_ITEM

from ocxproxy.continuation.expand import (
    check_call_bindings,
    expand,
    parse_request,
    serialize_items,
)
from ocxproxy.continuation.record import build_turn
from ocxproxy.store import Store

JSON = {"Content-Type": "application/json"}
SIZES = {"8k": 32 * 1024, "128k": 512 * 1024}
TARGETS_US = {"8k": 250.0, "128k": 400.0}  # overhead p50, non-streaming
CHAIN_TURNS = 172
CHAIN_POINTS = (1, 50, CHAIN_TURNS)
_RID = re.compile(rb'"id":"(resp_[^"]*)"')


@dataclass
class Pairs:
    label: str
    via: Summary
    direct: Summary
    paired: Summary  # per-pair (via - direct)
    cpu_per_turn: float  # proxy CPU seconds per via request
    self_mean: float  # the proxy's own ocxproxy_proxy_overhead_seconds mean
    body_bytes: int
    others: float  # CPU used by other processes on the box meanwhile, in cores (noise)

    @property
    def overhead(self) -> Summary:
        return self.via.minus(self.direct)


class Bench:
    def __init__(self, session: aiohttp.ClientSession, proxy: Child, backend: Child) -> None:
        self.session = session
        self.proxy = proxy
        self.backend = backend
        self.via_url = proxy.url + "/v1/responses"
        self.direct_url = backend.url + "/v1/responses"

    async def post(self, url: str, body: bytes) -> tuple[float, bytes]:
        start = time.perf_counter()
        async with self.session.post(url, data=body, headers=JSON) as response:
            data = await response.read()
        elapsed = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {data[:300]!r}")
        return elapsed, data

    async def create(self, body: dict[str, Any]) -> str:
        """A turn through the proxy (untimed); returns its response id."""
        _, data = await self.post(self.via_url, orjson.dumps(body))
        m = _RID.search(data)
        if m is None:
            raise RuntimeError(f"no response id in {data[:300]!r}")
        return m.group(1).decode()

    async def metric(self) -> tuple[float, float]:
        async with self.session.get(self.proxy.url + "/metrics") as response:
            return overhead_metric(await response.text())

    async def check_identical(self, via: bytes, direct: bytes) -> None:
        """What the proxy forwards for `via` must be exactly `direct`."""
        await self.post(self.via_url, via)
        async with self.session.get(self.backend.url + "/_last") as response:
            last = await response.json()
        want = hashlib.sha256(direct).hexdigest()
        if last["sha256"] != want:
            raise RuntimeError(
                f"forwarded body differs from the direct one: {last['len']} B vs {len(direct)} B"
            )

    async def via_only(self, via: bytes, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await self.post(self.via_url, via)
        return time.perf_counter() - start


@dataclass
class Scenario:
    """One via/direct pair to measure, and what its blocks have gathered so far."""

    label: str
    bench: Bench
    via: bytes
    direct: bytes
    via_t: list[float] = field(default_factory=list)
    direct_t: list[float] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)
    cpu: float = 0.0
    metric: tuple[float, float] = (0.0, 0.0)
    others: float = 0.0
    wall: float = 0.0

    async def block(self, n: int, rng: random.Random) -> None:
        bench = self.bench
        m0 = await bench.metric()
        ours = (bench.proxy.pid, bench.backend.pid, os.getpid())
        cpu0 = cpu_seconds(bench.proxy.pid)
        ours0 = sum(cpu_seconds(pid) for pid in ours)
        busy0, wall0 = machine_busy_seconds(), time.perf_counter()
        for _ in range(n):
            if rng.random() < 0.5:
                a, _ = await bench.post(bench.via_url, self.via)
                b, _ = await bench.post(bench.direct_url, self.direct)
            else:
                b, _ = await bench.post(bench.direct_url, self.direct)
                a, _ = await bench.post(bench.via_url, self.via)
            self.via_t.append(a)
            self.direct_t.append(b)
            self.diffs.append(a - b)
        cpu1 = cpu_seconds(bench.proxy.pid)
        ours1 = sum(cpu_seconds(pid) for pid in ours)
        busy1, wall1 = machine_busy_seconds(), time.perf_counter()
        m1 = await bench.metric()
        self.cpu += cpu1 - cpu0
        self.others += max((busy1 - busy0) - (ours1 - ours0), 0.0)
        self.wall += wall1 - wall0
        self.metric = (self.metric[0] + m1[0] - m0[0], self.metric[1] + m1[1] - m0[1])

    def result(self) -> Pairs:
        n = len(self.via_t)
        total, count = self.metric
        return Pairs(
            self.label,
            Summary.of(self.via_t),
            Summary.of(self.direct_t),
            Summary.of(self.diffs),
            self.cpu / n,
            total / count if count else float("nan"),
            len(self.direct),
            self.others / self.wall if self.wall else 0.0,
        )


async def measure(scenarios: list[Scenario], n: int, warmup: int, block: int = 50) -> list[Pairs]:
    """`n` via/direct pairs per scenario, in blocks that take turns (so that the box's
    changing load hits every scenario alike); CPU and the proxy's histogram per block."""
    rng = random.Random(7)
    for sc in scenarios:
        await sc.bench.check_identical(sc.via, sc.direct)
        for _ in range(warmup):
            await sc.bench.post(sc.bench.via_url, sc.via)
            await sc.bench.post(sc.bench.direct_url, sc.direct)
    done = 0
    while done < n:
        size = min(block, n - done)
        order = list(scenarios)
        rng.shuffle(order)
        for sc in order:
            await sc.block(size, rng)
        done += size
    return [sc.result() for sc in scenarios]


def continuation(prev: str, text: str, stream: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The client's continuation body and the parameters that stay in the forwarded one."""
    via: dict[str, Any] = {
        "model": "bench",
        "previous_response_id": prev,
        "input": [user_message(text)],
    }
    via["stream"] = stream
    rest = {"model": "bench", "stream": stream}
    return via, rest


def direct_body(rest: dict[str, Any], history: list[Any], new: list[Any]) -> bytes:
    # The proxy keeps the client's other fields in order and puts `input` last.
    return orjson.dumps({**rest, "input": [*history, *new]})


def pairs_rows(results: list[Pairs]) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in results:
        o = r.overhead
        rows.append(
            [
                r.label,
                f"{r.body_bytes / 1024:,.0f}",
                us(r.direct.p50),
                us(r.via.p50),
                us(o.p50),
                us(o.p90),
                us(o.p99),
                us(o.max),
                us(r.paired.p50),
                us(r.self_mean),
                us(r.cpu_per_turn),
                f"{r.others:.0%}",
            ]
        )
    return rows


PAIR_HEADERS = [
    "scenario",
    "body KB",
    "direct p50",
    "via p50",
    "ovh p50",
    "ovh p90",
    "ovh p99",
    "ovh max",
    "paired p50",
    "self-reported mean",
    "proxy CPU/turn",
    "others' CPU",
]


# -- sections ------------------------------------------------------------------------------------


async def size_section(
    benches: list[tuple[str, Bench]], args: argparse.Namespace
) -> dict[tuple[str, str, bool], Pairs]:
    """(proxy, size, stream) → pairs; one big first turn per size, then continuations;
    the proxies measured side by side."""
    results: dict[tuple[str, str, bool], Pairs] = {}
    for seed, size_name in enumerate(args.sizes, 1):
        items = make_items(SIZES[size_name], seed=seed)
        history = [*items, OUTPUT_ITEM]
        for stream in (False, True):
            scenarios = []
            for proxy_name, bench in benches:
                base = await bench.create({"model": "bench", "input": items})
                via, rest = continuation(base, "Thanks. What should we do next?", stream)
                direct = direct_body(rest, history, via["input"])
                label = f"{size_name} {'SSE' if stream else 'JSON'}"
                if proxy_name != "ocxproxy":
                    label += f" ({proxy_name})"
                scenarios.append(Scenario(label, bench, orjson.dumps(via), direct))
            measured = await measure(scenarios, args.n, args.warmup)
            for (proxy_name, _), result in zip(benches, measured, strict=True):
                results[proxy_name, size_name, stream] = result
                print(
                    f"  {result.label}: overhead p50 {us(result.overhead.p50)} µs", file=sys.stderr
                )
    return results


VARIANTS: tuple[tuple[str, str | tuple[str, str]], ...] = (
    ("ocxproxy", ""),
    ("ocxproxy, metrics off", "metrics-off"),
    ("floor: aiohttp server + aiohttp client", ("aiohttp", "aiohttp")),
    ("floor: aiohttp server + raw client", ("aiohttp", "raw")),
    ("floor: raw server + raw client", ("raw", "raw")),
)
KEY_FUNCTIONS = (
    "_serve",
    "guarded",
    "create",
    "parse_head",
    "prepare_exchange",
    "parse_request",
    "expand",
    "history",
    "open",
    "finish",
    "observe_usage",
    "put",
    "request",
    "read_head",
    "upstream_headers",
    "client_headers",
)


async def profile_section(
    session: aiohttp.ClientSession, backend: Child, args: argparse.Namespace
) -> None:
    """What-if variants side by side (CPU per turn), then cProfile of ocxproxy's turns."""
    out_dir: Path = args.profile
    children: list[tuple[str, Child]] = []
    try:
        for label, ablate in VARIANTS:
            if isinstance(ablate, tuple):
                child = start_floor(backend.url, server=ablate[0], client=ablate[1])
            else:
                name = f"variant{len(children)}"
                out = out_dir / "ocxproxy.prof" if not ablate else None
                child = start_profiled(backend.url, name, ablate=ablate, out=out)
            children.append((label, child))
        for size_name in [*args.sizes, *([] if args.no_chain else ["chain"])]:
            await profile_size(session, backend, children, size_name, args)
    finally:
        for _, child in children:
            child.stop()


async def profile_size(
    session: aiohttp.ClientSession,
    backend: Child,
    children: list[tuple[str, Child]],
    size_name: str,
    args: argparse.Namespace,
) -> None:
    benches: list[tuple[str, Bench, bytes]] = []
    for label, child in children:
        bench = Bench(session, child, backend)
        if size_name == "chain":
            base = await build_chain(bench, CHAIN_TURNS)
        else:
            items = make_items(SIZES[size_name], seed=3)
            base = await bench.create({"model": "bench", "input": items})
        via, _ = continuation(base, "Thanks. What should we do next?", False)
        raw = orjson.dumps(via)
        await bench.via_only(raw, args.warmup)
        benches.append((label, bench, raw))
    cpu = {label: 0.0 for label, _, _ in benches}
    lat: dict[str, list[float]] = {label: [] for label, _, _ in benches}
    batch = max(args.profile_n // args.rounds, 1)
    for _ in range(args.rounds):  # interleaved rounds: the box's noise hits all alike
        for label, bench, raw in benches:
            c0 = cpu_seconds(bench.proxy.pid)
            for _ in range(batch):
                elapsed, _ = await bench.post(bench.via_url, raw)
                lat[label].append(elapsed)
            cpu[label] += cpu_seconds(bench.proxy.pid) - c0
    n = batch * args.rounds
    base_cpu = cpu[benches[0][0]] / n
    what = f"turn {CHAIN_TURNS} of a chain" if size_name == "chain" else f"{size_name} tokens"
    print(f"\n## What costs CPU: {what}, JSON continuation, {n} via-only turns per variant")
    rows = []
    for label, _, _ in benches:
        per = cpu[label] / n
        delta = f"{(per - base_cpu) * 1e6:+,.0f}"
        rows.append([label, us(per), delta, us(Summary.of(lat[label]).p50)])
    print(table(["variant", "proxy CPU/turn", "Δ vs ocxproxy", "via latency p50"], rows))
    label, bench, raw = benches[0]
    prof_path = args.profile / "ocxproxy.prof"
    prof_path.unlink(missing_ok=True)
    os.kill(bench.proxy.pid, signal.SIGUSR1)
    await asyncio.sleep(0.2)
    await bench.via_only(raw, args.profile_n)
    os.kill(bench.proxy.pid, signal.SIGUSR2)
    for _ in range(100):
        if prof_path.exists():
            break
        await asyncio.sleep(0.1)
    saved = args.profile / f"ocxproxy_{size_name}_json.prof"
    prof_path.replace(saved)
    summary = summarize_pstats(saved, args.top)
    per_turn = summary.total / args.profile_n
    print(
        f"\ncProfile (thread CPU clock) of {args.profile_n} turns: {us(per_turn)} µs/turn "
        f"profiled ({saved}); % of profiled CPU — call-heavy code is over-weighted"
    )
    rows = [[g, f"{t / summary.total:5.1%}", us(t / args.profile_n)] for g, t in summary.groups]
    print(table(["by package", "%", "µs/turn (profiled)"], rows))
    rows = [
        [name[:90], f"{t / summary.total:5.1%}", f"{calls / args.profile_n:g}"]
        for name, t, calls in summary.top_self
    ]
    print(table(["self time: function", "%", "calls/turn"], rows))
    rows = []
    for name, t in sorted(summary.inclusive.items(), key=lambda kv: -kv[1]):
        if name.split(" ", 1)[0] in KEY_FUNCTIONS:
            rows.append([name, f"{t / summary.total:5.1%}"])
    print(table(["inclusive: ocxproxy function", "%"], rows))


def naive_expand(raw: bytes, stored: bytes) -> bytes:
    """What a proxy that stores the history as one JSON array would do per turn."""
    request = orjson.loads(raw)
    history = orjson.loads(stored)
    own = request.get("input")
    own = [{"role": "user", "content": own}] if isinstance(own, str) else own or []
    body = {k: v for k, v in request.items() if k not in ("previous_response_id", "input")}
    body["input"] = history + own
    return orjson.dumps(body)


def naive_cached(raw: bytes, history: list[Any]) -> bytes:
    """A naive proxy that keeps the history as Python objects: parse request, dumps all."""
    request = orjson.loads(raw)
    body = {k: v for k, v in request.items() if k not in ("previous_response_id", "input")}
    body["input"] = history + request["input"]
    return orjson.dumps(body)


def resolve_now(coro: Coroutine[Any, Any, list[bytes]]) -> list[bytes]:
    """Run a coroutine that never suspends (the store's resident reads) without a loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the store suspended: history not resident")


def naive_section(args: argparse.Namespace) -> list[list[object]]:
    rows: list[list[object]] = []
    for size_name in args.sizes:
        items = make_items(SIZES[size_name], seed=1)
        history_items = [*items, OUTPUT_ITEM]
        store = Store(max_resident_bytes=1 << 30, max_entries=1000, ttl=3600.0)
        tail = serialize_items(items)
        turn = build_turn(
            response={"id": "resp_base", "output": [OUTPUT_ITEM]},
            scope="anonymous",
            durable=False,
            tail=tail,
            tail_items=items,
        )
        record = store.put(turn, None)
        segments = resolve_now(store.history(record))
        stored = orjson.dumps(history_items)
        via, _ = continuation("resp_base", "Thanks. What should we do next?", False)
        raw = orjson.dumps(via)

        def proxy_path(raw: bytes = raw, record: Any = record, segments: Any = segments) -> bytes:
            request = parse_request(raw)
            check_call_bindings(request.items, record)
            own = serialize_items(request.items)
            return expand(request.body, segments, own)

        expected = naive_expand(raw, stored)
        if proxy_path() != expected or naive_cached(raw, history_items) != expected:
            raise RuntimeError("naive and ocxproxy expansions differ")
        reps = args.naive_reps if size_name == "8k" else max(args.naive_reps // 8, 20)
        times: dict[str, list[float]] = {"ocx": [], "naive": [], "cached": []}
        clock = time.perf_counter
        for _ in range(reps):
            t0 = clock()
            proxy_path()
            t1 = clock()
            naive_expand(raw, stored)
            t2 = clock()
            naive_cached(raw, history_items)
            t3 = clock()
            times["ocx"].append(t1 - t0)
            times["naive"].append(t2 - t1)
            times["cached"].append(t3 - t2)
        s = {k: Summary.of(v) for k, v in times.items()}
        for key, label in (
            ("ocx", "ocxproxy: parse request + splice segments"),
            ("naive", "naive: parse history + request, dumps all"),
            ("cached", "naive, history kept parsed: dumps all"),
        ):
            ratio = s[key].p50 / s["ocx"].p50
            rows.append(
                [
                    f"{size_name} {label}",
                    f"{len(expected) / 1024:,.0f}",
                    reps,
                    us(s[key].p50),
                    us(s[key].p90),
                    us(s[key].p99),
                    f"{ratio:.1f}x",
                ]
            )
    return rows


async def build_chain(bench: Bench, turns: int) -> str:
    """A chain of `turns` stored turns (~190 B each) through the proxy; its head's id."""
    head = await bench.create({"model": "bench", "input": [user_message("turn 000: start.")]})
    for turn in range(1, turns):
        message = user_message(f"turn {turn:03d}: continue with the next step")
        head = await bench.create(
            {"model": "bench", "previous_response_id": head, "input": [message]}
        )
    return head


async def chain_section(bench: Bench, args: argparse.Namespace) -> list[Pairs]:
    """One chain of CHAIN_TURNS stored turns; sibling turns measured at CHAIN_POINTS and
    at a one-segment history of the same bytes, all side by side."""
    scenarios: list[Scenario] = []
    first = user_message("turn 000: start the task, please.")
    head = await bench.create({"model": "bench", "input": [first]})
    history: list[Any] = [first, OUTPUT_ITEM]
    for turn in range(1, CHAIN_TURNS + 1):
        if turn in CHAIN_POINTS:
            via, rest = continuation(head, "Thanks. What should we do next?", False)
            direct = direct_body(rest, history, via["input"])
            label = f"chain turn {turn} ({turn} segments)"
            scenarios.append(Scenario(label, bench, orjson.dumps(via), direct))
        if turn == CHAIN_TURNS:
            break
        message = user_message(f"turn {turn:03d}: continue with the next step")
        body = {"model": "bench", "previous_response_id": head, "input": [message]}
        head = await bench.create(body)
        history += [message, OUTPUT_ITEM]
    # The same bytes as one segment: a first turn holding the whole chain's history (the
    # backend adds the last output item itself); the forwarded body is the same as above.
    head_one = await bench.create({"model": "bench", "input": history[:-1]})
    via, rest = continuation(head_one, "Thanks. What should we do next?", False)
    direct = direct_body(rest, history, via["input"])
    label = f"one segment, same {len(direct) / 1024:,.0f} KB"
    scenarios.append(Scenario(label, bench, orjson.dumps(via), direct))
    results = await measure(scenarios, args.m, args.warmup)
    for r in results:
        print(f"  {r.label}: overhead p50 {us(r.overhead.p50)} µs", file=sys.stderr)
    return results


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def run(args: argparse.Namespace) -> int:
    backend = start_backend()
    proxy = start_proxy(backend.url)
    floors = (
        [
            ("floor", start_floor(backend.url)),
            ("raw floor", start_floor(backend.url, server="raw", client="raw")),
        ]
        if args.floor
        else []
    )
    failed = False
    print(f"load average at start: {loadavg()} (2 cores; other work on the box adds noise)")
    with running(backend, proxy, *(child for _, child in floors)):
        connector = aiohttp.TCPConnector(limit=8, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            bench = Bench(session, proxy, backend)
            benches = [("ocxproxy", bench)]
            benches += [(name, Bench(session, child, backend)) for name, child in floors]
            print(f"proxy pid {proxy.pid} at {proxy.url}; backend pid {backend.pid}")
            print(
                f"pairs per scenario: {args.n} (chain: {args.m}), warm-up {args.warmup}; "
                "times in µs; ovh = via - direct, percentile by percentile"
            )
            gc.collect()
            gc.freeze()
            sizes = await size_section(benches, args) if args.sizes else {}
            chain = await chain_section(bench, args) if not args.no_chain else []
            hwm = status_kib(proxy.pid, "VmHWM")
            if sizes:
                print("\n## Continuation overhead by history size (one request at a time)")
                print(table(PAIR_HEADERS, pairs_rows(list(sizes.values()))))
                for size_name in args.sizes:
                    r = sizes["ocxproxy", size_name, False]
                    target = TARGETS_US[size_name]
                    ok = r.overhead.p50 * 1e6 <= target
                    failed |= not ok
                    print(
                        f"target: {size_name} tokens JSON overhead p50 {us(r.overhead.p50)} µs "
                        f"≤ {target:.0f} µs: {verdict(ok)}"
                    )
            if args.sizes and not args.no_naive:
                print("\n## Expansion in-process: naive vs ocxproxy (same inputs, interleaved)")
                rows = naive_section(args)
                headers = ["expansion", "body KB", "reps", "p50", "p90", "p99", "÷ ocxproxy p50"]
                print(table(headers, rows))
                for row in rows:
                    if "128k naive:" in str(row[0]):
                        ratio = float(str(row[-1]).rstrip("x"))
                        ok = ratio >= 3.0
                        failed |= not ok
                        print(
                            f"target: naive ≥ 3x ocxproxy at 128k tokens: {ratio:.1f}x "
                            f"{verdict(ok)}"
                        )
            if chain:
                print(f"\n## Long chain: {CHAIN_TURNS} turns of ~190 B (JSON, one at a time)")
                print(table(PAIR_HEADERS, pairs_rows(chain)))
                first, last, one = chain[0], chain[-2], chain[-1]
                r_one = last.overhead.p50 / one.overhead.p50
                r_first = last.overhead.p50 / first.overhead.p50
                ok = r_one <= 1.5
                failed |= not ok
                print(
                    f"target: turn {CHAIN_TURNS} overhead ÷ one-segment overhead at the same "
                    f"size {r_one:.2f} ≤ 1.5: {verdict(ok)}"
                )
                print(f"info:   turn {CHAIN_TURNS} overhead ÷ turn 1 overhead {r_first:.2f}")
                paired = last.paired.p50 / one.paired.p50
                print(f"info:   the same ratio on per-pair medians: {paired:.2f}")
            print(f"\nproxy peak RSS (VmHWM): {hwm / 1024:,.0f} MiB")
            print(f"load average at end: {loadavg()}")
            if args.profile is not None and args.sizes:
                await profile_section(session, backend, args)
    print(f"(~{BYTES_PER_TOKEN} bytes per token; targets are p50 figures)")
    return 1 if failed and args.strict else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_options(parser)
    parser.add_argument("--n", type=int, default=2000, help="pairs per size scenario")
    parser.add_argument("--m", type=int, default=1000, help="pairs per chain point")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--sizes", default="8k,128k", help="comma list of 8k,128k ('' = none)")
    parser.add_argument("--naive-reps", type=int, default=2000)
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--no-chain", action="store_true")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure scripts/bench/floor_proxy.py, on aiohttp and raw (yardsticks)",
    )
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="what-if variants + cProfile, per size"
    )
    parser.add_argument("--profile-n", type=int, default=2000, help="turns per variant")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    if args.quick:
        args.n, args.m, args.warmup, args.naive_reps = 150, 100, 20, 200
        args.profile_n = min(args.profile_n, 500)
    if args.nice is not None:
        print(raise_priority(args.nice))
    args.sizes = [s for s in args.sizes.split(",") if s]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(run(args)))
    sys.exit(uvloop.run(run(args)))


if __name__ == "__main__":
    main()
