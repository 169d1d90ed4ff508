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
    python scripts/bench/bench_hotpath.py --envelope-ab    # its µs: on - off, alternated
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from benchkit import make_items, user_message
from instant_backend import InstantBackend
from loopback import CONTENT_LENGTH, message_length

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
        # The proxy writes the request's own fields before "input": look only there.
        sse = b'"stream":true' in request[body_at : body_at + self.head]
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


class EnvelopeSwitch:
    """Turns the Response envelope off (a no-op: one shared Envelope that changes nothing,
    its bytes written as they came) and back on, in the same process: what the proxy
    costs without it."""

    def __init__(self) -> None:
        from ocxproxy.continuation.envelope import Envelope, Patch
        from ocxproxy.http import exchange

        shared = Envelope()

        def as_it_came(data: Any, *_: Any, **__: Any) -> Any:
            return data

        self._off: list[tuple[Any, str, Any]] = [
            (Envelope, "complete", lambda self, response, **_: Patch()),
            (Envelope, "answer", lambda self, data, response: (data, Patch())),
            (Envelope, "pending_event", lambda self, event: event),
            # (no bytes: the store encodes the dict)
            (Envelope, "terminal_event", lambda self, event, payload: (Patch(), None)),
            (exchange, "Envelope", lambda *_: shared),  # (the per-request one)
            *((exchange, name, as_it_came) for name in ("spliced", "written", "written_event")),
        ]
        self._on = [(owner, name, vars(owner).get(name, _UNSET)) for owner, name, _ in self._off]

    def off(self) -> None:
        for owner, name, value in self._off:
            setattr(owner, name, value)

    def on(self) -> None:
        for owner, name, value in self._on:
            if value is _UNSET:  # inherited (a C base's method): uncover it
                if name in vars(owner):  # (not when it is on already)
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


def envelope_off() -> None:
    EnvelopeSwitch().off()


async def measure(args: argparse.Namespace) -> None:
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
        client = Client(FrontEnd(proxy, web_server=lambda: None))  # type: ignore[arg-type,return-value]
        try:
            await run_sizes(client, args)
        finally:
            await proxy.store.close()


async def _connected(backend: Backend) -> http1._Connection:
    return backend.connection()


async def run_sizes(client: Client, args: argparse.Namespace) -> None:
    store = "durable store (state dir)" if args.durable else "memory-only store (--zdr)"
    print(f"µs per continuation turn, in-process, {store}")
    if args.envelope_ab:
        print(f"the envelope's cost: on - off, median (least) of {args.rounds} paired rounds")
    else:
        print(f"(median of {args.rounds} rounds of {args.n} turns)")
    print(f"{'history':<8} {'JSON median (min)':>16} {'SSE median (min)':>16}")
    for name, size in SIZES.items():
        first = orjson.dumps({"model": "m", "input": make_items(size)})
        rid = _RID.search(await client.post(first))
        assert rid is not None
        row: list[tuple[float, float]] = []
        for stream in (False, True):
            turn = {"model": "m", "previous_response_id": rid.group(1).decode()}
            turn |= {"input": [user_message("next")], "stream": stream}
            body = orjson.dumps(turn)
            for _ in range(args.n // 5):  # warm-up
                await client.post(body)
            if args.envelope_ab:
                row.append(await envelope_ab(client, body, args))
                continue
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


async def envelope_ab(client: Client, body: bytes, args: argparse.Namespace) -> tuple[float, float]:
    """The envelope's µs per turn: rounds with it on and off alternated (in turn first, so
    a drift of the machine falls on both), the median and the least of their differences."""
    switch = EnvelopeSwitch()
    differences = []
    for index in range(args.rounds):
        took = {}
        for on in (True, False) if index % 2 == 0 else (False, True):
            if on:
                switch.on()
            else:
                switch.off()
            for _ in range(args.n // 10):  # the other mode's warm-up
                await client.post(body)
            start = time.perf_counter()
            for _ in range(args.n):
                await client.post(body)
            took[on] = (time.perf_counter() - start) / args.n
        differences.append(took[True] - took[False])
    switch.on()
    return statistics.median(differences) * 1e6, min(differences) * 1e6


async def profile(client: Client, body: bytes, args: argparse.Namespace) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.n):
        await client.post(body)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="turns per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--profile", action="store_true", help="cProfile the 8k JSON turns")
    parser.add_argument("--top", type=int, default=30)
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
        help="the envelope's cost in µs per turn: its rounds on and off alternated in one "
        "process, each cell the median (least) of on - off",
    )
    parser.add_argument(
        "--context-window",
        type=int,
        default=0,
        help="a context window in tokens: every turn is then checked against it (estimated)",
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds = 300, 3
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
