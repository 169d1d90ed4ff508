"""The background state machine (tests/http/test_background_machine.py: creates, polls,
resumes after any event, cancels, waits for the end, against a reference model) on three
proxies sharing one real Valkey, each request of a rule on the next replica in turn: a
response is created on one, polled on another, resumed and cancelled on others, and
every answer must still agree with the model (CONTRACT.md C11). One more rule, `lapse`:
a replica stops as a killed one would (nothing more written, no renewal, its runs cut);
once its lease lapses, each response it ran reads `failed` on the others, and its
stream ends with `response.failed`."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

from ocxproxy.config import Config
from ocxproxy.http.context import PROXY
from ocxproxy.server import Listener, build_app, listen
from ocxproxy.store.shared.background import SharedBackgrounds
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
        self.served = -1  # the replica the last request went to
        self.owner: dict[str, int] = {}  # each response's replica (the create's)
        self.dead: set[int] = set()
        super().__init__()

    @property  # type: ignore[override]
    def url(self) -> str:
        """The next live replica's `/v1/responses`: every request goes to another one."""
        live = [i for i in range(len(self.urls)) if i not in self.dead]
        if not live:
            return ""
        self.turn += 1
        self.served = live[self.turn % len(live)]
        return self.urls[self.served]

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

    jobs = BackgroundMachine.jobs

    @rule(target=jobs, stream=st.booleans(), hangs=st.booleans())
    def create(self, stream: bool, hangs: bool) -> str:
        response_id = super().create(stream, hangs)
        self.owner[response_id] = self.served
        return response_id

    @rule(response_id=jobs)
    def finish(self, response_id: str) -> None:
        expect = self.model[response_id]
        if expect.hangs and expect.status == "running":
            return  # it ends only when cancelled (or when its replica is gone)
        status: str = self.run(self._until_ended(response_id))
        self._observe(expect, status)

    @precondition(lambda self: not self.dead)
    @rule(response_id=jobs)
    def lapse(self, response_id: str) -> None:
        """The replica that ran `response_id` stops as a killed process would; what it ran
        is failed elsewhere."""
        victim = self.owner[response_id]
        mine = [
            i for i, e in self.model.items() if e.status == "running" and self.owner[i] == victim
        ]
        for mine_id in mine:  # (one that may finish is let finish: its turn is stored)
            if not self.model[mine_id].hangs:
                self.finish(mine_id)

        async def lapsed() -> None:
            book = self.listeners[victim].runner.app[PROXY].backgrounds
            assert isinstance(book, SharedBackgrounds)
            await book.abandon()
            self.dead.add(victim)
            for mine_id in mine:
                expect = self.model[mine_id]
                if expect.status == "running":
                    assert await self._until_ended(mine_id) == "failed"
                    expect.status = "failed"

        self.run(lapsed())

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
                max_examples=12,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
