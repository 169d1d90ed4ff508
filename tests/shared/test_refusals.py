"""`ocxproxy serve --shared-store` checks the server's own configuration at start and refuses,
with a nonzero exit and a message that names the setting, what would lose acknowledged turns:
an evicting maxmemory-policy (every key has a TTL: silent history loss), appendfsync
everysec under --durability ack, and --zdr (nothing may be stored at all)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.fakes.backend import FakeBackend
from tests.serve import Serve, ServeExited
from tests.shared.conftest import MakeKvServer
from tests.shared.servers import KINDS, Kind
from tests.shared.test_replicas import turn


async def refusal(serve: Serve, processes: list[Serve]) -> ServeExited:
    processes.append(serve)
    with pytest.raises(ServeExited) as refused:
        await serve.start()
    assert refused.value.code not in (0, None), refused.value.output
    return refused.value


@pytest.mark.parametrize("kind", KINDS)
async def test_refuses_an_evicting_maxmemory_policy(
    make_kv_server: MakeKvServer,
    backend: FakeBackend,
    tmp_path: Path,
    processes: list[Serve],
    kind: Kind,
) -> None:
    server = await make_kv_server(kind, maxmemory_policy="allkeys-lru")
    for durability in ("ack", "relaxed"):
        serve = Serve(
            backend.url, tmp_path / durability, "--shared-store", server.url,
            "--durability", durability,
        )  # fmt: skip
        exited = await refusal(serve, processes)
        assert "maxmemory-policy" in exited.output and "allkeys-lru" in exited.output


@pytest.mark.parametrize("kind", KINDS)
async def test_ack_refuses_appendfsync_everysec_relaxed_takes_it(
    make_kv_server: MakeKvServer,
    backend: FakeBackend,
    tmp_path: Path,
    processes: list[Serve],
    http: aiohttp.ClientSession,
    kind: Kind,
) -> None:
    server = await make_kv_server(kind, appendfsync="everysec")
    strict = Serve(
        backend.url, tmp_path / "ack", "--shared-store", server.url, "--durability", "ack"
    )
    exited = await refusal(strict, processes)
    assert "appendfsync" in exited.output and "everysec" in exited.output
    assert not backend.seen  # nothing was served

    relaxed = Serve(
        backend.url, tmp_path / "relaxed", "--shared-store", server.url,
        "--durability", "relaxed",
    )  # fmt: skip
    processes.append(relaxed)
    await relaxed.start()
    _, text = await turn(http, relaxed, "fine")
    assert text == "echo#1: fine"


async def test_ack_refuses_a_server_without_an_aof(
    make_kv_server: MakeKvServer, backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    server = await make_kv_server("valkey", appendonly=False)
    serve = Serve(backend.url, tmp_path, "--shared-store", server.url, "--durability", "ack")
    exited = await refusal(serve, processes)
    assert "appendonly" in exited.output


async def test_zdr_refuses_a_shared_store(
    make_kv_server: MakeKvServer, backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    server = await make_kv_server("valkey")
    exited = await refusal(
        Serve(backend.url, tmp_path, "--zdr", "--shared-store", server.url), processes
    )
    assert "--zdr" in exited.output and "shared" in exited.output
    exited = await refusal(
        Serve(backend.url, tmp_path, "--zdr", env={"OCXPROXY_SHARED_STORE": server.url}),
        processes,
    )
    assert "--zdr" in exited.output
