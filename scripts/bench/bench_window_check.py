"""The cost of checking a turn against the context window when it is far from it (the
common case: an estimate from the parent's reported usage, no backend round trip).

Times `http/window.fit_window` alone, in a loop, for a continuation of a ~30k-token
chain: with no window known (the check stops at once) and with `--context-window`.

    python scripts/bench/bench_window_check.py
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import orjson

from ocxproxy.config import Config
from ocxproxy.continuation.expand import parse_request
from ocxproxy.continuation.window import Fact
from ocxproxy.http.context import PROXY
from ocxproxy.http.window import fit_window
from ocxproxy.model import Record
from ocxproxy.server import build_app

N = 100_000
BACKEND = "http://backend.invalid:80"


async def measure(window: int, state: Path) -> float:
    config = Config(
        upstream=(BACKEND,), state_dir=state, zdr=True, health_interval=0, context_window=window
    )
    proxy = build_app(config)[PROXY]
    raw = orjson.dumps({"model": "m", "input": "hello", "previous_response_id": "resp_1"})
    request = parse_request(raw)
    parent = Record(
        id="resp_1",
        scope="s",
        created_at=0.0,
        expires_at=float("inf"),
        durable=False,
        links=None,
        response=None,  # type: ignore[arg-type]
        backend=BACKEND,
    )
    proxy.book.put("resp_1", Fact(30_000, 120_000))
    body = b"x" * 120_100
    start = time.perf_counter()
    for _ in range(N):
        await fit_window(proxy, request, parent, "resp_1", [], [b"{}"], body, raw)
    return (time.perf_counter() - start) / N * 1e6


async def main() -> None:
    with tempfile.TemporaryDirectory() as state:
        for window in (0, 1_000_000):
            label = f"--context-window {window}" if window else "no window known"
            print(f"{label}: {await measure(window, Path(state)):.2f} µs per turn")


if __name__ == "__main__":
    asyncio.run(main())
