"""The background state machine (tests/http/test_background_machine.py: creates, polls,
resumes after any event, cancels, waits for the end, against a reference model) on three
proxies sharing one real Valkey, each request of a rule on the next replica in turn: a
response is created on one, polled on another, resumed and cancelled on others, and
every answer must still agree with the model (CONTRACT.md C11)."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, run_state_machine_as_test

from ocxproxy.config import Config
from ocxproxy.server import Listener, build_app, listen
from tests.http.test_background_machine import BackgroundMachine
from tests.serve import SHARED_COMPACTION_KEY
from tests.shared.conftest import require
from tests.shared.servers import KvServer

pytestmark = pytest.mark.timeout(900)
REPLICAS = 3


class SharedBackgroundMachine(BackgroundMachine):
    store_url = ""  # the test's Valkey

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.turn = 0
        self.listeners: list[Listener] = []
        super().__init__()

    @property  # type: ignore[override]
    def url(self) -> str:
        """The next replica's `/v1/responses`: every request goes to another one."""
        if not self.urls:
            return ""
        self.turn += 1
        return self.urls[self.turn % len(self.urls)]

    @url.setter
    def url(self, value: str) -> None:
        pass  # (the base class's one proxy)

    @initialize()
    def start(self) -> None:
        async def started() -> None:
            await self.backend.start()
            prefix = f"m{secrets.token_hex(4)}:"  # each example's own keys
            for _ in range(REPLICAS):
                config = Config(
                    upstream=(self.backend.url,),
                    port=0,
                    state_dir=None,
                    shared_store=self.store_url,
                    shared_prefix=prefix,
                    compaction_key=SHARED_COMPACTION_KEY,
                    health_interval=0,
                    shutdown_timeout=0.2,
                )
                listener = await listen(build_app(config), "127.0.0.1", 0)
                self.listeners.append(listener)
                self.urls.append(listener.url + "/v1/responses")
            self.http = aiohttp.ClientSession()

        self.run(started())

    def teardown(self) -> None:
        async def stopped() -> None:
            if self.http is not None:
                await self.http.close()
            for listener in self.listeners:
                await listener.close()
            await self.backend.close()

        self.run(stopped())
        self.loop.close()
        shutil.rmtree(self.state, ignore_errors=True)  # (the base class's, unused)


def test_background_responses_on_three_replicas_match_their_model(tmp_path: Path) -> None:
    require("valkey")
    with KvServer("valkey", tmp_path / "valkey") as server:
        SharedBackgroundMachine.store_url = server.url
        run_state_machine_as_test(
            SharedBackgroundMachine,
            settings=settings(
                max_examples=8,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
