"""The proxy's own CPU per continuation turn, with no sockets: a figure that holds still.

bench_continuation.py measures what a client sees, but on a 2-core box its figures move
by ±30 % from run to run, and half of a turn is the kernel (two loopback sends wake the
other processes). This runs ocxproxy's real request path in one process over in-memory
transports: the client's bytes go into the front end's `FrontConnection.data_received`,
the forwarded request comes out of the real `Http1Client` and is answered at once, with
scripts/bench/instant_backend.py's answer, straight into that connection's `data_received`; the
answer is collected from the front end's transport. What remains is exactly the Python
a turn costs: parsing, expansion, routing, the HTTP/1.1 on both sides, recording, metrics.

For each history size (~8k and ~128k tokens) and JSON/SSE it reports µs per turn (one
thread: wall ≈ CPU), the median and the fastest of --rounds rounds (on a shared VM the
fastest is the steadier figure for comparing two versions). Unlike the other benchmarks
the store is memory-only (`--zdr`) by default: a durable turn waits for its journal
commit's fsync, which would count I/O as the turn's time; `--durable` gives it a state
dir (the committer's thread then shares the GIL). `--profile` adds cProfile's top
functions for the 8k JSON case.

    python scripts/bench/bench_hotpath.py            # ~20 s
    python scripts/bench/bench_hotpath.py --quick
    python scripts/bench/bench_hotpath.py --profile
    python scripts/bench/bench_hotpath.py --context-window 1000000   # with the window check
    python scripts/bench/bench_hotpath.py --envelope-off   # the Response envelope a no-op
    python scripts/bench/bench_hotpath.py --envelope-ab    # its µs: on - off, ~2 min
    python scripts/bench/bench_hotpath.py --null           # the same A/B's own zero
    python scripts/bench/bench_hotpath.py --envelope-ab --part pending   # one part's µs
    python scripts/bench/bench_hotpath.py --envelope-ab --idle 300   # turns after an idle wait
    python scripts/bench/bench_hotpath.py --envelope-ab --durable --perf   # natively, by object

`--envelope-ab` gives the envelope's cost in µs per turn, on - off in one process. Each
case (a history size and JSON or SSE) runs in a store of its own, so none nears
`--max-entries` (a case is ~60,000 turns). Its --rounds (1,000) are pairs of short rounds
of --n (25) turns, one round with the envelope on and one off, the order alternated from
pair to pair and 5 untimed turns after each switch: a slow drift of the machine falls on
both modes alike, and a short spell of it (a neighbour's burst slows every turn for tens of
ms) more often on both rounds of a pair. Each round is timed in the thread's CPU time
(`time.thread_time()`; one thread, no I/O: ≈ wall, less what other processes take of the
core). The heap is settled as `serve` settles it (`heap.settle()`: a collection of what
is young, then `gc.freeze()`), untimed, before the first pair and every 50 pairs (about a
second of turns, as often as `serve`): `serve` runs `heap.keep_settled`, and without it
CPython's full collections traverse the growing store (tens of ms each) and land on random
rounds, a difference of hundreds of µs in one pair. The young generation is collected
before each timed round too, untimed: CPython collects it once the containers allocated
since its last collection, less those freed, pass a threshold, so a mode whose turns hold
more containers at once (freed by the turn's end) crosses it sooner and would host more of
the collections (docs/BENCHMARKS.md), though turns leave the same survivors behind and a
proxy collects as often either way.

Per case it prints the pairs' differences' mean ± its standard error, their median, their
20 % trimmed mean ± its standard error (from the winsorized variance), the median µs of
an "on" turn, how many collections (of any generation) still fell in a timed round (0
expected), and the share of all cores' time the hypervisor stole meanwhile (/proc/stat):
on a VM whose host is busy, a turn's thread CPU time grows and the envelope's cost with it
(on the 2-core VM up to 1.8 times at 13 to 19 % steal), so compare runs of like steal
only. The differences have heavy tails (a spell on one round of a pair only: ±100 µs in a
few % of pairs), so the trimmed mean is the steadier figure (its standard error 0.2 to
0.8 µs on the 2-core VM, the mean's 0.7 to 1.6); when the three disagree, the tails are
lopsided. Runs differ by more than their standard errors say (up to ~2 µs), so take
several.
`--null` runs the same A/B with the envelope on in both modes (the switch still flips,
changing nothing): its figures are the instrument's own zero, within about two standard
errors of 0 when the A/B has no bias. `--part` turns off one part of the envelope only
(the request's Envelope, a stream's pending events, or the Response's completion): the
parts' figures need not add up to the whole's, since each part's code and data start a
turn cold in the caches and the more of them a turn touches, the more of the rest it
evicts (see bench_envelope_calls.py).

`--idle` sleeps that many µs after each turn, untimed (a sleep takes no CPU time of the
thread). Served, a turn comes after a wait for the backend, and with the durable store
each turn waits for its journal's fsync: meanwhile the core may run other work, which
evicts the lines back-to-back turns keep cached. On the 2-core VM a 300 µs idle moved
the figures less than runs differ; bench_hotpath_ir.py --cold counts the other extreme,
a turn whose lines were all evicted.

`--calls` also times a few of the turn's calls where the proxy makes them (TIMED_CALLS:
remembering the turn, its journal entry, the commit), each in thread CPU time summed over
the timed rounds of each mode, and prints per case each call's µs with the envelope on,
off, and on - off: where in the turn the A/B's difference is paid, including code the
envelope does not run (an async call's time is the loop's CPU until it returns, so a
commit's counts the callbacks that encode and send it meanwhile). Each timed call reads
the thread's CPU clock twice, a system call (~1.3 µs a call on the 2-core VM, in a
call's figure when the call is in another's: Store.put's in Exchange.finish's), in both
modes alike: the on - off figures stay comparable, the µs per turn not with a run
without `--calls`.

`--perf` also samples the thread with Linux perf (`cpu-clock`, a software event, every
--perf-period µs of its CPU time; native_samples.py) and bins the samples by the timed
rounds' mode: per case, µs a turn on, off and on - off for all the samples (≈ the thread
CPU of the rounds), for each shared object whose difference is 0.1 µs or more (the rest
summed), and for the --top functions whose difference is largest. It is the machine's own
time, cold caches and all, with nothing added to the turn: where the compiled envelope's
µs go (`_speedups`), and how much of the difference lands in code the envelope does not
run (CPython's own functions, a few tenths of a µs each). A Python function is not told
apart from another (CPython 3.11 runs them all in `_PyEval_EvalFrameDefault`). The
compiled share moves by about ±0.8 µs from run to run of the same build; the
interpreter's moves by several µs even in the null A/B, so read it over several runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import importlib
import inspect
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import native_samples
import orjson
from benchkit import make_items, user_message
from instant_backend import InstantBackend
from loopback import CONTENT_LENGTH, message_length

from ocxproxy import heap
from ocxproxy.config import Config
from ocxproxy.h1 import LAST_CHUNK
from ocxproxy.http.context import PROXY
from ocxproxy.http.front import FrontConnection, FrontEnd
from ocxproxy.server import build_app
from ocxproxy.upstream import http1

SIZES = {"8k": 32 * 1024, "128k": 512 * 1024}
_RID = re.compile(rb'"id":"(resp_[^"]*)"')


class MemoryTransport:
    """Enough of asyncio.Transport for both ends of ocxproxy: writes go to `sink`."""

    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self.sink = sink
        self.closing = False

    def write(self, data: bytes) -> None:
        self.sink(bytes(data))

    def writelines(self, data: Any) -> None:
        self.sink(b"".join(data))

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket

    def close(self) -> None:
        self.closing = True

    def set_protocol(self, protocol: Any) -> None:
        raise AssertionError("no request here is handed to aiohttp")


class Backend:
    """Answers each request the proxy's Http1Client sends, on the next loop turn."""

    def __init__(self) -> None:
        self.instant = InstantBackend()
        self.loop = asyncio.get_running_loop()
        self.head = 256  # how far into a request body its own fields reach

    def connection(self) -> http1._Connection:
        conn = http1._Connection(self.loop)
        received = bytearray()

        def sink(data: bytes) -> None:
            if not received and message_length(data) == len(data):  # the usual case: no copies
                self.loop.call_soon(conn.data_received, self.answer(data))
                return
            received.extend(data)
            n = message_length(received)
            if n:
                request = bytes(received[:n])
                del received[:n]
                self.loop.call_soon(conn.data_received, self.answer(request))

        conn.connection_made(MemoryTransport(sink))  # type: ignore[arg-type]
        return conn

    def answer(self, request: bytes) -> bytes:
        body_at = request.index(b"\r\n\r\n") + 4
        # The proxy writes the request's own fields before "input": look only there (find,
        # not `in`: see ocxproxy/upstream/sse.py).
        sse = request.find(b'"stream":true', body_at, body_at + self.head) >= 0
        template = self.instant.sse if sse else self.instant.json
        payload = self.instant._fill(template, request[body_at : body_at + 4])
        if not sse:
            head = (
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            )
            return head % len(payload) + payload
        chunks = [
            b"%x\r\n%s\r\n" % (len(event) + 2, event + b"\n\n")
            for event in payload.split(b"\n\n")
            if event
        ]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        return head + b"".join(chunks) + b"0\r\n\r\n"


class Client:
    """One keep-alive client connection into the front end. An answer's writes are kept as
    they come and joined once it is whole, its end known from its head's framing and the
    last write: like a socket's reader, not a scan and a copy of all of it at every write
    (that would count each byte the proxy sends as the proxy's work several times over)."""

    def __init__(self, front: FrontEnd) -> None:
        self.conn = FrontConnection(front)
        self.parts: list[bytes] = []
        self.size = 0
        self.total = -1  # the answer's length, when its head gives a Content-Length
        self.done: asyncio.Future[bytes] | None = None
        self.conn.connection_made(MemoryTransport(self.sink))  # type: ignore[arg-type]

    def sink(self, data: bytes) -> None:
        parts = self.parts
        parts.append(data)
        self.size += len(data)
        if len(parts) == 1:  # (the front end writes an answer's head whole, first)
            end = data.find(b"\r\n\r\n")
            if end < 0:
                raise AssertionError("an answer's head split over writes")
            length = CONTENT_LENGTH.search(data, 0, end + 2)
            self.total = end + 4 + int(length.group(1)) if length is not None else -1
        if self.size == self.total or (
            self.total < 0 and (data == LAST_CHUNK or data.endswith(b"\r\n" + LAST_CHUNK))
        ):
            answer = b"".join(parts) if len(parts) > 1 else data
            parts.clear()
            self.size = 0
            if self.done is not None:
                self.done.set_result(answer)

    async def post(self, body: bytes) -> bytes:
        self.done = asyncio.get_running_loop().create_future()
        head = b"POST /v1/responses HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        head += b"Authorization: Bearer sk-bench\r\nContent-Length: %d\r\n\r\n" % len(body)
        self.conn.data_received(head + body)
        answer = await self.done
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(answer[:300].decode(errors="replace"))
        return answer


_UNSET = object()


ENVELOPE_PARTS = ("all", "request", "pending", "final")


class EnvelopeSwitch:
    """Turns the Response envelope off (a no-op: one shared Envelope that changes nothing,
    its bytes written as they came) and back on, in the same process: what the proxy
    costs without it. `null`: "off" leaves it on too. `part` turns off one part only:
    "request" the request's own Envelope (one shared instead), "pending" a stream's pending
    events (created, in_progress), "final" the Response completed (a JSON answer, a
    terminal event, and their bytes)."""

    def __init__(self, *, null: bool = False, part: str = "all") -> None:
        from ocxproxy.continuation import envelope
        from ocxproxy.continuation.envelope import Envelope, Patch
        from ocxproxy.http import exchange

        shared = Envelope()

        def as_it_came(data: Any, *_: Any, **__: Any) -> Any:
            return data

        def terminal_as_it_came(self: Any, event: Any, payload: Any) -> Any:
            # The store gets the Response's bytes as the backend wrote them, as a JSON
            # answer's are (else it would encode the dict), and the event is written as
            # it came.
            span = envelope._response_span(event.data, payload)
            return Patch(), None if span is None else (event.data[span[0] : span[1]], True)

        parts: dict[str, list[tuple[Any, str, Any]]] = {
            "request": [(exchange, "Envelope", lambda *_: shared)],
            "pending": [(Envelope, "pending_event", lambda self, event: event)],
            "final": [
                (Envelope, "complete", lambda self, response, **_: Patch()),
                (Envelope, "answer", lambda self, data, response: (data, Patch())),
                (Envelope, "terminal_event", terminal_as_it_came),
                *((exchange, name, as_it_came) for name in ("spliced", "written", "written_event")),
            ],
        }
        self._off = [off for name, offs in parts.items() if part in ("all", name) for off in offs]
        self._on = [(owner, name, vars(owner).get(name, _UNSET)) for owner, name, _ in self._off]
        self.null = null

    def off(self) -> None:
        if self.null:  # (the A/B's zero: "off" does what "on" does)
            self.on()
            return
        for owner, name, value in self._off:
            setattr(owner, name, value)

    def on(self) -> None:
        for owner, name, value in self._on:
            if value is _UNSET:  # inherited (a C base's method): uncover it
                if name in vars(owner):  # (not when it is on already)
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


# --calls: (module, class, method) of the calls timed in place.
TIMED_CALLS = (
    ("ocxproxy.http.exchange", "Exchange", "finish"),  # the turn remembered
    ("ocxproxy.store.local.store", "Store", "put"),
    ("ocxproxy.store.local.ledger", "Ledger", "put"),  # its journal entry queued
    ("ocxproxy.http.exchange", "Exchange", "commit"),  # until durable
    ("ocxproxy.store.local.committer", "Committer", "_cut"),  # the commit sent to fsync
    ("ocxproxy.store.local.journal", "Journal", "encode"),  # its entries framed
)


class CallTimers:
    """`--calls`: each of TIMED_CALLS wrapped to add its thread CPU time to its sum for
    `mode` ("on", "off"; None: not counted), until `remove()`."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.sums: dict[tuple[str, str], list[int]] = {}  # (ns, calls)
        self._put_back: list[tuple[type, str, Any]] = []
        for module, owner_name, name in TIMED_CALLS:
            owner = getattr(importlib.import_module(module), owner_name)
            call = vars(owner)[name]
            self._put_back.append((owner, name, call))
            setattr(owner, name, self._timed(f"{owner_name}.{name}", call))

    def _timed(self, label: str, call: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time_ns

        def add(start: int) -> None:
            if self.mode is not None:
                total = self.sums.setdefault((label, self.mode), [0, 0])
                total[0] += clock() - start
                total[1] += 1

        if inspect.iscoroutinefunction(call):

            async def timed_coroutine(*args: Any, **kwargs: Any) -> Any:
                start = clock()
                try:
                    return await call(*args, **kwargs)
                finally:
                    add(start)

            return timed_coroutine

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                add(start)

        return timed

    def remove(self) -> None:
        for owner, name, call in self._put_back:
            setattr(owner, name, call)

    def report(self) -> list[str]:
        """A line per call timed since the last report: µs a call on, off, on - off."""
        lines = []
        for label in dict.fromkeys(label for label, _ in self.sums):
            on, off = (self.sums.get((label, mode), [0, 0]) for mode in ("on", "off"))
            if on[1] and off[1]:
                us_on, us_off = on[0] / on[1] / 1e3, off[0] / off[1] / 1e3
                lines.append(f"  {label:<18} {us_on:>8.2f} {us_off:>8.2f} {us_on - us_off:>+8.2f}")
        self.sums.clear()
        return lines


def envelope_off() -> None:
    EnvelopeSwitch().off()


@contextlib.asynccontextmanager
async def in_memory_proxy(args: argparse.Namespace) -> AsyncIterator[Client]:
    """A proxy with a fresh store, its backend the in-memory one: its client."""
    with tempfile.TemporaryDirectory() as state_dir:
        config = Config(
            upstream=("http://backend.invalid:80",),
            state_dir=Path(state_dir),
            zdr=not args.durable,  # CPU only: no wait for fsync (see above)
            health_interval=0,
            context_window=args.context_window,
        )
        proxy = build_app(config)[PROXY]
        await proxy.store.start()
        backend = Backend()
        proxy.pool.http._connect = lambda origin: _connected(backend)  # type: ignore[method-assign]
        try:
            yield Client(FrontEnd(proxy, web_server=lambda: None))  # type: ignore[arg-type,return-value]
        finally:
            await proxy.store.close()


async def measure(args: argparse.Namespace) -> None:
    if args.envelope_ab:
        await run_ab(args)
        return
    async with in_memory_proxy(args) as client:
        await run_sizes(client, args)


async def _connected(backend: Backend) -> http1._Connection:
    return backend.connection()


async def conversation(client: Client, size: int) -> str:
    """A new conversation of `size` bytes of history: its response's id."""
    first = orjson.dumps({"model": "m", "input": make_items(size)})
    rid = _RID.search(await client.post(first))
    assert rid is not None
    return rid.group(1).decode()


def continuation(rid: str, stream: bool) -> bytes:
    turn = {"model": "m", "previous_response_id": rid, "input": [user_message("next")]}
    return orjson.dumps(turn | {"stream": stream})


def store_name(args: argparse.Namespace) -> str:
    return "durable store (state dir)" if args.durable else "memory-only store (--zdr)"


async def run_sizes(client: Client, args: argparse.Namespace) -> None:
    print(f"µs per continuation turn, in-process, {store_name(args)}")
    print(f"(median of {args.rounds} rounds of {args.n} turns)")
    print(f"{'history':<8} {'JSON median (min)':>16} {'SSE median (min)':>16}")
    for name, size in SIZES.items():
        rid = await conversation(client, size)
        row: list[tuple[float, float]] = []
        for stream in (False, True):
            body = continuation(rid, stream)
            for _ in range(args.n // 5):  # warm-up
                await client.post(body)
            rounds = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.n):
                    await client.post(body)
                rounds.append((time.perf_counter() - start) / args.n)
            row.append((statistics.median(rounds) * 1e6, min(rounds) * 1e6))
            if args.profile and name == "8k" and not stream:
                await profile(client, body, args)
        cells = [f"{median:>6.1f} ({low:>5.1f})" for median, low in row]
        print(f"{name:<8} {cells[0]:>16} {cells[1]:>16}")


SETTLE_PAIRS = 50  # pairs of rounds between the A/B's heap settles
SWITCH_WARMUP = 5  # untimed turns after each switch
AB_WARMUP = 200  # untimed turns before the first pair


async def run_ab(args: argparse.Namespace) -> None:
    what = "null A/B: the envelope on in both modes" if args.null else "the envelope on - off"
    what += f" (off: its {args.part} part only)" if args.part != "all" and not args.null else ""
    what += f", {args.idle:g} µs idle after each turn" if args.idle else ""
    print(f"{what}, µs of thread CPU per continuation turn, {store_name(args)}")
    print(f"({args.rounds} pairs of alternated rounds of {args.n} turns; the heap settled")
    print(f"before the first pair and every {SETTLE_PAIRS} pairs, untimed)")
    head = f"{'case':<10} {'mean ± se':>15} {'median':>7} {'trim20 ± se':>15} {'on':>6}"
    print(head + "      GCs steal %")
    if args.calls:
        print(f"  {'call: µs a call':<18} {'on':>8} {'off':>8} {'on - off':>8}")
    calls = CallTimers() if args.calls else None
    try:
        await ab_cases(args, calls)
    finally:
        if calls is not None:
            calls.remove()


async def ab_cases(args: argparse.Namespace, calls: CallTimers | None) -> None:
    for name, size in SIZES.items():
        for stream in (False, True):
            async with in_memory_proxy(args) as client:
                body = continuation(await conversation(client, size), stream)
                for _ in range(AB_WARMUP):
                    await client.post(body)
                sampler = native_samples.Sampler(args.perf_period) if args.perf else None
                if sampler is not None:
                    sampler.start()
                before = cpu_ticks()
                try:
                    differences, on, collected = await envelope_ab(
                        client, body, args, calls, sampler
                    )
                finally:
                    if sampler is not None:
                        sampler.stop()
                stolen = steal_percent(before, cpu_ticks())
            n = len(differences)
            mean, se = statistics.mean(differences), statistics.stdev(differences) / n**0.5
            median, (trim, trim_se) = statistics.median(differences), trimmed(differences)
            case = f"{name} {'SSE' if stream else 'JSON'}"
            cells = f"{mean:>7.2f} ± {se:>5.2f} {median:>7.2f} {trim:>7.2f} ± {trim_se:>5.2f}"
            print(f"{case:<10} {cells} {statistics.median(on):>6.1f} {collected:>8} {stolen:>7}")
            if calls is not None:
                print("\n".join(calls.report()))
            if sampler is not None:
                turns = {"on": args.rounds * args.n, "off": args.rounds * args.n}
                print("\n".join(sampler.report(turns, "on", "off", args.top)))


def cpu_ticks() -> tuple[int, int] | None:
    """The machine's CPU time stolen by its hypervisor and in all, in ticks (Linux's
    /proc/stat), or None where there is none."""
    try:
        line = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(value) for value in line[1:9]]  # user ... softirq, steal
    except (OSError, ValueError):
        return None
    return (ticks[7], sum(ticks)) if len(ticks) == 8 else None


def steal_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """The share of all cores' time the hypervisor took between the two readings."""
    if before is None or after is None or after[1] <= before[1]:
        return "-"
    return f"{100 * (after[0] - before[0]) / (after[1] - before[1]):.1f}"


def rest(seconds: float) -> None:
    """Idle the thread, as it idles in epoll between served turns (blocking: uvloop's timers
    count whole ms). Its CPU time does not count a sleep."""
    if seconds:
        time.sleep(seconds)


def trimmed(values: list[float], cut: float = 0.2) -> tuple[float, float]:
    """The mean of `values` without the lowest and highest `cut` of them, and its standard
    error (from the variance of `values` winsorized: each cut value replaced by the
    nearest one kept)."""
    ordered = sorted(values)
    n, k = len(ordered), int(len(ordered) * cut)
    kept = ordered[k : n - k]
    winsorized = [kept[0]] * k + kept + [kept[-1]] * k
    return statistics.mean(kept), statistics.stdev(winsorized) / (len(kept) / n * n**0.5)


async def envelope_ab(
    client: Client,
    body: bytes,
    args: argparse.Namespace,
    calls: CallTimers | None = None,
    sampler: native_samples.Sampler | None = None,
) -> tuple[list[float], list[float], int]:
    """The pairs' differences, on - off (µs of thread CPU per turn), the "on" rounds' µs
    per turn, and how many collections fell in a timed round (see the docstring)."""
    switch = EnvelopeSwitch(null=args.null, part=args.part)
    idle = args.idle / 1e6
    timing = False
    collected = 0

    def count(phase: str, info: dict[str, int]) -> None:
        nonlocal collected
        collected += timing and phase == "start"

    differences, on_rounds = [], []
    gc.callbacks.append(count)
    try:
        for index in range(args.rounds):
            if index % SETTLE_PAIRS == 0:
                heap.settle()
            took = {}
            for on in (True, False) if index % 2 == 0 else (False, True):
                if on:
                    switch.on()
                else:
                    switch.off()
                for _ in range(SWITCH_WARMUP):
                    await client.post(body)
                    rest(idle)
                gc.collect(0)  # (see the docstring: which mode hosts a young collection)
                timing = True
                if calls is not None:
                    calls.mode = "on" if on else "off"
                since, start = native_samples.Sampler.now(), time.thread_time()
                for _ in range(args.n):
                    await client.post(body)
                    rest(idle)
                took[on] = (time.thread_time() - start) / args.n * 1e6
                if sampler is not None:
                    sampler.window("on" if on else "off", since, native_samples.Sampler.now())
                timing = False
                if calls is not None:
                    calls.mode = None
            differences.append(took[True] - took[False])
            on_rounds.append(took[True])
    finally:
        gc.callbacks.remove(count)
        switch.on()
    return differences, on_rounds, collected


async def profile(client: Client, body: bytes, args: argparse.Namespace) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.n):
        await client.post(body)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(args.top)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n\n", 3)[3],  # what --envelope-ab's figures mean
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--n", type=int, help="turns per round (2,000; 25 with --envelope-ab or --null)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds (5); pairs of rounds with --envelope-ab or --null (1,000)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--profile", action="store_true", help="cProfile the 8k JSON turns")
    parser.add_argument(
        "--top", type=int, default=30, help="functions --profile and --perf print (30)"
    )
    parser.add_argument(
        "--durable",
        action="store_true",
        help="a state dir instead of --zdr: the disk writer's threads then share the GIL",
    )
    parser.add_argument(
        "--envelope-off",
        action="store_true",
        help="the Response envelope a no-op: its cost is a run without this minus one with",
    )
    parser.add_argument(
        "--envelope-ab",
        action="store_true",
        help="the envelope's cost in µs per turn: on - off, its rounds alternated in one "
        "process (see below)",
    )
    parser.add_argument(
        "--part",
        choices=ENVELOPE_PARTS,
        default="all",
        help="with --envelope-ab, the part of the envelope turned off: the request's Envelope, "
        "a stream's pending events, or the Response's completion (default all of it)",
    )
    parser.add_argument(
        "--null",
        action="store_true",
        help="--envelope-ab with the envelope on in both modes: the A/B's own zero",
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=0,
        help="with --envelope-ab, µs the thread sleeps after each turn, as it waits for a "
        "backend or the journal between served turns (other work may evict its lines)",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="with --envelope-ab, also a few of the turn's calls timed in place, on and off "
        "(see below)",
    )
    parser.add_argument(
        "--perf",
        action="store_true",
        help="with --envelope-ab, also where the thread's CPU time goes natively, on and off: "
        "Linux perf's samples of it (see below)",
    )
    parser.add_argument(
        "--perf-period",
        type=float,
        default=50.0,
        help="with --perf, µs of the thread's CPU time between samples",
    )
    parser.add_argument(
        "--context-window",
        type=int,
        default=0,
        help="a context window in tokens: every turn is then checked against it (estimated)",
    )
    args = parser.parse_args()
    args.envelope_ab = args.envelope_ab or args.null
    n, rounds = (
        ((10, 20) if args.quick else (25, 1000))
        if args.envelope_ab
        else ((300, 3) if args.quick else (2000, 5))
    )
    args.n = n if args.n is None else args.n
    args.rounds = rounds if args.rounds is None else args.rounds
    if args.envelope_ab and (args.envelope_off or args.rounds < 2):
        parser.error("--envelope-ab switches the envelope itself, over 2 pairs or more")
    if args.part != "all" and not args.envelope_ab:
        parser.error("--part is --envelope-ab's")
    if args.idle and not args.envelope_ab:
        parser.error("--idle is --envelope-ab's")
    if args.calls and not args.envelope_ab:
        parser.error("--calls is --envelope-ab's")
    if args.perf and not args.envelope_ab:
        parser.error("--perf is --envelope-ab's")
    if args.perf and (why := native_samples.available()) is not None:
        parser.error(f"--perf: {why}")
    if args.perf_period <= 0:
        parser.error("--perf-period is µs between samples: more than 0")
    if args.idle < 0:
        parser.error("--idle is µs of sleep: 0 or more")
    if args.envelope_off:
        envelope_off()
    try:
        import uvloop
    except ImportError:
        asyncio.run(measure(args))
    else:
        uvloop.run(measure(args))


if __name__ == "__main__":
    main()
