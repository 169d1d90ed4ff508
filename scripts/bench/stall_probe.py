"""`ocxproxy serve` in this process with an event-loop stall probe, for benchmarks; and
`drive`, the load to run it under.

A watchdog thread notices when the event loop has not run its 1 ms heartbeat for more
than $OCXPROXY_STALL_MS (default 20) ms, samples the loop thread's stack then, and times
every cyclic-GC pass (gc.callbacks). On exit it prints to stderr each kind of stall, its
count and longest pause, by what the loop thread was doing (the GC by generation, or the
innermost ocxproxy frames), and the longest GC passes. Each stall also says how much of it
the loop thread spent on the CPU (its thread clock): a stall the loop worked through is
its own; one it mostly did not (the box's other processes, another thread holding the
GIL) is where the sample found it waiting, not what took the time. A pause may also be
one pass of the loop running many ready callbacks (turns finishing together), each short:
with OCXPROXY_STALL_STEPS=1 the loop is asyncio's own (not uvloop) and every callback it
runs is timed, so the report also lists each single step over the threshold (its loop CPU)
by where the watchdog found it, and the longest call of each of the store's calls a large
dict or commit could make long (with the GC passes within it). The watchdog gets the GIL
where the loop thread next lets go of it: after a pass of C code (a dict's resize, a GC
pass) that is often the next call, which is what the per-call times settle. Everything
else is `ocxproxy`'s own command line:

    python scripts/bench/stall_probe.py serve --upstream URL --port 0 ...

`drive URL` is the load: --fill closed-loop turns first (16 clients, chains of 100), then
--rate turns/s open loop for --seconds over --chains chains, every --new-every'th turn
starting a new chain and every --delete-every'th a DELETE of an older response (the
default --max-entries evicts the oldest as new records come): latency and statuses.

    python scripts/bench/stall_probe.py drive URL --rate 200 --seconds 180
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import os
import sys
import threading
import time
from collections import Counter, defaultdict, deque
from types import FrameType
from typing import Any

from ocxproxy import cli, server

THRESHOLD = float(os.environ.get("OCXPROXY_STALL_MS", "20")) / 1000
_beat = [time.perf_counter()]
_gc_start: list[float] = [0.0]
_gc_gen: list[int | None] = [None]
_gc_pauses: list[tuple[float, int, float]] = []  # (seconds, generation, when: wall clock)
_stalls: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (wall, loop CPU) s
_main = threading.main_thread().ident
STEPS = os.environ.get("OCXPROXY_STALL_STEPS") == "1"
_sample: list[str | None] = [None]  # where the watchdog found the loop in this step
_steps: dict[str, list[float]] = defaultdict(list)  # single steps over THRESHOLD: CPU s
_gc_total = [0.0]  # seconds in GC passes so far
_calls: dict[str, tuple[float, float]] = {}  # the longest call: (its CPU, GC passes in it)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_start[0], _gc_gen[0] = time.perf_counter(), info["generation"]
    else:
        took = time.perf_counter() - _gc_start[0]
        _gc_total[0] += took
        _gc_pauses.append((took, info["generation"], time.time()))
        _gc_gen[0] = None


def _where(frame: FrameType | None, depth: int = 3) -> str:
    if _gc_gen[0] is not None:
        return f"gc generation {_gc_gen[0]}"
    names: list[str] = []
    while frame is not None and len(names) < depth:
        path = frame.f_code.co_filename
        if "/ocxproxy/" in path:
            names.append(f"{path.rsplit('/ocxproxy/', 1)[1]}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(names) or "outside ocxproxy"


def _watch() -> None:
    clock = time.pthread_getcpuclockid(_main or 0)
    cpu = time.clock_gettime(clock)  # the loop thread's CPU when its beat last moved
    seen = _beat[0]
    while True:
        time.sleep(0.002)
        last = _beat[0]
        if last != seen:
            seen, cpu = last, time.clock_gettime(clock)
        if time.perf_counter() - last < THRESHOLD:
            continue
        where = _sample[0] = _where(sys._current_frames().get(_main or 0))
        while _beat[0] == last:
            time.sleep(0.004 if STEPS else 0.001)
            if STEPS:  # (each long step of this pass gets a sample of its own)
                _sample[0] = _where(sys._current_frames().get(_main or 0), 5)
        _stalls[where].append((_beat[0] - last, time.clock_gettime(clock) - cpu))
        seen, cpu = _beat[0], time.clock_gettime(clock)


def _time_steps() -> None:
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        _sample[0] = None
        cpu = time.thread_time()
        run(handle)
        cpu = time.thread_time() - cpu
        if cpu >= THRESHOLD:
            _steps[_sample[0] or "(not sampled)"].append(cpu)

    asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
    sys.modules["uvloop"] = None  # type: ignore[assignment]  # (server.run: asyncio's loop)
    # The store's calls that a large dict or commit could make long, each timed: a
    # watchdog's sample may land just after a GC pass, in the frame that set it off.
    from ocxproxy.store import items, records, resident
    from ocxproxy.store.local import committer, segments

    targets: list[tuple[Any, str]] = [
        (records.Records, "add"),  # (by id, then by item id)
        (items.ItemIndex, "add"),  # (a put's; start-up calls add_all)
        (items.ItemIndex, "remove"),
        (segments.SegmentTable, "intern"),
        (segments.SegmentTable, "hold"),
        (segments.SegmentTable, "release"),
        (resident.ResidentTier, "admit"),
        (resident.ResidentTier, "evict_over_budget"),
        (committer, "encode"),
    ]
    for owner, name in targets:
        _time_calls(owner, name)


def _time_calls(owner: Any, name: str) -> None:
    fn, key = getattr(owner, name), f"{getattr(owner, '__name__', '?')}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        cpu, gc_before = time.thread_time(), _gc_total[0]
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.thread_time() - cpu
            if took > _calls.get(key, (0.0, 0.0))[0]:
                _calls[key] = (took, _gc_total[0] - gc_before)

    setattr(owner, name, timed)


async def _heartbeat() -> None:
    while True:
        _beat[0] = time.perf_counter()
        await asyncio.sleep(0.001)


def _report() -> None:
    out = [
        f"stall probe: pauses of the event loop over {THRESHOLD * 1000:.0f} ms "
        "(the loop thread's CPU in each: busy = at least 3/4 of it)"
    ]
    for where, pauses in sorted(_stalls.items(), key=lambda kv: -max(kv[1])[0]):
        wall, cpu = max(pauses)
        busy = sum(c >= 0.75 * w for w, c in pauses)
        out.append(
            f"  {len(pauses):5d} x ({busy} busy), longest {wall * 1000:7.1f} ms "
            f"(CPU {cpu * 1000:5.1f} ms): {where}"
        )
    if STEPS:
        out.append(f"single steps of the loop over {THRESHOLD * 1000:.0f} ms of its CPU:")
        for where, cpus in sorted(_steps.items(), key=lambda kv: -max(kv[1])):
            out.append(f"  {len(cpus):5d} x, longest {max(cpus) * 1000:7.1f} ms: {where}")
        out.append("the longest single call of each (CPU; GC passes within it, wall):")
        for key, (cpu, in_gc) in sorted(_calls.items(), key=lambda kv: -kv[1][0]):
            out.append(f"  {cpu * 1000:7.2f} ms ({in_gc * 1000:.1f} ms GC): {key}")
    gens = Counter(g for _, g, _ in _gc_pauses)
    longest = sorted(_gc_pauses, reverse=True)[:5]
    over = sum(s >= THRESHOLD for s, _, _ in _gc_pauses)
    out.append(
        f"gc passes by generation: {dict(sorted(gens.items()))}, {over} over "
        f"{THRESHOLD * 1000:.0f} ms; longest: "
        + ", ".join(
            f"{s * 1000:.1f} ms (gen {g}, {time.strftime('%H:%M:%S', time.gmtime(t))})"
            for s, g, t in longest
        )
    )
    print("\n".join(out), file=sys.stderr, flush=True)


def probe(argv: list[str]) -> None:
    gc.callbacks.append(_on_gc)
    atexit.register(_report)
    threading.Thread(target=_watch, daemon=True, name="stall-probe").start()
    if STEPS:
        _time_steps()
    serve = server.serve

    async def probed(config: Any) -> None:
        beat = asyncio.get_running_loop().create_task(_heartbeat())
        try:
            await serve(config)
        finally:
            beat.cancel()

    server.serve = probed  # type: ignore[assignment]
    sys.exit(cli.main(argv))


async def drive(args: argparse.Namespace) -> None:
    from bench_durable import Http, OpenLoop, closed_loop, turn_body
    from benchkit import Summary

    http = Http(args.url)
    if args.fill:
        t0 = time.perf_counter()
        made, failed = await closed_loop(http, 16, 100, turns=args.fill)
        print(f"fill: {made:,} turns ({failed} failed) in {time.perf_counter() - t0:.1f} s")

    class Churn(OpenLoop):
        gone: deque[str] = deque()  # acknowledged ids, oldest first, to DELETE from

        async def _one(self, chain: int, at: float, n: int) -> None:
            if n % args.delete_every == 0 and len(self.gone) > 4 * self.chains:
                old = self.gone.popleft()
                if old not in self.heads:
                    status, _ = await self.http.request("DELETE", f"/v1/responses/{old}")
                    self.statuses[status] += 1
                    return
            prev = None if n % args.new_every == 0 else self.heads[chain]
            status, rid = await self.http.create(turn_body(prev, f"turn {n}"))
            self.statuses[status] += 1
            if rid is not None:
                self.latencies.append(time.perf_counter() - at)
                self.heads[chain] = rid
                self.gone.append(rid)

    load = Churn(http, args.rate, args.chains)
    await load.start_chains()
    await load.run(args.seconds)
    lat = Summary.of(load.latencies)
    print(
        f"{args.rate:.0f}/s for {args.seconds:.0f} s: {dict(load.statuses)}, skipped "
        f"{load.skipped}; latency ms p50 {lat.p50 * 1e3:.1f} p99 {lat.p99 * 1e3:.1f} "
        f"max {lat.max * 1e3:.1f}; over 50 ms {sum(x > 0.05 for x in load.latencies)}"
    )
    http.close()


def main() -> None:
    if sys.argv[1:2] != ["drive"]:
        probe(sys.argv[1:])
    parser = argparse.ArgumentParser(description="the load for the stall probe")
    parser.add_argument("url")
    parser.add_argument("--fill", type=int, default=0, help="closed-loop turns first")
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop turns/s")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--chains", type=int, default=64)
    parser.add_argument("--new-every", type=int, default=8, help="every Nth turn a new chain")
    parser.add_argument("--delete-every", type=int, default=10, help="every Nth a DELETE")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    asyncio.run(drive(parser.parse_args(sys.argv[2:])))


if __name__ == "__main__":
    main()
