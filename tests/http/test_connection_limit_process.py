"""A real `ocxproxy serve` under a low file-descriptor limit: the default connection cap
comes from that limit, so every connection past it gets a 503 and a close (never a bare
close because the process ran out of descriptors), and a proxy at its limit stays
responsive without spinning."""

from __future__ import annotations

import asyncio
import contextlib
import resource
from pathlib import Path

import aiohttp

from ocxproxy.config import RESERVED_FDS
from tests.fakes.backend import FakeBackend
from tests.serve import Serve

FDS = 160  # the proxy's RLIMIT_NOFILE in these tests
OPENED = 150  # connections the test opens: more than the proxy has descriptors for


def low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, FDS))


async def first_bytes(reader: asyncio.StreamReader) -> bytes:
    """What the proxy says to a connection that sends nothing: a refusal and EOF, or
    nothing at all (b"idle") while it keeps the connection open for a request."""
    try:
        async with asyncio.timeout(1.0):
            data = await reader.read()
    except TimeoutError:
        return b"idle"
    except ConnectionResetError:
        return b"reset"
    return data.split(b"\r\n", 1)[0] if data else b"closed unanswered"


async def hold_connections(url: str, stack: contextlib.AsyncExitStack) -> dict[bytes, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    readers = []
    for _ in range(OPENED):
        reader, writer = await asyncio.open_connection(host, int(port))
        stack.callback(writer.close)
        readers.append(reader)
    seen: dict[bytes, int] = {}
    for answer in await asyncio.gather(*(first_bytes(r) for r in readers)):
        seen[answer] = seen.get(answer, 0) + 1
    return seen


async def still_serves(proxy: Serve) -> None:
    client = proxy.client()
    try:
        response = await client.responses.create(model="m", input="after")
        assert response.output_text == "echo#1: after"
    finally:
        await client.close()


async def test_the_default_cap_comes_from_the_fd_limit_and_past_it_is_a_503(
    tmp_path: Path, backend: FakeBackend, processes: list[Serve]
) -> None:
    proxy = Serve(backend.url, tmp_path, preexec_fn=low_fd_limit)
    processes.append(proxy)
    await proxy.start()
    cap = (FDS - RESERVED_FDS) // 2
    async with contextlib.AsyncExitStack() as stack:
        seen = await hold_connections(proxy.url, stack)
        assert seen == {b"idle": cap, b"HTTP/1.1 503 Service Unavailable": OPENED - cap}, seen
        before = proxy.cpu_seconds()
        async with aiohttp.ClientSession() as http:
            for _ in range(20):  # at the cap, each new connection is answered at once
                async with asyncio.timeout(2), http.get(proxy.url + "/readyz") as resp:
                    assert resp.status == 503
                    assert (await resp.json())["error"]["code"] == "too_many_connections"
        await asyncio.sleep(1.0)
        assert proxy.cpu_seconds() - before < 0.5  # no loop spinning at the limit
    await asyncio.sleep(0.2)  # the proxy sees the closes
    await still_serves(proxy)


async def test_with_no_cap_running_out_of_fds_neither_spins_nor_stops_the_listener(
    tmp_path: Path, backend: FakeBackend, processes: list[Serve]
) -> None:
    proxy = Serve(backend.url, tmp_path, "--max-connections", "0", preexec_fn=low_fd_limit)
    processes.append(proxy)
    await proxy.start()
    async with contextlib.AsyncExitStack() as stack:
        seen = await hold_connections(proxy.url, stack)
        assert seen.get(b"idle", 0) > (FDS - RESERVED_FDS) // 2, seen
        before = proxy.cpu_seconds()
        await asyncio.sleep(1.5)
        assert proxy.cpu_seconds() - before < 0.5, "the accept loop spins on EMFILE"
    await asyncio.sleep(0.2)
    await still_serves(proxy)
    assert any("exceeds what the file-descriptor limit (160)" in line for line in proxy.output)
