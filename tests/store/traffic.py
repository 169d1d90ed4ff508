"""Client traffic for the kill -9 and power-loss tests (test_crash.py,
test_power_loss_ext4.py): clients on one session until the proxy goes away, and the
DELETE they send of an acknowledged turn."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

Client = Callable[[aiohttp.ClientSession], Awaitable[None]]


async def until_the_proxy_goes(clients: list[Client]) -> None:
    """Run every client on one session until the proxy is killed (its connections fail)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        try:
            async with asyncio.TaskGroup() as group:
                for client in clients:
                    group.create_task(client(http))
        except* (aiohttp.ClientError, OSError, asyncio.IncompleteReadError):
            pass  # the proxy was killed


async def delete(http: aiohttp.ClientSession, url: str, rid: str, uncertain: set[str]) -> None:
    """DELETE response `rid`: in `uncertain` until its 200 comes (a kill meanwhile leaves
    it there: deleted or not, nobody was told)."""
    uncertain.add(rid)
    async with http.delete(f"{url}/v1/responses/{rid}") as r:
        assert r.status == 200, await r.text()
        await r.read()
    uncertain.discard(rid)
