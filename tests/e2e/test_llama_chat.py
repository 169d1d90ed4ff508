"""End-to-end against the real llama.cpp server spoken to through /v1/chat/completions
(`--upstream-dialect chat`): the translation is deterministic enough that every
continuation hits llama.cpp's prefix cache, streaming included."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import MakeProxy, ProxyHandle, unavailable
from tests.e2e.conftest import HAVE_LLAMA, MIN_CACHED_RATIO, MISSING, cached_ratio
from tests.e2e.text import QUESTIONS, long_message

pytestmark = [pytest.mark.llama, pytest.mark.timeout(600)]

if not HAVE_LLAMA:
    unavailable(MISSING)


@pytest.fixture
async def chat_proxy(make_proxy: MakeProxy, llama_url: str) -> ProxyHandle:
    return await make_proxy(llama_url, upstream_dialect=("chat",))


async def test_chat_dialect_chain_hits_prefix_cache(chat_proxy: ProxyHandle) -> None:
    client = chat_proxy.client()
    first = await client.responses.create(
        model="local",
        instructions="You are a helpful assistant.",
        input=long_message(1100, seed=11),
        max_output_tokens=16,
    )
    assert first.status in ("completed", "incomplete")
    assert first.usage is not None and first.usage.input_tokens > 900
    assert first.output[0].type == "message" and first.output_text
    previous, ratios, sizes = first.id, [], [first.usage.input_tokens]
    for turn, question in enumerate(QUESTIONS[:3]):
        if turn == 1:  # one streamed turn, through the SDK's stream helper
            async with client.responses.stream(
                model="local",
                instructions="You are a helpful assistant.",
                input=question,
                previous_response_id=previous,
                max_output_tokens=16,
            ) as stream:
                events = [event async for event in stream]
            # 16 tokens often cut the answer: response.incomplete, remembered all the same
            assert events[-1].type in ("response.completed", "response.incomplete")
            assert [e.sequence_number for e in events] == list(range(len(events)))
            response = events[-1].response
        else:
            response = await client.responses.create(
                model="local",
                instructions="You are a helpful assistant.",
                input=question,
                previous_response_id=previous,
                max_output_tokens=16,
            )
        assert response.usage is not None
        assert response.usage.input_tokens > sizes[-1]  # the history grew, append-only
        sizes.append(response.usage.input_tokens)
        ratios.append(cached_ratio(response.usage))
        previous = response.id
    assert len(ratios) == 3
    assert min(ratios) >= MIN_CACHED_RATIO, (ratios, sizes)


async def test_llama_errors_pass_through_in_openai_shape(chat_proxy: ProxyHandle) -> None:
    client = chat_proxy.client()
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="local", input=long_message(12000, seed=3))
    assert info.value.status_code == 400
    assert "context" in info.value.message
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
    assert (error["type"], error["param"]) == ("invalid_request_error", "input")


async def test_tool_history_is_accepted_and_cached(chat_proxy: ProxyHandle) -> None:
    """A history with a function call and its output reaches llama.cpp as an assistant
    `tool_calls` message and a `tool` message; the continuation reuses its KV state."""
    client = chat_proxy.client()
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    first = await client.responses.create(
        model="local",
        tools=[tool],  # type: ignore[list-item]
        input=[
            {"role": "user", "content": long_message(300, seed=5) + " What is the weather?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
        max_output_tokens=16,
    )
    assert first.output_text
    second = await client.responses.create(
        model="local",
        tools=[tool],  # type: ignore[list-item]
        input="And tomorrow?",
        previous_response_id=first.id,
        max_output_tokens=16,
    )
    assert cached_ratio(second.usage) >= MIN_CACHED_RATIO
