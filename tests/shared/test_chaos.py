"""Chaos: steady traffic on three replicas on one Valkey (strict profile: appendfsync always,
--durability ack) while a random replica is killed with -9 every few seconds, and once the
Valkey server itself, restarted on the same data dir. Afterwards every turn whose success a
client received continues, with its whole history, from every replica (0 acknowledged
turns lost); every failure was reported as one (an OpenAI-shaped error, an SSE `error`
event, or a connection the killed replica dropped), never as a success.

OCX_CHAOS_SECONDS sets how long the traffic runs (default 60)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import pytest

from ocxproxy.aio import spawn
from tests.fakes.backend import FakeBackend
from tests.serve import Serve, output_text, respond
from tests.shared.conftest import MakeReplicas
from tests.shared.replicas import Replicas
from tests.shared.servers import KvServer
from tests.shared.test_outage import ready, until
from tests.shared.test_replicas import auth

SECONDS = float(os.environ.get("OCX_CHAOS_SECONDS", "60"))
WORKERS = 4
PACE = 0.25  # seconds between one worker's turns: steady, not saturating 2 cores


@dataclass
class Chain:
    head: str | None = None  # the last acknowledged turn
    depth: int = 0  # user turns in its history
    acked: list[tuple[str, int]] = field(default_factory=list)  # (id, depth)
    failures: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


def classify(status: int, error: dict[str, object] | None) -> str:
    """What kind of failure the client was told of; '' if it was no proper report."""
    if error is None:
        return ""
    if status == 200:  # an SSE stream: an error event, or cut by the killed replica
        return "sse error event" if error.get("type") == "error" else "sse cut"
    inner = error if "message" in error else {}
    return f"{status} {inner.get('code') or inner.get('type')}" if inner else ""


async def drive(
    w: int, chain: Chain, replicas: Replicas, http: aiohttp.ClientSession, stop_at: float
) -> None:
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        serve = replicas.next()
        body: dict[str, object] = {"model": "m", "input": f"w{w} t{n}", "stream": n % 2 == 0}
        if chain.head is not None:
            body["previous_response_id"] = chain.head
        try:
            status, error, response = await respond(http, serve.url, body, auth())
        except (aiohttp.ClientError, TimeoutError):
            chain.failures["connection dropped"] += 1
        else:
            if response is not None:
                expected = f"echo#{2 * chain.depth + 1}: w{w} t{n}"
                if output_text(response) != expected:  # history lost or reordered
                    chain.violations.append(f"{output_text(response)!r} != {expected!r}")
                chain.depth += 1
                chain.head = response["id"]
                chain.acked.append((response["id"], chain.depth))
            elif error and error.get("code") == "previous_response_not_found":
                chain.violations.append(f"acknowledged {chain.head} lost: {error}")
            elif kind := classify(status, error):
                chain.failures[kind] += 1
            else:
                chain.violations.append(f"failure not reported as one: {status} {error}")
        await asyncio.sleep(PACE)


async def havoc(replicas: Replicas, kv: KvServer, stop_at: float, log: list[str]) -> None:
    rng = random.Random(os.environ.get("OCX_CHAOS_SEED", "15"))
    kv_killed = False
    i = -1
    while time.monotonic() < stop_at - 4:
        await asyncio.sleep(rng.uniform(2, 4))
        i = rng.choice([j for j in range(len(replicas)) if j != i])  # not the same twice
        await replicas.kill9(i)
        log.append(f"kill -9 replica {i}")
        if not kv_killed and time.monotonic() > stop_at - SECONDS / 2:
            kv.kill9()
            log.append("kill -9 valkey")
            await asyncio.sleep(1)
            await kv.astart()
            kv_killed = True
        await replicas.start_slot(i)
    assert kv_killed, "the traffic ran too short to kill the store"


@pytest.mark.timeout(SECONDS + 150)
async def test_no_acknowledged_turn_is_lost_under_kill_9(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    # Each answer takes a while (per SSE event too), so kills land on turns in flight:
    # between begin and commit, and in the middle of streams.
    backend.delay = 0.03
    replicas = await make_replicas(valkey_server.url, 3, "--durability", "ack")
    chains = [Chain() for _ in range(WORKERS)]
    log: list[str] = []
    stop_at = time.monotonic() + SECONDS
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        tasks = [
            spawn(drive(w, chain, replicas, client, stop_at), name=f"chaos-{w}")
            for w, chain in enumerate(chains)
        ]
        await havoc(replicas, valkey_server, stop_at, log)
        await asyncio.gather(*tasks)

    for serve in replicas.slots:

        async def back(serve: Serve = serve) -> bool:
            return (await ready(http, serve))[0] == 200

        await until(back, 20, "every replica is ready again")
    acked = [(w, rid, depth) for w, c in enumerate(chains) for rid, depth in c.acked]
    failures = sum((c.failures for c in chains), Counter[str]())
    report = f"{len(acked)} acknowledged, failures {dict(failures)}, {log}"
    assert all(len(c.acked) >= 10 for c in chains), report
    dropped = failures["connection dropped"] + failures["sse cut"]
    assert dropped > 0, report  # kills did hit turns in flight
    assert sum(failures.values()) > dropped, report  # and the store outage was answered
    violations = [v for c in chains for v in c.violations]
    assert not violations, (violations[:10], report)

    # Every acknowledged turn continues from every replica with its whole history.
    lost: list[str] = []
    gate = asyncio.Semaphore(12)

    async def check(w: int, rid: str, depth: int, serve: Serve) -> None:
        body = {"model": "m", "input": "check", "previous_response_id": rid, "store": False}
        async with gate:
            status, error, response = await respond(http, serve.url, body, auth())
        if response is None or output_text(response) != f"echo#{2 * depth + 1}: check":
            lost.append(f"{rid} (chain {w}, depth {depth}) on {serve.url}: {status} {error}")

    await asyncio.gather(
        *(check(w, rid, depth, serve) for w, rid, depth in acked for serve in replicas.slots)
    )
    assert not lost, (len(lost), lost[:10], report)
    print(report)
