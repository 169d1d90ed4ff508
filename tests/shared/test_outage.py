"""The shared store goes away under three running replicas (kill -9 of the real server) and
comes back on the same data dir: requests that need stored state fail closed (503,
Retry-After, `storage_unavailable`) before the backend is called, requests that need none
keep flowing, /readyz and the metrics say so, and every replica recovers by itself."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from typing import Any

import aiohttp
import pytest

from ocxproxy.aio import spawn
from ocxproxy.store.shared.server import PING_TIMEOUT, PROBE_EVERY
from tests.fakes.backend import FakeBackend
from tests.serve import Serve, respond
from tests.shared.conftest import MakeReplicas
from tests.shared.servers import KvServer
from tests.shared.test_replicas import auth, turn


async def ready(http: aiohttp.ClientSession, serve: Serve) -> tuple[int, dict[str, Any]]:
    async with http.get(serve.url + "/readyz") as r:
        return r.status, await r.json()


async def metric(http: aiohttp.ClientSession, serve: Serve, name: str) -> float | None:
    async with http.get(serve.url + "/metrics") as r:
        text = await r.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


async def until(check: Any, within: float, what: str) -> None:
    """Poll `check` every 0.1 s until it holds; fail with `what` after `within` seconds."""
    for _ in range(int(within * 10)):
        if await check():
            return
        await asyncio.sleep(0.1)
    assert await check(), what


async def test_store_down_fails_closed_then_recovers_without_restart(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    replicas = await make_replicas(valkey_server.url)
    pids = [s.pid for s in replicas.slots]
    head, _ = await turn(http, replicas[0], "before the outage")
    async with http.get(f"{replicas[0].url}/v1/responses/{head}", headers=auth()) as r:
        item_id = (await r.json())["output"][0]["id"]
    for serve in replicas.slots:
        assert (await ready(http, serve))[0] == 200
        assert await metric(http, serve, "ocxproxy_shared_store_available") == 1

    valkey_server.kill9()
    calls = len(backend.responses_seen)
    for serve in replicas.slots:
        for stream in (False, True):
            body = {"model": "m", "input": "x", "previous_response_id": head, "stream": stream}
            async with http.post(serve.url + "/v1/responses", json=body, headers=auth()) as r:
                assert r.status == 503, await r.text()
                assert r.headers.get("Retry-After", "").isdigit()
                error = (await r.json())["error"]
            assert error["code"] == "storage_unavailable", error
        async with http.get(f"{serve.url}/v1/responses/{head}", headers=auth()) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "storage_unavailable"
        body = {"model": "m", "input": [{"type": "item_reference", "id": item_id}]}
        async with http.post(serve.url + "/v1/responses", json=body, headers=auth()) as r:
            assert r.status == 503, await r.text()  # an item reference needs the store too
            assert (await r.json())["error"]["code"] == "storage_unavailable"
    assert len(backend.responses_seen) == calls  # refused before the backend was called

    # A turn that needs no stored state (full history, store:false) keeps flowing.
    history = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    for serve in replicas.slots:
        body = {"model": "m", "input": history, "store": False}
        status, error, response = await respond(http, serve.url, body, auth())
        assert status == 200 and error is None and response is not None, error
    assert len(backend.responses_seen) == calls + 3
    # A turn that would have to be stored is never acknowledged while the store is down.
    status, error, response = await respond(
        http, replicas[1].url, {"model": "m", "input": "to keep"}, auth()
    )
    assert status >= 500 and response is None and error, (status, error)

    for serve in replicas.slots:

        async def unready(serve: Serve = serve) -> bool:
            status, doc = await ready(http, serve)
            return status == 503 and doc["store"] == "unavailable"

        await until(unready, 10, "readyz says the store is down")
        assert await metric(http, serve, "ocxproxy_shared_store_available") == 0

    await valkey_server.astart()  # same data dir, same port
    for serve in replicas.slots:

        async def back(serve: Serve = serve) -> bool:
            return (await ready(http, serve))[0] == 200

        await until(back, 20, "readyz recovers by itself")
    for i, serve in enumerate(replicas.slots):
        _, text = await turn(http, serve, f"after {i}", head)
        assert text == f"echo#3: after {i}"  # the acknowledged turn survived the kill -9
        assert await metric(http, serve, "ocxproxy_shared_store_available") == 1
    assert [s.pid for s in replicas.slots] == pids  # no replica was restarted


@pytest.mark.parametrize("how", ["killed", "stopped"])
async def test_an_idle_replica_notices_within_the_probe_interval(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    http: aiohttp.ClientSession,
    how: str,
) -> None:
    """No turn runs: the probe alone finds the server gone (killed: refused connections;
    stopped with SIGSTOP: PINGs left unanswered) within PROBE_EVERY + PING_TIMEOUT."""
    replicas = await make_replicas(valkey_server.url, 1)
    serve = replicas[0]
    await turn(http, serve, "before the outage")
    assert (await ready(http, serve))[0] == 200
    if how == "killed":
        valkey_server.kill9()
    else:
        os.kill(valkey_server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()

        async def unready() -> bool:
            status, doc = await ready(http, serve)
            return status == 503 and doc["store"] == "unavailable"

        await until(unready, PROBE_EVERY + PING_TIMEOUT + 2.0, "an idle replica stays ready")
        assert time.monotonic() - started <= PROBE_EVERY + PING_TIMEOUT + 2.0
        assert await metric(http, serve, "ocxproxy_shared_store_available") == 0
    finally:
        if how == "stopped":
            os.kill(valkey_server.pid, signal.SIGCONT)
    if how == "killed":
        await valkey_server.astart()

    async def back() -> bool:
        return (await ready(http, serve))[0] == 200

    await until(back, 20, "readyz recovers by itself")
    assert await metric(http, serve, "ocxproxy_shared_store_available") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_failed_commit_is_never_a_success(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    stream: bool,
) -> None:
    """The store dies while the backend answers: the begin succeeded, the commit cannot.
    The client gets a 5xx or an SSE `error` event, never the response."""
    replicas = await make_replicas(valkey_server.url, 1)
    head, _ = await turn(http, replicas[0], "one")
    backend.stall_next(1.0)
    body = {"model": "m", "input": "two", "previous_response_id": head, "stream": stream}
    pending = spawn(respond(http, replicas[0].url, body, auth()), name="doomed-turn")
    await backend.wait_for(lambda: len(backend.responses_seen) == 2)
    valkey_server.kill9()
    status, error, response = await pending
    assert response is None and error, (status, error)
    if stream:
        assert status == 200 and error.get("type") == "error", error
    else:
        assert status >= 500, (status, error)
    await valkey_server.astart()
    for serve in replicas.slots:  # the parent still continues; the failed turn is not a head

        async def back(serve: Serve = serve) -> bool:
            return (await ready(http, serve))[0] == 200

        await until(back, 20, "readyz recovers by itself")
    _, text = await turn(http, replicas[0], "again", head)
    assert text == "echo#3: again"


async def test_once_ready_again_no_request_fails_on_a_connection_from_before(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    http: aiohttp.ClientSession,
) -> None:
    """Each replica holds several connections to the store (concurrent turns); the store is
    killed and restarted. Once /readyz says ready, a burst of concurrent turns all succeed:
    no connection from before the restart is handed to a request."""
    replicas = await make_replicas(valkey_server.url)
    head, _ = await turn(http, replicas[0], "root")

    async def burst(tag: str) -> list[str]:
        async def one(serve: Serve, k: int) -> str:
            body = {
                "model": "m",
                "input": [{"role": "user", "content": f"{tag} {k}"}],
                "previous_response_id": head,
            }
            status, error, response = await respond(http, serve.url, body, auth())
            return "ok" if response is not None else f"{status} {error}"

        return await asyncio.gather(*(one(serve, k) for serve in replicas.slots for k in range(8)))

    assert await burst("before") == ["ok"] * 24
    valkey_server.kill9()
    await asyncio.sleep(0.5)
    await valkey_server.astart()
    for serve in replicas.slots:

        async def back(serve: Serve = serve) -> bool:
            return (await ready(http, serve))[0] == 200

        await until(back, 20, "readyz recovers by itself")
    after = await burst("after")
    logged = [line for serve in replicas.slots for line in serve.output if "shared" in line]
    assert after == ["ok"] * 24, (after, logged[-10:])
