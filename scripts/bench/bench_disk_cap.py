"""A real `ocxproxy serve` under a small --max-disk-bytes, in front of the fake backend,
driven by long chains (`previous_response_id`): checkpoints per minute, the process's CPU,
the state dir's bytes, evictions, and what the chains' next turns were answered.

    python scripts/bench/bench_disk_cap.py [--cap 16MiB] [--chains 4] [--turn-bytes 8192]
        [--seconds 60]

Each turn's input is `--turn-bytes` of random text (zstd does not shrink it), so a chain
of n turns holds about n times that on disk, stored once and shared by its turns.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import string
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.fakes.backend import FakeBackend
from tests.serve import Serve, create

DISK = 'ocxproxy_store_bytes{tier="disk"}'


def metric(text: str, name: str) -> float:
    """The sum of every series of `name` in a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def chain(
    http: aiohttp.ClientSession, url: str, until: float, size: int, answers: dict[str, int]
) -> None:
    rng = random.Random()
    previous: str | None = None
    while time.monotonic() < until:
        text = "".join(rng.choices(string.ascii_letters, k=size))
        body = {"model": "fake-model", "input": text}
        if previous is not None:
            body["previous_response_id"] = previous
        status, error, rid = await create(http, url, body)
        key = str(status) if error is None else f"{status} {error.get('code')}"
        answers[key] = answers.get(key, 0) + 1
        if rid is not None:
            previous = rid
        elif error is not None and error.get("code") == "previous_response_not_found":
            previous = None  # evicted: start over
        else:
            await asyncio.sleep(0.2)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", default="16MiB")
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--turn-bytes", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}; cap {args.cap}, {args.chains} chains, "
          f"{args.turn_bytes} B a turn, {args.seconds:.0f} s")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeBackend() as backend:
            proxy = Serve(backend.url, Path(tmp) / "state", "--max-disk-bytes", args.cap)
            url = await proxy.start()
            answers: dict[str, int] = {}
            async with aiohttp.ClientSession() as http:
                cpu0, t0 = proxy.cpu_seconds(), time.monotonic()
                until = t0 + args.seconds
                tasks = [
                    asyncio.ensure_future(chain(http, url, until, args.turn_bytes, answers))
                    for _ in range(args.chains)
                ]
                while time.monotonic() < until:
                    await asyncio.sleep(min(10.0, max(0.0, until - time.monotonic())))
                    async with http.get(url.removesuffix("/v1") + "/metrics") as r:
                        page = await r.text()
                    elapsed = time.monotonic() - t0
                    checkpoints = metric(page, "ocxproxy_snapshot_writes_total")
                    print(
                        f"{elapsed:5.0f} s: checkpoints {checkpoints:.0f}"
                        f", disk {metric(page, DISK) / 2**20:.1f} MiB"
                        f", evictions {metric(page, 'ocxproxy_store_evictions_total'):.0f}"
                        f", cpu {proxy.cpu_seconds() - cpu0:.1f} s, answers {answers}",
                        flush=True,
                    )
                await asyncio.gather(*tasks)
                elapsed, cpu = time.monotonic() - t0, proxy.cpu_seconds() - cpu0
                async with http.get(url.removesuffix("/v1") + "/metrics") as r:
                    page = await r.text()
            await proxy.stop()
            checkpoints = metric(page, "ocxproxy_snapshot_writes_total")
            turns = sum(n for k, n in answers.items() if k == "200")
            print(f"checkpoints/min {checkpoints / elapsed * 60:.1f}, cpu {cpu / elapsed:.2f} "
                  f"s/s, turns {turns} ({turns / elapsed:.1f}/s), answers {answers}")  # fmt: skip
            for line in proxy.output:
                if re.search(r"WARNING|ERROR", line):
                    print("log:", line[:200])


if __name__ == "__main__":
    asyncio.run(main())
