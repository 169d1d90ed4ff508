"""Background responses against a reference model (CONTRACT.md C11): random creates (polled
or streamed, turns that end soon or hang until cancelled), polls, stream resumes after any
event, cancels and waits for the end, on a real proxy in front of the fake backend. Every
answer must agree with the model: the status, and each resumed stream exactly the log's
events after the cursor, in order, ending with the terminal event once the turn ended."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from ocxproxy.config import Config
from ocxproxy.server import Listener, build_app, listen
from tests.fakes.backend import FakeBackend

pytestmark = pytest.mark.timeout(600)
HEADERS = {"Authorization": "Bearer sk-machine", "Content-Type": "application/json"}
HANG = 60.0  # a turn that only a cancel ends
TAIL_WAIT = 0.3  # how long a resume of a running turn reads before it drops


@dataclass
class Expect:
    stream: bool
    hangs: bool
    status: str = "running"  # running, completed, cancelled
    log: list[Any] | None = None  # every event, once seen whole
    seen: list[Any] = field(default_factory=list)  # the longest prefix of the log seen


async def events_of(answer: aiohttp.ClientResponse, within: float | None) -> list[Any]:
    events: list[Any] = []
    buffer = b""

    async def read() -> None:
        nonlocal buffer
        async for chunk in answer.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                raw, buffer = buffer.split(b"\n\n", 1)
                for line in raw.split(b"\n"):
                    if line.startswith(b"data: "):
                        events.append(orjson.loads(line[6:]))

    if within is None:
        await read()
    else:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(read(), within)
    return events


class BackgroundMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.model: dict[str, Expect] = {}
        self.state = Path(tempfile.mkdtemp(prefix="ocxproxy_bg_machine_"))
        self.backend = FakeBackend(delay=0.01)
        self.server: Listener | None = None
        self.http: aiohttp.ClientSession | None = None
        self.url = ""

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @initialize()
    def start(self) -> None:
        async def started() -> None:
            await self.backend.start()
            config = Config(
                upstream=(self.backend.url,),
                port=0,
                state_dir=self.state,
                health_interval=0,
                shutdown_timeout=0.2,
            )
            self.server = await listen(build_app(config), "127.0.0.1", 0)
            self.url = self.server.url + "/v1/responses"
            self.http = aiohttp.ClientSession()

        self.run(started())

    def teardown(self) -> None:
        async def stopped() -> None:
            if self.http is not None:
                await self.http.close()
            if self.server is not None:
                await self.server.close()
            await self.backend.close()

        self.run(stopped())
        self.loop.close()
        shutil.rmtree(self.state, ignore_errors=True)

    jobs = Bundle("jobs")

    @rule(target=jobs, stream=st.booleans(), hangs=st.booleans())
    def create(self, stream: bool, hangs: bool) -> str:
        n = len(self.model) + 1

        async def created() -> str:
            assert self.http is not None
            if hangs:
                self.backend.stall_next(HANG)
            body = {"model": "m", "input": "hello", "background": True, "stream": stream}
            async with self.http.post(self.url, data=orjson.dumps(body), headers=HEADERS) as a:
                assert a.status == 200
                if not stream:
                    response = await a.json()
                else:  # the first event, then the connection is dropped
                    first = await events_of(a, TAIL_WAIT)
                    assert first and first[0]["sequence_number"] == 0
                    assert first[0]["type"] == "response.created"
                    response = first[0]["response"]
            assert response["status"] == "queued" and response["background"] is True
            # Its backend request is out before the next create (a stall is this one's).
            await self.backend.wait_for(lambda: len(self.backend.responses_seen) == n)
            return str(response["id"])

        response_id: str = self.run(created())
        self.model[response_id] = Expect(stream, hangs)
        return response_id

    def _status(self, response_id: str) -> str:
        async def polled() -> str:
            assert self.http is not None
            async with self.http.get(f"{self.url}/{response_id}", headers=HEADERS) as a:
                assert a.status == 200
                return str((await a.json())["status"])

        status: str = self.run(polled())
        return status

    def _observe(self, expect: Expect, status: str) -> None:
        """A status seen: what the model allows, and what it learns from it."""
        if expect.status == "running":
            allowed = {"queued", "in_progress"} | (set() if expect.hangs else {"completed"})
            assert status in allowed, (status, expect)
            if status == "completed":
                expect.status = "completed"
        else:
            assert status == expect.status, (status, expect)

    @rule(response_id=jobs)
    def poll(self, response_id: str) -> None:
        self._observe(self.model[response_id], self._status(response_id))

    @rule(response_id=jobs)
    def finish(self, response_id: str) -> None:
        expect = self.model[response_id]
        if expect.hangs and expect.status == "running":
            return  # it ends only when cancelled

        status: str = self.run(self._until_ended(response_id))
        self._observe(expect, status)
        assert status in ("completed", "cancelled")

    async def _until_ended(self, response_id: str) -> str:
        assert self.http is not None
        async with asyncio.timeout(10):
            while True:
                async with self.http.get(f"{self.url}/{response_id}", headers=HEADERS) as a:
                    status = str((await a.json())["status"])
                if status not in ("queued", "in_progress"):
                    return status
                await asyncio.sleep(0.02)

    @rule(response_id=jobs)
    def cancel(self, response_id: str) -> None:
        expect = self.model[response_id]

        async def cancelled() -> str:
            assert self.http is not None
            async with self.http.post(f"{self.url}/{response_id}/cancel", headers=HEADERS) as a:
                assert a.status == 200
                return str((await a.json())["status"])

        status: str = self.run(cancelled())
        if expect.status == "running":
            assert status in ("cancelled", "completed") and (
                status == "cancelled" or not expect.hangs
            )
            expect.status = status
        else:
            assert status == expect.status

    @rule(response_id=jobs, cursor=st.integers(-1, 14), given=st.booleans())
    def resume(self, response_id: str, cursor: int, given: bool) -> None:
        expect = self.model[response_id]
        query = "stream=true" + (f"&starting_after={cursor}" if given else "")
        after = cursor if given else -1
        ended = expect.status != "running"

        async def resumed() -> tuple[int, list[Any]]:
            assert self.http is not None
            async with self.http.get(f"{self.url}/{response_id}?{query}", headers=HEADERS) as a:
                if a.status != 200:
                    return a.status, []
                return 200, await events_of(a, None if ended else TAIL_WAIT)

        status, events = self.run(resumed())
        if not expect.stream:
            assert status == 400
            return
        assert status == 200
        numbers = [event["sequence_number"] for event in events]
        assert numbers == list(range(after + 1, after + 1 + len(numbers))), numbers
        if after == -1 and events:  # from 0: what was seen before is a prefix of it
            assert events[: len(expect.seen)] == expect.seen[: len(events)]
            if len(events) > len(expect.seen):
                expect.seen = events
        elif expect.seen:
            start = after + 1
            overlap = expect.seen[start : start + len(events)]
            assert events[: len(overlap)] == overlap
        if expect.log is not None:
            assert events == expect.log[after + 1 :]
        if ended and after == -1:
            kinds = [event["type"] for event in events]
            if expect.status == "completed":
                assert kinds[-1] == "response.completed"
            else:  # cancelled: no terminal event, the stream just ends
                assert "response.completed" not in kinds
            expect.log = events


def test_background_responses_match_their_model() -> None:
    run_state_machine_as_test(
        BackgroundMachine,
        settings=settings(
            max_examples=12,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
