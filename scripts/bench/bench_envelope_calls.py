"""The Response envelope's calls timed where they run, in a turn, and warm, in a loop.

bench_hotpath.py's rig (the real request path in one process, in-memory transports,
`--zdr`) runs continuation turns (`--size`: ~8k or ~128k tokens of history), JSON and
SSE, with each of the envelope's per-turn calls wrapped in a timer: making the request's
Envelope, `answer` (a JSON answer), `pending_event` (by event: `response.created`,
`response.in_progress`) and `terminal_event` (`response.completed`). Then each call is
made again on the last turn's own inputs, a fresh copy each time, in a tight loop: the
same work, with the caches (code, data, branch history) as that call left them. The
timer's own cost is measured the same way around a call that does nothing, and taken off
both.

In place, a call runs once per turn, after the rest of a turn (~300 µs of the
interpreter, the history's bytes) has evicted its code and state; warm, back to back.
The larger history evicts more of it from the caches nearer the core: each call's warm
figure is the same at both sizes, its in-place one is not. The ratio between the two
says how much of the envelope's native cost is the memory it touches and the code it
runs, not the instructions callgrind counts (bench_hotpath_ir.py). It also checks that
every call took the compiled path.

    python scripts/bench/bench_envelope_calls.py            # ~30 s
    python scripts/bench/bench_envelope_calls.py --turns 500 --repeat 500
    python scripts/bench/bench_envelope_calls.py --size 128k
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import bench_hotpath as rig
import orjson
from benchkit import make_items, user_message

from ocxproxy import heap
from ocxproxy.continuation import envelope
from ocxproxy.http import exchange
from ocxproxy.speedups import SPEEDUPS
from ocxproxy.upstream.sse import Event

_NS = time.perf_counter_ns
_MADE = "Envelope"
_METHODS = ("answer", "pending_event", "terminal_event")
_FALLBACKS = ("_answer", "_pending_event", "_terminal_event")


class Timed:
    """Each call's total ns and count in place, by label (the method, and a pending or
    terminal event's name), and the inputs of its last use once `keep` is set: copies
    taken before the call (it may change an event in place)."""

    def __init__(self) -> None:
        self.place: dict[str, list[int]] = {}
        self.last: dict[str, tuple[Any, ...]] = {}
        self.keep = False

    def wrap(
        self, call: Callable[..., Any], label: Callable[..., str], copy: bool = True
    ) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            name = label(*args)
            if self.keep:
                self.last[name] = tuple(map(_copy, args)) if copy else args
            start = _NS()
            result = call(*args)
            took = _NS() - start
            cell = self.place.setdefault(name, [0, 0])
            cell[0] += took
            cell[1] += 1
            return result

        return timed


class _Encoded(bytes):
    """A dict input, encoded: parsed again for each warm call (a fresh dict)."""


def _copy(value: Any) -> Any:
    if type(value) is Event:
        return Event(value.raw, value.name, value.data, value.at)
    if type(value) is dict:
        return _Encoded(orjson.dumps(value))
    return value


def _fresh(value: Any) -> Any:
    if type(value) is Event:
        return _copy(value)
    if type(value) is _Encoded:
        return orjson.loads(bytes(value))
    return value


def best_of(make: Callable[[], Callable[[], Any]], repeat: int) -> float:
    """ns per call, back to back, the best of 5 loops: `make()` prepares a call's fresh
    inputs (not timed) and returns the call."""
    best = float("inf")
    for _ in range(5):
        total = 0
        for _ in range(repeat):
            call = make()
            start = _NS()
            call()
            total += _NS() - start
        best = min(best, total / repeat)
    return best


def _nothing() -> None:
    return None


async def run(args: argparse.Namespace) -> None:
    rig_args = argparse.Namespace(durable=False, context_window=0)  # (--zdr, no window)
    async with rig.in_memory_proxy(rig_args) as client:
        await measure(client, args)


async def measure(client: rig.Client, args: argparse.Namespace) -> None:
    first = orjson.dumps({"model": "m", "input": make_items(rig.SIZES[args.size])})
    found = rig._RID.search(await client.post(first))
    assert found is not None
    made = getattr(exchange, _MADE)  # (the name the exchange makes its Envelope by)
    methods = {name: vars(envelope.Envelope).get(name) for name in (*_METHODS, *_FALLBACKS)}
    compiled = {name: getattr(envelope.Envelope, name) for name in _METHODS}
    python = {name: getattr(envelope.Envelope, name) for name in _FALLBACKS}
    declined = dict.fromkeys(_FALLBACKS, 0)

    def counted(name: str) -> Callable[..., Any]:
        def fallback(*args: Any) -> Any:
            declined[name] += 1
            return python[name](*args)

        return fallback

    def label(name: str) -> Callable[..., str]:
        return lambda _, first, *__: name if name == "answer" else f"{name} {first.name}"

    timed = Timed()
    setattr(exchange, _MADE, timed.wrap(made, lambda *_: "Envelope()", copy=False))
    for name in _METHODS:
        setattr(envelope.Envelope, name, timed.wrap(compiled[name], label(name)))
    for name in _FALLBACKS:
        setattr(envelope.Envelope, name, counted(name))
    try:
        for stream in (False, True):
            turn = {"model": "m", "previous_response_id": found.group(1).decode()}
            turn |= {"input": [user_message("next")], "stream": stream}
            body = orjson.dumps(turn)
            for _ in range(args.turns // 5):  # warm-up: the shapes a backend answers in
                await client.post(body)
            timed.place.clear()
            declined.update(dict.fromkeys(_FALLBACKS, 0))
            heap.settle()  # (as `serve` does every second)
            for _ in range(args.turns - 1):
                await client.post(body)
            timed.keep = True
            await client.post(body)
            timed.keep = False
            print("SSE" if stream else "JSON")
            report(timed, made, compiled, args.repeat)
            if any(declined.values()):
                print(f"  (the Python paths ran: {declined})")
    finally:
        setattr(exchange, _MADE, made)
        for name, method in methods.items():
            if method is None:
                delattr(envelope.Envelope, name)
            else:
                setattr(envelope.Envelope, name, method)


def report(timed: Timed, made: Any, compiled: dict[str, Callable[..., Any]], repeat: int) -> None:
    cost = best_of(lambda: _nothing, repeat)  # the timer's own
    for label, (total, count) in sorted(timed.place.items()):
        make = _warm_call(label, timed.last[label], made, timed.last["Envelope()"], compiled)
        place = total / count - cost
        warm = best_of(make, repeat) - cost
        ratio = place / warm
        print(f"  {label:<36} {place / 1000:>8.2f} {warm / 1000:>8.2f} {ratio:>6.1f}x")


def _warm_call(
    label: str,
    inputs: tuple[Any, ...],
    made: Any,
    made_with: tuple[Any, ...],
    compiled: dict[str, Callable[..., Any]],
) -> Callable[[], Callable[[], Any]]:
    """What makes the call `label` again on its last inputs: a fresh Envelope made as the
    last one was, and fresh copies of what the call may change."""
    if label == "Envelope()":
        return lambda: partial(made, *inputs)
    method = compiled[label.partition(" ")[0]]
    return lambda: partial(method, made(*made_with), *map(_fresh, inputs[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=3000, help="turns timed, JSON and SSE")
    parser.add_argument("--size", choices=rig.SIZES, default="8k", help="the history's size")
    parser.add_argument("--repeat", type=int, default=2000, help="warm calls per best-of-5")
    args = parser.parse_args()
    paths = "compiled" if SPEEDUPS is not None else "Python (no compiled build)"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"µs per call, {args.size} continuation turns, memory-only store (--zdr), {paths} paths;")
    print(f"the timer's own cost taken off; load {load}")
    print(f"  {'call':<36} {'in place':>8} {'warm':>8} {'ratio':>7}")
    try:
        import uvloop

        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
