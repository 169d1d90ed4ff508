"""The OpenAI Agents SDK as a real client: server-managed state through previous_response_id
(chained runs, streaming, and a tool call answered by the SDK), the way agents use it."""

from __future__ import annotations

import agents
import openai
import pytest

from tests.conftest import ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only


@pytest.fixture(autouse=True)
def _no_tracing() -> None:
    agents.set_tracing_disabled(True)  # tracing would try to reach api.openai.com


def make_agent(proxy: ProxyHandle, **kwargs: object) -> agents.Agent:
    model = agents.OpenAIResponsesModel(model="m", openai_client=proxy.client())
    return agents.Agent(name="helper", instructions="be brief", model=model, **kwargs)


async def test_chained_runs_see_the_whole_history(proxy: ProxyHandle, backend: FakeBackend) -> None:
    agent = make_agent(proxy)
    first = await agents.Runner.run(agent, "hello")
    assert first.final_output == "echo#1: hello"
    second = await agents.Runner.run(agent, "again", previous_response_id=first.last_response_id)
    assert second.final_output == "echo#3: again"  # hello, its answer, again
    assert "previous_response_id" not in backend.responses_seen[-1].json


async def test_streamed_run_continues_a_chain(proxy: ProxyHandle) -> None:
    agent = make_agent(proxy)
    first = await agents.Runner.run(agent, "hello")
    streamed = agents.Runner.run_streamed(
        agent, "and now?", previous_response_id=first.last_response_id
    )
    deltas = [
        event.data.delta
        async for event in streamed.stream_events()
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
    ]
    assert streamed.final_output == "echo#3: and now?" == "".join(deltas)


async def test_tool_call_round_trip_with_auto_previous_response_id(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(n: int) -> str:
        """The weather."""
        calls.append(f"n={n}")
        return "sunny"

    agent = make_agent(proxy, tools=[get_weather])
    result = await agents.Runner.run(
        agent, "CALL:get_weather please", auto_previous_response_id=True
    )
    assert calls == ["n=1"]
    # The SDK sent only the tool output on top of the stored call; the proxy expanded it.
    hits = proxy.proxy.metrics.expansions.labels(outcome="hit").get()
    assert hits == 1
    last = backend.responses_seen[-1].json
    assert [item.get("type") for item in last["input"]][-2:] == [
        "function_call",
        "function_call_output",
    ]
    assert result.final_output == "echo#3: tool said sunny"


# -- the Conversations API ------------------------------------------------------------------


async def test_openai_conversations_session_over_several_runs(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    """The session keeps the history in a conversation (client-managed: the SDK reads the
    items and sends them as input, then adds the new ones)."""
    agent = make_agent(proxy)
    session = agents.OpenAIConversationsSession(openai_client=proxy.client())
    first = await agents.Runner.run(agent, "hello", session=session)
    assert first.final_output == "echo#1: hello"
    second = await agents.Runner.run(agent, "again", session=session)
    assert second.final_output == "echo#3: again"
    third = await agents.Runner.run(agent, "more", session=session)
    assert third.final_output == "echo#5: more"
    items = await session.get_items()
    assert [item.get("role") for item in items] == ["user", "assistant"] * 3
    assert await session.get_items(limit=2) == items[-2:]
    popped = await session.pop_item()
    assert popped is not None and popped["content"][0]["text"] == "echo#5: more"  # type: ignore[index,typeddict-item]
    assert len(await session.get_items()) == 5
    conversation_id = session.session_id
    await session.clear_session()
    with pytest.raises(openai.NotFoundError):
        await proxy.client().conversations.retrieve(conversation_id)


async def test_runs_with_conversation_id_and_a_tool_call(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    """Server-managed: the SDK sends only the new items with `conversation`; the proxy
    splices the conversation in front and appends the turn."""
    calls: list[str] = []

    @agents.function_tool
    def get_weather(n: int) -> str:
        """The weather."""
        calls.append(f"n={n}")
        return "sunny"

    client = proxy.client()
    conv = await client.conversations.create()
    agent = make_agent(proxy, tools=[get_weather])
    result = await agents.Runner.run(agent, "CALL:get_weather please", conversation_id=conv.id)
    assert calls == ["n=1"]
    assert result.final_output == "echo#3: tool said sunny"
    again = await agents.Runner.run(agent, "thanks", conversation_id=conv.id)
    assert again.final_output == "echo#5: thanks"
    sent = [seen.json for seen in backend.responses_seen]
    assert all("conversation" not in body for body in sent)
    assert [len(body["input"]) for body in sent] == [1, 3, 5]  # the whole conversation each time
    assert_append_only([seen.body for seen in backend.responses_seen])
    kinds = [item.type async for item in client.conversations.items.list(conv.id, order="asc")]
    assert kinds == [
        "message", "function_call", "function_call_output", "message", "message", "message",
    ]  # fmt: skip
