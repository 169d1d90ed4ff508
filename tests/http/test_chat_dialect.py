"""A Chat-Completions-only backend behind the proxy (CONTRACT.md C6): Responses in
and out for the client, chat completions to the backend, with tools, tool calls, streaming
and continuations. Real loopback servers throughout; the client is the official SDK."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.fakes.chat_backend import ChatBackend
from tests.http.helpers import sse_payloads

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture
async def chat_backend() -> AsyncIterator[ChatBackend]:
    async with ChatBackend() as backend:
        yield backend


@pytest.fixture
async def chat_proxy(make_proxy: MakeProxy, chat_backend: ChatBackend) -> ProxyHandle:
    return await make_proxy(chat_backend.url, upstream_dialect=("chat",))


def dedup(kinds: Sequence[str]) -> list[str]:
    return [k for k, _ in itertools.groupby(kinds)]


async def post(handle: ProxyHandle, body: dict[str, Any]) -> tuple[int, bytes, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(handle.base_url + "/responses", json=body) as resp,
    ):
        return resp.status, await resp.read(), resp.headers.get("Content-Type", "")


# -- one turn ------------------------------------------------------------------------------


async def test_text_turn(chat_proxy: ProxyHandle, chat_backend: ChatBackend) -> None:
    client: Any = chat_proxy.client()
    response = await client.responses.create(
        model="m", input="hello", instructions="Be brief.", max_output_tokens=64, temperature=0.2
    )
    assert response.status == "completed"
    assert response.output_text == "echo#2: hello"
    assert response.id.startswith("resp_")
    assert response.output[0].id.startswith("msg_")
    assert response.instructions == "Be brief." and response.max_output_tokens == 64
    assert response.usage is not None and response.usage.input_tokens > 0
    assert response.usage.output_tokens > 0
    [chat] = chat_backend.chats
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
        ],
        "temperature": 0.2,
        "max_tokens": 64,
        "stream": False,
    }
    assert [s.path for s in chat_backend.posts] == ["/v1/chat/completions"]
    stored = await client.responses.retrieve(response.id)
    assert stored.output_text == response.output_text and stored.id == response.id


async def test_tool_call_turn_and_its_output_continuation(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    client: Any = chat_proxy.client()
    first = await client.responses.create(
        model="m",
        input="CALL:get_weather please",
        tools=[WEATHER],
        tool_choice="auto",
    )
    [call] = first.output
    assert call.type == "function_call"
    assert call.id is not None and call.id.startswith("fc_")
    assert call.name == "get_weather" and orjson.loads(call.arguments) == {"n": 1}
    assert call.status == "completed"
    assert chat_backend.chats[0]["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["parameters"],
                "strict": False,
            },
        }
    ]
    assert chat_backend.chats[0]["tool_choice"] == "auto"

    second = await client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
    )
    assert second.output_text == "tool said sunny"
    assert chat_backend.chats[1]["messages"] == [
        {"role": "user", "content": "CALL:get_weather please"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]


async def test_parallel_calls_after_text_make_one_assistant_message(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    client: Any = chat_proxy.client()
    first = await client.responses.create(
        model="m",
        input="PREAMBLE CALL:a CALL:b",
        tools=[{**WEATHER, "name": "a"}, {**WEATHER, "name": "b"}],
    )
    assert [item.type for item in first.output] == ["message", "function_call", "function_call"]
    outputs = [
        {"type": "function_call_output", "call_id": item.call_id, "output": item.name}
        for item in first.output[1:]
    ]
    await client.responses.create(model="m", previous_response_id=first.id, input=outputs)
    messages = chat_backend.chats[1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Let me check."
    assert [c["function"]["name"] for c in messages[1]["tool_calls"]] == ["a", "b"]


# -- streaming -----------------------------------------------------------------------------


async def test_sdk_stream_helper_gets_the_full_event_sequence(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    client: Any = chat_proxy.client()
    async with client.responses.stream(model="m", input="hello there") as stream:
        kinds, numbers, text = [], [], ""
        async for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = await stream.get_final_response()
    assert dedup(kinds) == TEXT_EVENTS
    assert numbers == list(range(len(numbers)))
    assert final.output_text == text == "echo#1: hello there"
    assert final.usage is not None and final.usage.input_tokens > 0
    chat = chat_backend.chats[0]
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    # recorded before response.completed reached us: the continuation resolves at once
    again = await client.responses.create(model="m", input="more", previous_response_id=final.id)
    assert again.output_text == "echo#3: more"


async def test_streamed_tool_call_has_contiguous_sequence_numbers(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    client: Any = chat_proxy.client()
    stream = await client.responses.create(
        model="m",
        input="THINK CALL:get_weather",
        tools=[WEATHER],
        stream=True,
    )
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert dedup([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",  # function_call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    reasoning, call = final.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    assert call.arguments == '{"n":1}'
    follow = await client.responses.create(
        model="m",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}],
    )
    assert follow.output_text == "tool said ok"
    # the reasoning item is remembered but not sent: chat has no place for it
    assert [m["role"] for m in chat_backend.chats[1]["messages"]] == ["user", "assistant", "tool"]
    items = await client.responses.input_items.list(follow.id, order="asc")
    assert [item.type for item in items.data][:3] == ["message", "reasoning", "function_call"]


async def test_backend_ignoring_stream_still_gives_a_stream(make_proxy: MakeProxy) -> None:
    async with ChatBackend(ignore_stream=True) as backend:
        handle = await make_proxy(backend.url, upstream_dialect=("chat",))
        status, body, content_type = await post(
            handle, {"model": "m", "input": "x", "stream": True}
        )
    assert status == 200 and content_type.startswith("text/event-stream")
    payloads = sse_payloads(body)
    assert dedup([p["type"] for p in payloads]) == TEXT_EVENTS
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))


# -- incomplete, errors --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_length_is_incomplete_and_still_continuable(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend, stream: bool
) -> None:
    client: Any = chat_proxy.client()
    chat_backend.finish_next("length")
    if stream:
        events = [
            e async for e in await client.responses.create(model="m", input="a b c d", stream=True)
        ]
        assert events[-1].type == "response.incomplete"
        first = events[-1].response
    else:
        first = await client.responses.create(model="m", input="a b c d", max_output_tokens=16)
    assert first.status == "incomplete"
    assert first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text == "echo#1: a"
    assert first.output[0].status == "incomplete"
    second = await client.responses.create(model="m", input="go on", previous_response_id=first.id)
    assert second.status == "completed"
    assert chat_backend.chats[1]["messages"][1] == {"role": "assistant", "content": "echo#1: a"}


LLAMA_TOO_LONG = {
    "error": {
        "code": 400,
        "message": "request (12631 tokens) exceeds the available context size (8192 tokens)",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 12631,
    }
}


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_errors_keep_status_in_openai_shape(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend, stream: bool
) -> None:
    chat_backend.fail_next(400, LLAMA_TOO_LONG)
    status, body, content_type = await post(
        chat_proxy, {"model": "m", "input": "x", "stream": stream}
    )
    assert status == 400 and content_type.startswith("application/json")
    assert orjson.loads(body) == {  # a context overflow is OpenAI's (CONTRACT.md C10)
        "error": {
            "message": LLAMA_TOO_LONG["error"]["message"],
            "type": "invalid_request_error",
            "param": "input",
            "code": "context_length_exceeded",
        }
    }
    chat_backend.fail_next(422, {"error": "Input validation error", "error_type": "validation"})
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await chat_proxy.client().responses.create(model="m", input="x")
    assert info.value.message.endswith("Input validation error")
    chat_backend.fail_next(503, b"<html>overloaded</html>")
    with pytest.raises(openai.InternalServerError) as server:
        await chat_proxy.client().responses.create(model="m", input="x")
    assert server.value.status_code == 503
    error = server.value.body
    assert isinstance(error, dict) and error["type"] == "server_error"
    assert error["message"] == "<html>overloaded</html>"


async def test_failed_turn_is_not_remembered(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    client: Any = chat_proxy.client()
    chat_backend.break_next(error_chunk=True)
    events = [
        e
        async for e in await client.responses.create(model="m", input="one two three", stream=True)
    ]
    assert events[-1].type == "response.failed"
    assert events[-1].response.error is not None
    assert events[-1].response.error.message == "slot crashed"
    chat_backend.break_next(error_chunk=False)
    events = [
        e
        async for e in await client.responses.create(model="m", input="one two three", stream=True)
    ]
    assert events[-1].type == "response.failed"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(
            model="m", input="x", previous_response_id=events[-1].response.id
        )
    assert info.value.code == "previous_response_not_found"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]},
            "tools[1].type",
        ),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),  # unknown id
    ],
)
async def test_unsupported_features_are_400_before_forwarding(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend, extra: dict[str, Any], param: str
) -> None:
    status, body, _ = await post(chat_proxy, {"model": "m", "input": "hi", **extra})
    assert status == 400
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert chat_backend.posts == []


# -- continuations stay byte-stable ----------------------------------------------------------


async def test_background_turn_runs_on_a_chat_backend(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    """background is the proxy's (it runs the turn itself), so a chat backend serves it
    like any turn: the backend never sees the field."""
    client: Any = chat_proxy.client()
    created = await client.responses.create(model="m", input="hello", background=True)
    assert created.background is True and created.status in ("queued", "in_progress")
    for _ in range(200):
        response = await client.responses.retrieve(created.id)
        if response.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.02)
    assert response.status == "completed"
    assert response.output_text.endswith("hello")
    assert all("background" not in chat for chat in chat_backend.chats)


async def test_each_turns_messages_extend_the_previous_turns(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    """Turn N's chat `messages` are a prefix of turn N+1's, as a list and as bytes, through
    text, tool calls and their outputs, reasoning, and a streamed last turn."""
    client: Any = chat_proxy.client()
    first = [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]
    turn = await client.responses.create(model="m", instructions="Sys.", input=first)
    for text in ("CALL:lookup", None, "THINK now", "PREAMBLE CALL:x", None):
        new: Any = text
        if text is None:  # answer the calls of the last turn
            new = [
                {"type": "function_call_output", "call_id": item.call_id, "output": "r"}
                for item in turn.output
                if item.type == "function_call"
            ]
        turn = await client.responses.create(
            model="m", instructions="Sys.", input=new, previous_response_id=turn.id
        )
    async with client.responses.stream(
        model="m", instructions="Sys.", input="bye", previous_response_id=turn.id
    ) as stream:
        last = await stream.get_final_response()
    assert last.output_text.startswith("echo#")
    bodies = [s.body for s in chat_backend.posts]
    assert len(bodies) == 7
    for before, after in itertools.pairwise(bodies):
        old, grown = orjson.loads(before)["messages"], orjson.loads(after)["messages"]
        assert grown[: len(old)] == old
        assert orjson.dumps(grown).startswith(orjson.dumps(old)[:-1] + b",")
    usage = last.usage
    assert usage is not None and usage.input_tokens_details.cached_tokens / usage.input_tokens > 0.8


async def test_history_by_reference_is_resolved_before_translation(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    """The AI SDK's shape (history resent, its answers as item references) reaches a chat
    backend as the same messages as the history in full: prefix-stable, cache hits."""
    client: Any = chat_proxy.client()
    history: list[Any] = []
    for word in ("one", "two", "three"):
        history.append({"role": "user", "content": word})
        turn = await client.responses.create(model="m", input=history)
        assert turn.previous_response_id is None
        history.append({"type": "item_reference", "id": turn.output[0].id})
    chats = chat_backend.chats
    assert [m["role"] for m in chats[-1]["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert chats[-1]["messages"][1]["content"] == "echo#1: one"
    for before, after in itertools.pairwise(s.body for s in chat_backend.posts):
        old = orjson.dumps(orjson.loads(before)["messages"])
        assert orjson.dumps(orjson.loads(after)["messages"]).startswith(old[:-1] + b",")


# -- WebSocket mode works unchanged ----------------------------------------------------------


async def test_websocket_turns_through_a_chat_backend(
    chat_proxy: ProxyHandle, chat_backend: ChatBackend
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(
            chat_proxy.base_url + "/responses", headers={"Authorization": "Bearer sk-ws"}
        ) as ws,
    ):
        finals = []
        previous = None
        for text in ("first", "second"):
            frame = {"type": "response.create", "model": "m", "input": text, "store": False}
            if previous:
                frame["previous_response_id"] = previous
            await ws.send_json(frame)
            events = []
            while True:
                event = orjson.loads((await ws.receive(timeout=5)).data)
                events.append(event)
                if event["type"] in ("response.completed", "error"):
                    break
            assert events[-1]["type"] == "response.completed", events[-1]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            previous = events[-1]["response"]["id"]
            finals.append(events[-1]["response"])
    assert finals[1]["output"][0]["content"][0]["text"] == "echo#3: second"
    assert [m["role"] for m in chat_backend.chats[1]["messages"]] == ["user", "assistant", "user"]


# -- a mixed fleet ---------------------------------------------------------------------------


async def test_mixed_fleet_translates_only_for_the_chat_backend(
    make_proxy: MakeProxy, chat_backend: ChatBackend, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url, chat_backend.url, upstream_dialect=("responses", "chat"))
    assert {b.url: b.dialect for b in handle.proxy.pool.backends} == {
        backend.url: "responses",
        chat_backend.url: "chat",
    }
    client: Any = handle.client()
    for key in range(40):  # new keys spread over both backends
        first = await client.responses.create(model="m", input="hi", prompt_cache_key=f"k{key}")
        again = await client.responses.create(
            model="m", input="more", previous_response_id=first.id
        )
        assert again.output_text.endswith("more")
        if chat_backend.chats and backend.responses_seen:
            break
    assert chat_backend.chats and backend.responses_seen
    assert all(s.path == "/v1/responses" for s in backend.responses_seen)
    assert all("input" in s.json and "messages" not in s.json for s in backend.responses_seen)
