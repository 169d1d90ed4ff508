"""Background responses through a real `python -m ocxproxy serve` process (CONTRACT.md
C11): killed with -9 mid-turn, a response is `failed` (`background_lost`) once the
proxy is back, never `in_progress` forever; finished ones keep their status; a graceful
stop lets a running one finish within the shutdown timeout, or fails it past it."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import openai
import pytest

from tests.fakes.backend import FakeBackend
from tests.http.test_background import until_ended
from tests.serve import Serve


async def test_a_response_running_at_kill_9_is_failed_after_restart(
    tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    async with FakeBackend() as backend:
        first = Serve(backend.url, state)
        processes.append(first)
        await first.start()
        client = first.client()
        done = await client.responses.create(model="m", input="quick", background=True)
        assert (await until_ended(client, done.id)).status == "completed"
        backend.stall_next(60)
        backend.stall_next(60)
        cancelled = await client.responses.create(model="m", input="cut", background=True)
        await backend.wait_for(lambda: len(backend.responses_seen) == 2, within=10)
        await client.responses.cancel(cancelled.id)
        running = await client.responses.create(
            model="m", input="slow", previous_response_id=done.id, background=True
        )
        await backend.wait_for(lambda: len(backend.responses_seen) == 3, within=10)
        await client.close()
        assert await first.stop(signal.SIGKILL) == -signal.SIGKILL

        second = Serve(backend.url, state)
        processes.append(second)
        await second.start()
        client = second.client()
        lost = await client.responses.retrieve(running.id)
        assert lost.status == "failed" and lost.background is True
        assert lost.error is not None and lost.error.code == "server_error"
        assert lost.error.message.startswith("background_lost")
        assert (await client.responses.retrieve(cancelled.id)).status == "cancelled"
        assert (await client.responses.cancel(running.id)).status == "failed"  # as it is
        # Journaled: their own items, and the response the running one continued (its
        # chain read back from the store).
        expected = {running.id: ["quick", "echo#1: quick", "slow"], cancelled.id: ["cut"]}
        for response_id, texts in expected.items():
            items = await client.responses.input_items.list(response_id, order="asc")
            assert [item.content[0].text for item in items.data] == texts  # type: ignore[union-attr]
        assert (await client.responses.retrieve(done.id)).output_text == "echo#1: quick"
        await client.close()
        assert await second.stop(signal.SIGTERM) == 0


async def stopped_while_running(
    backend: FakeBackend, state: Path, processes: list[Serve], shutdown_timeout: str, text: str
) -> tuple[Serve, str]:
    """A proxy stopped gracefully (SIGTERM, `--shutdown-timeout`) while a background
    response runs, and a proxy started again on its state dir: that one, and the id."""
    first = Serve(backend.url, state, "--shutdown-timeout", shutdown_timeout)
    processes.append(first)
    await first.start()
    client = first.client()
    created = await client.responses.create(model="m", input=text, background=True)
    await backend.wait_for(lambda: len(backend.responses_seen) == 1, within=10)
    await client.close()
    assert await first.stop(signal.SIGTERM) == 0
    second = Serve(backend.url, state)
    processes.append(second)
    await second.start()
    return second, created.id


async def test_a_graceful_stop_lets_a_running_one_finish(
    tmp_path: Path, processes: list[Serve]
) -> None:
    async with FakeBackend(delay=0.1) as backend:
        proxy, response_id = await stopped_while_running(
            backend, tmp_path / "state", processes, "10", "finish me"
        )
        client = proxy.client()
        finished = await until_ended(client, response_id)
        assert finished.status == "completed"
        assert finished.output_text == "echo#1: finish me"
        await client.close()
        assert await proxy.stop(signal.SIGTERM) == 0


async def test_past_the_shutdown_timeout_a_running_one_is_failed(
    tmp_path: Path, processes: list[Serve]
) -> None:
    async with FakeBackend(delay=2.0) as backend:
        proxy, response_id = await stopped_while_running(
            backend, tmp_path / "state", processes, "0.5", "too slow"
        )
        client = proxy.client()
        failed = await client.responses.retrieve(response_id)
        assert failed.status == "failed"
        assert failed.error is not None and failed.error.code == "server_shutting_down"
        await client.close()
        assert await proxy.stop(signal.SIGTERM) == 0


async def test_a_finished_stream_is_resumed_after_a_restart(
    tmp_path: Path, processes: list[Serve]
) -> None:
    """An ended stream's events are kept in the state dir: after a graceful restart, and
    after kill -9 once its log is written (just after its end), it replays from 0, from
    any sequence number, and through the SDK's helper, as before."""
    state = tmp_path / "state"
    async with FakeBackend(delay=0.05) as backend:
        for stop in (signal.SIGTERM, signal.SIGKILL):
            first = Serve(backend.url, state)
            processes.append(first)
            await first.start()
            client = first.client()
            stream = await client.responses.create(
                model="m", input=f"keep {stop.name}", background=True, stream=True
            )
            events = [event async for event in stream]
            assert events[-1].type == "response.completed"
            response_id = events[0].response.id
            backend.stall_next(60)
            cut = await client.responses.create(
                model="m", input="cut", background=True, stream=True
            )
            async for event in cut:  # (response.created)
                cut_id = event.response.id
                break
            await cut.close()
            assert (await client.responses.cancel(cut_id)).status == "cancelled"
            if stop == signal.SIGKILL:  # its log is written (not synced) just after the end
                written = state / "background" / f"{cut_id}.log"
                for _ in range(500):
                    if written.exists():
                        break
                    await asyncio.sleep(0.02)
                assert written.exists()
            await client.close()
            await first.stop(stop)

            second = Serve(backend.url, state)
            processes.append(second)
            await second.start()
            client = second.client()
            replay = [e async for e in await client.responses.retrieve(response_id, stream=True)]
            assert [e.model_dump() for e in replay] == [e.model_dump() for e in events]
            tail = await client.responses.retrieve(response_id, stream=True, starting_after=5)
            assert [e.sequence_number async for e in tail] == list(range(6, len(events)))
            async with client.responses.stream(response_id=response_id) as helper:
                assert (await helper.get_final_response()).output_text.endswith(stop.name)
            ended = [e async for e in await client.responses.retrieve(cut_id, stream=True)]
            assert ended[-1].type == "response.cancelled"
            assert [e.sequence_number for e in ended] == list(range(len(ended)))
            assert (await client.responses.retrieve(cut_id)).status == "cancelled"
            # Deleted, it is gone, events and all, and stays gone.
            await client.responses.delete(response_id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(response_id, stream=True)
            await client.close()
            assert await second.stop(signal.SIGTERM) == 0
            assert not (state / "background" / f"{response_id}.log").exists()


async def test_a_stream_killed_mid_turn_is_resumed_to_its_failure_after_restart(
    tmp_path: Path, processes: list[Serve]
) -> None:
    """kill -9 while a background stream runs: after the restart its events, as far as
    they reached the disk (written every half second as it runs), replay from 0 and
    from any number, then its `response.failed` (`background_lost`), numbered next."""
    state = tmp_path / "state"
    async with FakeBackend(delay=0.4) as backend:  # ~11 events, 0.4 s apart
        first = Serve(backend.url, state)
        processes.append(first)
        await first.start()
        client = first.client()
        stream = await client.responses.create(
            model="m", input="a long one", background=True, stream=True
        )
        seen = []
        async for event in stream:
            seen.append(event)
            if event.sequence_number == 4:
                break
        await stream.close()
        response_id = seen[0].response.id
        await asyncio.sleep(1.2)  # (past the next write of its events, before its end)
        await client.close()
        await first.kill9()

        second = Serve(backend.url, state)
        processes.append(second)
        await second.start()
        client = second.client()
        replay = [e async for e in await client.responses.retrieve(response_id, stream=True)]
        numbers = [event.sequence_number for event in replay]
        assert numbers == list(range(len(replay)))
        assert len(replay) > 6  # what it saw, and at least the next one, then the end
        assert [e.model_dump() for e in replay[:5]] == [e.model_dump() for e in seen]
        end = replay[-1]
        assert end.type == "response.failed" and end.response.id == response_id
        assert end.response.error is not None and end.response.error.code == "server_error"
        assert end.response.error.message.startswith("background_lost")
        assert all(event.type != "response.completed" for event in replay)
        tail = await client.responses.retrieve(response_id, stream=True, starting_after=4)
        assert [e async for e in tail] == replay[5:]
        polled = await client.responses.retrieve(response_id)
        assert polled.status == "failed" and polled.error == end.response.error
        await client.close()
        assert await second.stop(signal.SIGTERM) == 0
        assert (state / "background" / f"{response_id}.log").exists()
        assert not (state / "background" / f"{response_id}.part").exists()
