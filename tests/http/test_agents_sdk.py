"""The OpenAI Agents SDK as a real client: server-managed state through previous_response_id
(chained runs, streaming, and a tool call answered by the SDK), the way agents use it."""

from __future__ import annotations

import agents
import pytest

from tests.conftest import ProxyHandle
from tests.fakes.backend import FakeBackend


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
