"""Background responses: what a create costs to answer, whether a stream resumes exactly,
how fast a cancel is, and the CPU a background turn costs next to a foreground one.

Starts the fake backend (tests/fakes/backend.py, a stream of ~10 events, `--delay`
seconds apart) and the proxy (`serve`, the default durable configuration) as
subprocesses, and reports:
  create     POST /v1/responses {background: true} on a ~10 s backend turn (delay 1 s):
             the time until the queued Response is answered, --creates of them, one
             after another while the earlier ones run (the first --max-background run,
             the rest wait queued); with --history-bytes, each continues one stored
             response of that size; and the bytes each adds to background.jsonl
  cancel     POST /v1/responses/{id}/cancel of each of them: the time until the
             cancelled Response is answered (the run is cut and its backend request
             closed by then, or a second has passed)
  resume     --cuts streams (background + stream, a fresh fast backend): each read up to
             a random event N, dropped, then GET ?stream=true&starting_after=N read to the
             end; correct when the events read, joined, are the whole log (GET
             ?stream=true from 0), sequence numbers 0..last with no gap or duplicate,
             ending in response.completed
  cpu        the proxy's CPU per turn (/proc/PID/stat) of --turns background+stream
             turns read to the end, and of as many foreground stream:true turns,
             alternated in blocks, on an instant backend

    .venv/bin/python scripts/bench/bench_background.py            # a few minutes
    .venv/bin/python scripts/bench/bench_background.py --quick    # smoke, seconds
    # the creates on top of a long chain (one stored input of ~1 MB), and the bytes
    # each one journals:
    .venv/bin/python scripts/bench/bench_background.py --only-creates --history-bytes 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from benchkit import (  # noqa: E402
    PYTHON,
    Child,
    Summary,
    cpu_seconds,
    running,
    start_child,
    start_proxy,
    table,
    verdict,
)

HEADERS = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}


def start_fake(delay: float) -> Child:
    argv = [PYTHON, "-m", "tests.fakes.backend", "--port", "0", "--delay", str(delay)]
    return start_child(f"fake{delay}", argv, r"(http://\S+)")


def body(text: str, **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "input": text, **extra})


async def events_of(answer: aiohttp.ClientResponse, stop_after: int | None = None) -> list[Any]:
    """The SSE events' payloads of an answer, up to the one numbered `stop_after`."""
    events: list[Any] = []
    buffer = b""
    async for chunk in answer.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            for line in raw.split(b"\n"):
                if line.startswith(b"data: "):
                    events.append(orjson.loads(line[6:]))
            if stop_after is not None and events and events[-1]["sequence_number"] >= stop_after:
                return events
    return events


def file_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


async def stored_turn(url: str, size: int) -> str:
    """A stored response whose input is `size` bytes of text: the id the creates continue."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/responses", data=body("x" * size), headers=HEADERS) as answer,
    ):
        done = await answer.json()
    assert done["status"] == "completed", done
    return str(done["id"])


async def creates_and_cancels(
    url: str, n: int, journal: Path, parent: str | None
) -> tuple[Summary, Summary, int, float]:
    """The creates' and cancels' times, how many were cancelled, and the bytes the
    creates added to background.jsonl, per create."""
    create_times: list[float] = []
    cancel_times: list[float] = []
    ids: list[str] = []
    cancelled = 0
    extra = {} if parent is None else {"previous_response_id": parent}
    before = file_size(journal)
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            started = time.perf_counter()
            async with http.post(
                f"{url}/v1/responses",
                data=body(f"long {i}", background=True, **extra),
                headers=HEADERS,
            ) as answer:
                created = await answer.json()
            create_times.append(time.perf_counter() - started)
            assert created["status"] == "queued", created
            ids.append(created["id"])
        journaled = (file_size(journal) - before) / n
        await asyncio.sleep(1.0)  # the first ones are in progress by now
        for response_id in ids:
            started = time.perf_counter()
            async with http.post(
                f"{url}/v1/responses/{response_id}/cancel", headers=HEADERS
            ) as answer:
                done = await answer.json()
            cancel_times.append(time.perf_counter() - started)
            cancelled += done["status"] == "cancelled"
    return Summary.of(create_times), Summary.of(cancel_times), cancelled, journaled


async def one_cut(http: aiohttp.ClientSession, url: str, rng: random.Random) -> bool:
    async with http.post(
        f"{url}/v1/responses", data=body("cut me", background=True, stream=True), headers=HEADERS
    ) as answer:
        cut = rng.randrange(0, 12)  # the log of one fake turn is 13 events
        first = await events_of(answer, stop_after=cut)
    response_id = first[0]["response"]["id"]
    last = first[-1]["sequence_number"]
    query = f"stream=true&starting_after={last}"
    async with http.get(f"{url}/v1/responses/{response_id}?{query}", headers=HEADERS) as answer:
        rest = await events_of(answer)
    async with http.get(f"{url}/v1/responses/{response_id}?stream=true", headers=HEADERS) as answer:
        whole = await events_of(answer)
    joined = first + rest
    numbers = [event["sequence_number"] for event in joined]
    return (
        joined == whole
        and numbers == list(range(len(joined)))
        and joined[-1]["type"] == "response.completed"
    )


async def resumes(url: str, cuts: int, seed: int) -> int:
    rng = random.Random(seed)
    good = 0
    async with aiohttp.ClientSession() as http:
        for start in range(0, cuts, 8):
            batch = [one_cut(http, url, rng) for _ in range(min(8, cuts - start))]
            good += sum(await asyncio.gather(*batch))
    return good


async def turns(url: str, n: int, *, background: bool) -> None:
    extra = {"background": True} if background else {}
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            async with http.post(
                f"{url}/v1/responses", data=body(f"turn {i}", stream=True, **extra), headers=HEADERS
            ) as answer:
                events = await events_of(answer)
                assert events[-1]["type"] == "response.completed", events[-1]


async def cpu_per_turn(proxy: Child, n: int, blocks: int) -> tuple[float, float]:
    spent = {True: 0.0, False: 0.0}
    await turns(proxy.url, 20, background=True)  # warm up both paths
    await turns(proxy.url, 20, background=False)
    for _ in range(blocks):
        for background in (False, True):
            before = cpu_seconds(proxy.pid)
            await turns(proxy.url, n // blocks, background=background)
            spent[background] += cpu_seconds(proxy.pid) - before
    per = n // blocks * blocks
    return spent[False] / per, spent[True] / per


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--creates", type=int, default=200)
    parser.add_argument("--cuts", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--history-bytes",
        type=int,
        default=0,
        help="the creates continue one stored response whose input is this many bytes "
        "(0: each starts a chain of its own)",
    )
    parser.add_argument(
        "--only-creates", action="store_true", help="the creates and cancels, nothing else"
    )
    args = parser.parse_args()
    if args.quick:
        args.creates, args.cuts, args.turns = 10, 16, 40
    state = Path(tempfile.mkdtemp(prefix="ocxproxy_bench_"))
    atexit.register(shutil.rmtree, state, ignore_errors=True)
    slow, fast, instant = start_fake(1.0), start_fake(0.005), start_fake(0.0)
    with running(slow, fast, instant):
        slow_proxy = start_proxy(slow.url, "--background-queue", "1000", "--state-dir", str(state))
        with running(slow_proxy):
            parent = None
            if args.history_bytes:
                parent = await stored_turn(slow_proxy.url, args.history_bytes)
            create, cancel, cancelled, journaled = await creates_and_cancels(
                slow_proxy.url, args.creates, state / "background.jsonl", parent
            )
        good = foreground = background = 0.0
        if not args.only_creates:
            fast_proxy = start_proxy(fast.url)
            with running(fast_proxy):
                good = await resumes(fast_proxy.url, args.cuts, args.seed)
            cpu_proxy = start_proxy(instant.url)
            with running(cpu_proxy):
                foreground, background = await cpu_per_turn(cpu_proxy, args.turns, 4)
    print(
        table(
            ["figure", "n", "p50 ms", "p99 ms", "max ms", "target", "verdict"],
            [
                [
                    "create -> queued answer (10 s turns)",
                    create.n,
                    ms(create.p50),
                    ms(create.p99),
                    ms(create.max),
                    "p99 <= 20 ms",
                    verdict(create.p99 <= 0.020),
                ],
                [
                    "cancel -> cancelled answer",
                    cancel.n,
                    ms(cancel.p50),
                    ms(cancel.p99),
                    ms(cancel.max),
                    "<= 1 s",
                    verdict(cancel.max <= 1.0),
                ],
            ],
        )
    )
    print(f"cancelled: {cancelled}/{create.n}")
    print(
        f"background.jsonl bytes per create: {journaled:,.0f} "
        f"(continuing a stored input of {args.history_bytes:,} bytes)"
    )
    if args.only_creates:
        return
    print(
        f"resume after a random cut: {good}/{args.cuts} gap-free, duplicate-free "
        f"({verdict(good == args.cuts)})"
    )
    ratio = background / foreground if foreground else float("nan")
    print(
        f"proxy CPU per streamed turn: foreground {foreground * 1e6:,.0f} µs, background "
        f"{background * 1e6:,.0f} µs, ratio {ratio:.2f} (target <= 1.2: {verdict(ratio <= 1.2)})"
    )


if __name__ == "__main__":
    asyncio.run(main())
