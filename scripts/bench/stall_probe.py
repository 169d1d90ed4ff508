"""`ocxproxy serve` in this process with an event-loop stall probe, for benchmarks.

A watchdog thread notices when the event loop has not run its 1 ms heartbeat for more
than $OCXPROXY_STALL_MS (default 20) ms, samples the loop thread's stack then, and times
every cyclic-GC pass (gc.callbacks). On exit it prints to stderr each kind of stall, its
count and longest pause, by what the loop thread was doing (the GC by generation, or the
innermost ocxproxy frames), and the longest GC passes. Everything else is `ocxproxy`'s own
command line:

    python scripts/bench/stall_probe.py serve --upstream URL --port 0 ...
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from types import FrameType
from typing import Any

from ocxproxy import cli, server

THRESHOLD = float(os.environ.get("OCXPROXY_STALL_MS", "20")) / 1000
_beat = [time.perf_counter()]
_gc_start: list[float] = [0.0]
_gc_gen: list[int | None] = [None]
_gc_pauses: list[tuple[float, int, int]] = []  # (seconds, generation, objects collected)
_stalls: dict[str, list[float]] = defaultdict(list)
_main = threading.main_thread().ident


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_start[0], _gc_gen[0] = time.perf_counter(), info["generation"]
    else:
        _gc_pauses.append(
            (time.perf_counter() - _gc_start[0], info["generation"], info["collected"])
        )
        _gc_gen[0] = None


def _where(frame: FrameType | None) -> str:
    if _gc_gen[0] is not None:
        return f"gc generation {_gc_gen[0]}"
    names: list[str] = []
    while frame is not None and len(names) < 3:
        path = frame.f_code.co_filename
        if "/ocxproxy/" in path:
            names.append(f"{path.rsplit('/ocxproxy/', 1)[1]}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(names) or "outside ocxproxy"


def _watch() -> None:
    while True:
        time.sleep(0.002)
        late = time.perf_counter() - _beat[0]
        if late < THRESHOLD:
            continue
        last = _beat[0]
        where = _where(sys._current_frames().get(_main or 0))
        while _beat[0] == last:
            time.sleep(0.001)
        _stalls[where].append(_beat[0] - last)


async def _heartbeat() -> None:
    while True:
        _beat[0] = time.perf_counter()
        await asyncio.sleep(0.001)


def _report() -> None:
    out = [f"stall probe: pauses of the event loop over {THRESHOLD * 1000:.0f} ms"]
    for where, pauses in sorted(_stalls.items(), key=lambda kv: -max(kv[1])):
        out.append(f"  {len(pauses):5d} x, longest {max(pauses) * 1000:7.1f} ms: {where}")
    gens = Counter(g for _, g, _ in _gc_pauses)
    longest = sorted(_gc_pauses, reverse=True)[:5]
    out.append(
        f"gc passes by generation: {dict(sorted(gens.items()))}; longest: "
        + ", ".join(f"{s * 1000:.1f} ms (gen {g})" for s, g, _ in longest)
    )
    print("\n".join(out), file=sys.stderr, flush=True)


def main() -> None:
    gc.callbacks.append(_on_gc)
    atexit.register(_report)
    threading.Thread(target=_watch, daemon=True, name="stall-probe").start()
    serve = server.serve

    async def probed(config: Any) -> None:
        beat = asyncio.get_running_loop().create_task(_heartbeat())
        try:
            await serve(config)
        finally:
            beat.cancel()

    server.serve = probed  # type: ignore[assignment]
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
