"""Conversations against the real llama.cpp server: a conversation that is only appended
to is spliced byte-stable, so every turn after the first hits the prefix cache; the
Agents SDK drives it both ways (OpenAIConversationsSession, Runner.run(conversation_id=)).

SmolLM2-135M does not emit tool calls (the embedded server runs without a tool-calling
template), so the SDK executing a tool is shown against the fake backend
(tests/http/test_agents_sdk.py); here the tool round trip is in the conversation as items
(a call and its output, as the SDK would have added them), and the real backend is
continued on top of it."""

from __future__ import annotations

import agents
import pytest

from scripts.demo import QUESTIONS, long_message
from tests.conftest import MakeProxy, ProxyHandle, unavailable
from tests.e2e.conftest import HAVE_LLAMA, MIN_CACHED_RATIO, MISSING, cached_ratio

pytestmark = [pytest.mark.llama, pytest.mark.timeout(300)]

if not HAVE_LLAMA:
    unavailable(MISSING)


@pytest.fixture
async def llama_proxy(make_proxy: MakeProxy, llama_url: str) -> ProxyHandle:
    agents.set_tracing_disabled(True)
    return await make_proxy(llama_url)


def make_agent(proxy: ProxyHandle) -> agents.Agent:
    model = agents.OpenAIResponsesModel(model="local", openai_client=proxy.client())
    # Short answers by llama.cpp's own cap (`n_predict`), which the request's Responses
    # fields do not show: `max_tokens` would have the proxy report a cut answer
    # `incomplete` (CONTRACT.md C1.10), which the SDK raises on, as it does on OpenAI.
    settings = agents.ModelSettings(extra_body={"n_predict": 16})
    return agents.Agent(
        name="a", instructions="Answer briefly.", model=model, model_settings=settings
    )


async def test_conversation_turns_hit_the_prefix_cache(llama_proxy: ProxyHandle) -> None:
    client = llama_proxy.client()
    call = {
        "type": "function_call",
        "call_id": "call_weather_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    output = {"type": "function_call_output", "call_id": "call_weather_1", "output": "sunny"}
    conv = await client.conversations.create(
        items=[{"type": "message", "role": "user", "content": long_message(1500, seed=7)}]
    )
    await client.conversations.items.create(conv.id, items=[call, output])
    agent = make_agent(llama_proxy)
    first = await agents.Runner.run(agent, QUESTIONS[0], conversation_id=conv.id)
    usage = first.raw_responses[-1].usage
    assert usage is not None and usage.input_tokens > 1350
    ratios = []
    for question in QUESTIONS[1:4]:
        result = await agents.Runner.run(agent, question, conversation_id=conv.id)
        ratios.append(cached_ratio(result.raw_responses[-1].usage))  # type: ignore[arg-type]
    assert min(ratios) >= MIN_CACHED_RATIO, ratios
    kinds = [item.type async for item in client.conversations.items.list(conv.id, order="asc")]
    assert kinds == ["message", "function_call", "function_call_output"] + ["message"] * 8


async def test_openai_conversations_session_over_several_runs(llama_proxy: ProxyHandle) -> None:
    session = agents.OpenAIConversationsSession(openai_client=llama_proxy.client())
    agent = make_agent(llama_proxy)
    await agents.Runner.run(agent, long_message(1500, seed=8), session=session)
    ratios = []
    for question in QUESTIONS[:3]:
        result = await agents.Runner.run(agent, question, session=session)
        ratios.append(cached_ratio(result.raw_responses[-1].usage))  # type: ignore[arg-type]
        assert result.final_output
    assert min(ratios) >= MIN_CACHED_RATIO, ratios
    assert len(await session.get_items()) == 8
