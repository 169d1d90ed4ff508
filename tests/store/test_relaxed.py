"""`--durability relaxed` keeps its loss window, both halves, with real `ocxproxy serve`
processes under continuation traffic and DELETEs: on `kill -9` only what was answered in
the last `--snapshot-delay` (2 s) plus up to two journal writes may be lost (every turn and
DELETE answered before that is still there after a restart); a graceful stop loses
nothing, though the last turns were answered before they were written."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tests.fakes.backend import FakeBackend
from tests.serve import Serve, create

WINDOW = 2.0  # --snapshot-delay (its default): the committer gathers this long per write
WRITES = 2.0  # two journal writes, each an fsync, on a shared disk that stalls (up to ~1.4 s)


@dataclass
class Answered:
    """What the clients were told, each with the (client's) time its answer came."""

    turns: list[tuple[float, str]] = field(default_factory=list)
    deleted: list[tuple[float, str]] = field(default_factory=list)
    sent_deletes: set[str] = field(default_factory=set)


async def traffic(url: str, seconds: float, answered: Answered) -> None:
    """Four chains of turns (JSON and SSE) and a DELETE of an older turn every 0.2 s."""
    until = time.monotonic() + seconds
    heads: dict[int, str] = {}

    async def chain(http: aiohttp.ClientSession, c: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            body: dict[str, object] = {"model": "m", "input": f"c{c} t{n}", "stream": n % 2 == 0}
            if c in heads:
                body["previous_response_id"] = heads[c]
            status, error, rid = await create(http, url, body)
            assert rid is not None, (status, error)
            answered.turns.append((time.monotonic(), rid))
            heads[c] = rid
            await asyncio.sleep(0.02)

    async def deleter(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(0.2)
            live = set(heads.values()) | answered.sent_deletes
            old = [rid for _, rid in answered.turns[:-8] if rid not in live]
            if not old:
                continue
            answered.sent_deletes.add(old[0])
            async with http.delete(f"{url}/v1/responses/{old[0]}") as r:
                assert r.status == 200, await r.text()
            answered.deleted.append((time.monotonic(), old[0]))

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(chain(http, c) for c in range(4)), deleter(http))


async def found(url: str, ids: list[str]) -> dict[str, int]:
    """GET each id: its status."""
    statuses: dict[str, int] = {}
    async with aiohttp.ClientSession() as http:
        for rid in ids:
            async with http.get(f"{url}/v1/responses/{rid}") as r:
                statuses[rid] = r.status
    return statuses


def relaxed(backend: FakeBackend, state: Path) -> Serve:
    return Serve(backend.url, state, "--durability", "relaxed", "--log-level", "warning")


async def test_relaxed_kill_9_loses_nothing_answered_before_its_window(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    proxy = relaxed(backend, state)
    processes.append(proxy)
    await proxy.start()
    answered = Answered()
    await traffic(proxy.url, 7.0, answered)
    killed_at = time.monotonic()
    await proxy.kill9()
    proxy = relaxed(backend, state)
    processes.append(proxy)
    await proxy.start()

    before = killed_at - WINDOW - WRITES
    deleted = {rid for at, rid in answered.deleted if at < before}
    maybe_deleted = answered.sent_deletes - deleted  # answered within the window, or not
    kept = [rid for at, rid in answered.turns if at < before and rid not in answered.sent_deletes]
    assert len(kept) >= 20 and deleted, "too little was answered before the window to tell"
    statuses = await found(proxy.url, kept + sorted(deleted))
    lost = [rid for rid in kept if statuses[rid] != 200]
    assert not lost, f"{len(lost)} of {len(kept)} turns answered before the window lost"
    back = [rid for rid in deleted if statuses[rid] != 404]
    assert not back, f"DELETEs answered before the window undone: {back}"
    assert maybe_deleted.isdisjoint(kept)
    assert await proxy.stop() == 0


async def test_relaxed_graceful_stop_loses_nothing(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    proxy = relaxed(backend, state)
    processes.append(proxy)
    await proxy.start()
    answered = Answered()
    await traffic(proxy.url, 3.0, answered)
    assert await proxy.stop() == 0  # at once: the last turns are not written yet
    proxy = relaxed(backend, state)
    processes.append(proxy)
    await proxy.start()

    deleted = {rid for _, rid in answered.deleted}
    kept = [rid for _, rid in answered.turns if rid not in answered.sent_deletes]
    assert kept and deleted
    statuses = await found(proxy.url, kept + sorted(deleted))
    assert [rid for rid in kept if statuses[rid] != 200] == []
    assert [rid for rid in deleted if statuses[rid] != 404] == []
    assert await proxy.stop() == 0
