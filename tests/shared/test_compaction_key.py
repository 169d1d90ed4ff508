"""Replicas on one shared store seal compaction items with one key (CONTRACT.md C10): an
item made on one replica opens on another, and a replica whose key differs from the one
recorded in the shared store refuses to start (exit code 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from ocxproxy.cli import main
from ocxproxy.store.shared.checks import SharedStoreRefused
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.shared.conftest import require
from tests.shared.servers import KvServer

TRIGGER = {"type": "compaction_trigger"}


async def test_an_item_made_on_one_replica_opens_on_another(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer
) -> None:
    one, two = [
        await make_proxy(backend.url, shared_store=valkey_server.url, state_dir=None)
        for _ in range(2)
    ]
    made = await one.client().responses.create(
        model="m", input=[{"role": "user", "content": "hi"}, TRIGGER]
    )
    item = made.output[0].model_dump()
    answer = await two.client().responses.create(
        model="m", input=[item, {"role": "user", "content": "next"}], store=False
    )
    assert answer.output_text == "echo#2: next"
    client = aioredis.Redis.from_url(valkey_server.url)
    try:
        recorded = await client.get("ocx:compaction-key")
    finally:
        await client.aclose()
    assert recorded == one.proxy.sealer.fingerprint.encode()
    assert b"shared compaction key" not in recorded  # a fingerprint, not the key

    with pytest.raises(SharedStoreRefused, match="compaction-key"):
        await make_proxy(
            backend.url, shared_store=valkey_server.url, state_dir=None, compaction_key="other"
        )


def test_serve_exits_2_when_its_key_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require("valkey")
    with KvServer("valkey", tmp_path / "kv") as server:
        base = ["serve", "--shared-store", server.url, "--upstream", "http://127.0.0.1:9"]
        base += ["--port", "0", "--health-interval", "0"]
        # Two replicas, each with a key of its own generated into its state dir: the
        # first records its fingerprint (and would serve), the second is refused.
        import asyncio

        from ocxproxy.config import Config
        from ocxproxy.server import build_app, listen

        async def first() -> None:
            config = Config(
                shared_store=server.url, upstream=("http://127.0.0.1:9",), port=0,
                state_dir=tmp_path / "a", health_interval=0,
            )  # fmt: skip
            listener = await listen(build_app(config), "127.0.0.1", 0)
            await listener.close()

        asyncio.run(first())
        code = main([*base, "--state-dir", str(tmp_path / "b")])
    assert code == 2
    assert "compaction-key" in capsys.readouterr().err
