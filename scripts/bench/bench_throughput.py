"""Continuation turns per second through one proxy process against an instant backend.

Starts scripts/bench/instant_backend.py and `python -m ocxproxy serve` as subprocesses, then
load-generator processes that run CHAINS concurrent conversations: each chain makes a
first turn (untimed), then sends continuation turns (previous_response_id = its last
response, one small user message) back to back until the window closes; a chain that
reaches --chain-turns starts over with a new first turn (counted apart). Reports turns/s,
latency under load, the CPU each process used in the window (% of one core; the box has
2 cores, shared by proxy, backend and load generator) and what limited the rate, and the
proxy's peak RSS (VmHWM).

The default load generator is a hand-written HTTP/1.1 keep-alive client (one connection
per chain) because aiohttp's client costs several times more CPU per request and would
take cores from the proxy; `--client aiohttp` uses aiohttp (connector limit = chains).

    .venv/bin/python scripts/bench/bench_throughput.py            # ~1 minute
    .venv/bin/python scripts/bench/bench_throughput.py --quick    # smoke, < 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import orjson
from benchkit import (
    PYTHON,
    Summary,
    add_common_options,
    cpu_seconds,
    machine_busy_seconds,
    make_items,
    raise_priority,
    running,
    start_backend,
    start_floor,
    start_proxy,
    status_kib,
    table,
    us,
    user_message,
    verdict,
)
from loopback import RawClient

TARGET_TPS = 1500.0
_RID = re.compile(rb'"id":"(resp_[^"]*)"')


# -- load generator (runs in worker processes) -----------------------------------------------


class AiohttpClient:
    def __init__(self, session: Any, url: str) -> None:
        self.session = session
        self.url = url

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bytes]:
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.url + path, data=body, headers=headers) as response:
            return response.status, response.content_type.encode(), await response.read()

    async def close(self) -> None:
        pass


@dataclass
class ChainStats:
    ready: int = 0  # chains that made their first turn
    turns: int = 0  # continuation turns in the window
    firsts: int = 0  # first turns of restarted chains in the window
    errors: int = 0


async def first_turn(client: Any, root: list[Any]) -> str:
    body = orjson.dumps({"model": "bench", "input": root})
    status, _, data = await client.post("/v1/responses", body)
    m = _RID.search(data)
    if status != 200 or m is None:
        raise RuntimeError(f"first turn failed: {status} {data[:200]!r}")
    return m.group(1).decode()


async def chain(
    client: Any,
    root: list[Any],
    args: argparse.Namespace,
    go: asyncio.Event,
    window: list[float],
    stats: ChainStats,
    latencies: list[float],
) -> None:
    head = await first_turn(client, root)
    stats.ready += 1
    length = 1
    await go.wait()
    clock = time.perf_counter
    while True:
        if length >= args.chain_turns:
            head = await first_turn(client, root)
            stats.firsts += 1
            length = 1
        message = user_message(f"turn {length:03d}: continue with the next step")
        body = orjson.dumps(
            {"model": "bench", "previous_response_id": head, "input": [message], "stream": False}
        )
        start = clock()
        status, _, data = await client.post("/v1/responses", body)
        end = clock()
        if end > window[1]:
            return
        m = _RID.search(data)
        if status != 200 or m is None:
            stats.errors += 1
            continue
        head = m.group(1).decode()
        length += 1
        stats.turns += 1
        latencies.append(end - start)


async def worker(args: argparse.Namespace) -> None:
    """Set up the chains, print 'ready', wait for 'go SECONDS' on stdin, run, print JSON."""
    root = make_items(args.history_kb * 1024, seed=5) if args.history_kb else []
    root = root or [user_message("turn 000: start the task, please.")]
    session = None
    if args.client == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=args.chains, keepalive_timeout=60)
        session = aiohttp.ClientSession(connector=connector)
        clients: list[Any] = [AiohttpClient(session, args.url)] * args.chains
    else:
        clients = [RawClient(args.url) for _ in range(args.chains)]
    go = asyncio.Event()
    window = [0.0, float("inf")]
    stats = ChainStats()
    latencies: list[float] = []
    tasks = [
        asyncio.ensure_future(chain(c, root, args, go, window, stats, latencies)) for c in clients
    ]
    while stats.ready < args.chains:  # every chain has made its first turn
        await asyncio.sleep(0.01)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    seconds = float(line.split()[1])
    window[0] = time.perf_counter()
    window[1] = window[0] + seconds
    go.set()
    await asyncio.gather(*tasks)
    for client in clients:
        await client.close()
    if session is not None:
        await session.close()
    s = Summary.of(latencies)
    result: dict[str, float] = {
        "turns": stats.turns,
        "firsts": stats.firsts,
        "errors": stats.errors,
    }
    result |= {"p50": s.p50, "p90": s.p90, "p99": s.p99, "max": s.max}
    print(json.dumps(result), flush=True)


# -- driver --------------------------------------------------------------------------------------


@dataclass
class Result:
    label: str
    seconds: float
    turns: int
    firsts: int
    errors: int
    p50: float
    p99: float
    cpu: dict[str, float]  # process → fraction of one core
    hwm_mib: float

    @property
    def tps(self) -> float:
        return self.turns / self.seconds

    def limit(self) -> str:
        proxy = self.cpu["proxy"]
        total = sum(self.cpu.values())
        others = self.cpu["other processes"]
        if proxy >= 0.9:
            return f"proxy CPU-bound ({proxy:.0%} of its one core: a single event loop)"
        if total >= 1.8:
            return (
                f"the 2 cores ({total:.0%} busy, of which other processes on the box "
                f"{others:.0%}): the proxy got only {proxy:.0%} of a core"
            )
        return f"neither saturated (proxy {proxy:.0%}, all {total:.0%}): latency/concurrency-bound"


def run_config(label: str, args: argparse.Namespace, *, history_kb: int, raw: bool) -> Result:
    backend = start_backend(raw=raw)
    if args.proxy == "ocxproxy":
        proxy = start_proxy(backend.url)
    else:  # a yardstick: scripts/bench/floor_proxy.py
        side = "raw" if args.proxy == "raw-floor" else "aiohttp"
        proxy = start_floor(backend.url, server=side, client=side)
    workers: list[subprocess.Popen[str]] = []
    with running(backend, proxy):
        per_worker = [args.chains // args.clients] * args.clients
        per_worker[0] += args.chains - sum(per_worker)
        for chains in per_worker:
            argv = [PYTHON, __file__, "_worker", "--url", proxy.url, "--chains", str(chains)]
            argv += ["--history-kb", str(history_kb), "--chain-turns", str(args.chain_turns)]
            argv += ["--client", args.client]
            workers.append(
                subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
        try:
            for w in workers:
                assert w.stdout is not None
                if w.stdout.readline().strip() != "ready":
                    raise RuntimeError("a load generator failed to start")
            time.sleep(0.5)
            pids = {"proxy": [proxy.pid], "backend": [backend.pid]}
            pids["load generator"] = [w.pid for w in workers]
            before = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
            busy0 = machine_busy_seconds()
            start = time.perf_counter()
            for w in workers:
                assert w.stdin is not None
                w.stdin.write(f"go {args.duration}\n")
                w.stdin.flush()
            time.sleep(args.duration)
            after = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
            busy1 = machine_busy_seconds()
            elapsed = time.perf_counter() - start
            outputs = [
                json.loads(w.communicate(timeout=60)[0].strip().splitlines()[-1]) for w in workers
            ]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        hwm = status_kib(proxy.pid, "VmHWM") / 1024
    cpu = {k: (after[k] - before[k]) / elapsed for k in pids}
    cpu["other processes"] = max((busy1 - busy0) / elapsed - sum(cpu.values()), 0.0)
    main = max(outputs, key=lambda o: o["turns"])
    return Result(
        label,
        args.duration,
        sum(o["turns"] for o in outputs),
        sum(o["firsts"] for o in outputs),
        sum(o["errors"] for o in outputs),
        main["p50"],
        main["p99"],
        cpu,
        hwm,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("_worker", help="internal: one load-generator process")
    w.add_argument("--url", required=True)
    w.add_argument("--chains", type=int, required=True)
    w.add_argument("--history-kb", type=int, default=0)
    w.add_argument("--chain-turns", type=int, default=172)
    w.add_argument("--client", choices=("raw", "aiohttp"), default="raw")
    add_common_options(parser)
    parser.add_argument("--chains", type=int, default=64, help="concurrent conversations")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per configuration")
    parser.add_argument("--clients", type=int, default=1, help="load-generator processes")
    parser.add_argument("--client", choices=("raw", "aiohttp"), default="raw")
    parser.add_argument(
        "--proxy",
        choices=("ocxproxy", "floor", "raw-floor"),
        default="ocxproxy",
        help="the proxy under load; floor/raw-floor: scripts/bench/floor_proxy.py as a yardstick",
    )
    parser.add_argument(
        "--chain-turns", type=int, default=172, help="turns before a chain restarts"
    )
    parser.add_argument(
        "--history-kb", type=int, action="append", help="first-turn size(s) in KB (default 0, 32)"
    )
    parser.add_argument(
        "--backend",
        choices=("aiohttp", "raw", "both"),
        default="both",
        help="instant backend flavour(s): aiohttp, or hand-written HTTP (cheaper)",
    )
    args = parser.parse_args()
    if args.command == "_worker":
        run = asyncio.run
        try:
            import uvloop

            run = uvloop.run
        except ImportError:
            pass
        run(worker(args))
        return
    if args.nice is not None:
        print(raise_priority(args.nice))
    sizes = args.history_kb or [0, 32]
    backends = ["aiohttp", "raw"] if args.backend == "both" else [args.backend]
    if args.quick:
        args.duration = 3.0
        sizes, backends = sizes[:1], backends[:1]
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])} (2 cores)")
    print(
        f"proxy: {args.proxy}; "
        f"{args.chains} chains, {args.clients} load-generator process(es), {args.client} client, "
        f"{args.duration:g} s per configuration, chains restart after {args.chain_turns} turns"
    )
    results = []
    for backend in backends:
        for kb in sizes:
            first = f"{kb} KB first turn" if kb else "small first turn"
            label = f"{backend} backend, {first}"
            results.append(run_config(label, args, history_kb=kb, raw=backend == "raw"))
            r = results[-1]
            print(f"  {label}: {r.tps:,.0f} turns/s", file=sys.stderr, flush=True)
    rows = []
    for r in results:
        rows.append(
            [
                r.label,
                f"{r.tps:,.0f}",
                r.firsts,
                r.errors,
                us(r.p50),
                us(r.p99),
                f"{r.cpu['proxy']:.0%}",
                f"{r.cpu['backend']:.0%}",
                f"{r.cpu['load generator']:.0%}",
                f"{r.cpu['other processes']:.0%}",
                f"{r.cpu['proxy'] / max(r.tps, 1e-9) * 1e6:,.0f}",
                f"{r.hwm_mib:,.0f}",
            ]
        )
    print("\n## Continuation throughput, one proxy process")
    headers = ["configuration", "turns/s", "first turns", "errors", "p50 µs", "p99 µs"]
    headers += ["proxy CPU", "backend CPU", "loadgen CPU", "others' CPU"]
    headers += ["proxy CPU µs/turn", "proxy VmHWM MiB"]
    sys.stderr.flush()
    print(table(headers, rows))
    for r in results:
        ok = r.tps >= TARGET_TPS
        print(f"target: ≥ {TARGET_TPS:,.0f} turns/s ({r.label}): {r.tps:,.0f} {verdict(ok)}")
        print(f"        limited by: {r.limit()}")
        ceiling = r.cpu["proxy"] * 1e6 / max(r.tps, 1e-9)
        print(
            f"        proxy-CPU ceiling (a whole core, {ceiling:,.0f} µs/turn): "
            f"{1e6 / ceiling:,.0f} turns/s"
        )


if __name__ == "__main__":
    main()
