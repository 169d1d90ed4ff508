"""An answer cut at the request's `max_output_tokens` is `incomplete`, as OpenAI reports it,
though the backend says `completed` (llama.cpp's Responses API does): in the JSON body, as
the stream's terminal event, over WebSocket, in GET and a background run's, and it is
remembered (CONTRACT.md C1.10). Real loopback servers; the client is the official SDK."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.fakes.chat_backend import ChatBackend
from tests.http.test_background import until_ended
from tests.http.test_websocket import connect, create

LONG = "the quick brown fox jumps over the lazy dog " * 4  # echoed: ~45 tokens


async def _create(client: Any, stream: bool, **body: Any) -> tuple[Any, list[str]]:
    """The final Response, and the stream's event types (none for a JSON answer)."""
    if not stream:
        return await client.responses.create(model="m", **body), []
    events = [e async for e in await client.responses.create(model="m", stream=True, **body)]
    return events[-1].response, [e.type for e in events]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("style", ["spec", "llama"])
async def test_an_answer_cut_at_max_output_tokens_is_incomplete(
    make_proxy: MakeProxy, style: Any, stream: bool
) -> None:
    async with FakeBackend(stream_style=style, cuts_at_limit=True) as backend:
        client: Any = (await make_proxy(backend.url)).client()
        cut, kinds = await _create(client, stream, input=LONG, max_output_tokens=16)
        assert backend.responses_seen[-1].json["max_output_tokens"] == 16  # sent as asked
        assert cut.usage.output_tokens == 16
        assert cut.status == "incomplete"
        assert cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens"
        assert cut.completed_at is None
        assert cut.output[0].status == "incomplete"
        if stream:
            assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
        again = await client.responses.retrieve(cut.id)
        assert again.status == "incomplete" and again.output_text == cut.output_text
        # Remembered (CONTRACT.md C1.6): the next turn's history holds the cut answer.
        follow = await client.responses.create(
            model="m", input="go on", previous_response_id=cut.id
        )
        assert follow.status == "completed"
        history = backend.responses_seen[-1].json["input"]
        assert cut.output_text in str(history)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("limit", [None, 1000])
async def test_an_answer_within_the_limit_stays_completed(
    make_proxy: MakeProxy, stream: bool, limit: int | None
) -> None:
    async with FakeBackend(stream_style="llama", cuts_at_limit=True) as backend:
        client: Any = (await make_proxy(backend.url)).client()
        body: dict[str, Any] = {"input": LONG}
        if limit is not None:
            body["max_output_tokens"] = limit
        done, kinds = await _create(client, stream, **body)
        assert done.usage.output_tokens < 1000
        assert done.status == "completed" and done.incomplete_details is None
        assert done.completed_at is not None
        assert done.output[0].status == "completed"
        assert LONG.strip() in done.output_text
        if stream:
            assert kinds[-1] == "response.completed"


@pytest.mark.parametrize("style", ["spec", "llama"])
async def test_a_websocket_turn_cut_at_the_limit_ends_incomplete(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, style: Any
) -> None:
    async with FakeBackend(stream_style=style, cuts_at_limit=True) as backend:
        handle = await make_proxy(backend.url)
        async with await connect(http, handle) as ws:
            events = await create(ws, model="m", input=LONG, max_output_tokens=16)
            assert events[-1]["type"] == "response.incomplete"
            response = events[-1]["response"]
            assert response["incomplete_details"] == {"reason": "max_output_tokens"}
            events = await create(ws, model="m", input="go on", previous_response_id=response["id"])
            assert events[-1]["type"] == "response.completed"


async def test_a_background_run_cut_at_the_limit_ends_incomplete(make_proxy: MakeProxy) -> None:
    async with FakeBackend(stream_style="llama", cuts_at_limit=True) as backend:
        client: Any = (await make_proxy(backend.url)).client()
        created = await client.responses.create(
            model="m", input=LONG, max_output_tokens=16, background=True
        )
        done = await until_ended(client, created.id)
        assert done.status == "incomplete"
        assert done.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_chat_backends_finish_reason_is_taken_at_its_word(
    make_proxy: MakeProxy, stream: bool
) -> None:
    # Its usage says the answer took more than the limit; its finish_reason says `stop`.
    async with ChatBackend() as backend:
        client: Any = (await make_proxy(backend.url, upstream_dialect=("chat",))).client()
        done, _ = await _create(client, stream, input=LONG, max_output_tokens=16)
        assert done.usage.output_tokens > 16
        assert done.status == "completed" and done.incomplete_details is None
