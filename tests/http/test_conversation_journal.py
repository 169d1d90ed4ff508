"""A conversation's journal through a real `python -m ocxproxy serve` process: a turn
journals the same bytes whatever the conversation's length (its new items and their
ids, not its whole history's ids again), and a long conversation killed with -9 at random
moments continues with every acknowledged turn, forwarding the same bytes as before."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from ocxproxy.store import codec
from tests.fakes.backend import FakeBackend
from tests.serve import Serve, create


def journal_bytes(state: Path) -> int:
    """The bytes of every good entry in the journal's files (past them: preallocated
    zeros), read from outside the process."""
    total = 0
    for path in sorted((state / "journal").glob("*.log")):
        data = path.read_bytes()
        ends = [offset + codec.FRAME.size + len(p) for _, p, offset in codec.entries(data)]
        total += ends[-1] if ends else 0
    return total


async def test_a_conversation_turn_journals_as_much_at_turn_200_as_at_turn_20(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    proc = Serve(backend.url, state)
    processes.append(proc)
    await proc.start()
    headers = {"Authorization": "Bearer sk-x"}
    growth: dict[int, int] = {}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(proc.url + "/v1/conversations", json={}) as r:
            conversation = (await r.json())["id"]
        for turn in range(1, 201):
            before = journal_bytes(state) if turn in (20, 200) else 0
            body = {"model": "m", "input": "go on", "conversation": conversation}
            status, error, _ = await create(http, proc.url, body)
            assert status == 200, error
            if turn in (20, 200):
                growth[turn] = journal_bytes(state) - before
    # The same entries (this turn's items, its response, one row each): a few bytes more
    # for longer counts in the response, never the history's item ids again.
    assert 0 < growth[200] <= growth[20] + 64, growth
    assert await proc.stop() == 0
