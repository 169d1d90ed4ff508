"""The context window (CONTRACT.md C10) against fake backends that tell theirs as
llama.cpp and vLLM do, count tokens as they do, and refuse an input past it as llama.cpp
does: learned by the health probe; estimated on every turn without a round trip; counted
near the window only; `truncation: "disabled"` refuses an overflow before any
generation; `"auto"` drops whole items from the front, in steps that keep the prefix
stable between them."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import top_level_span

WINDOW = 4000  # tokens: a quarter of the bytes, in the fake
TOKENIZE = ("/tokenize", "/apply-template")


async def windowed_proxy(
    make_proxy: MakeProxy, backend: FakeBackend, **overrides: Any
) -> ProxyHandle:
    overrides.setdefault("health_interval", 0.05)
    proxy = await make_proxy(backend.url, **overrides)
    async with asyncio.timeout(5):
        while not proxy.metric("ocxproxy_backend_context_window_tokens", backend=backend.url):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return proxy


async def create(http: aiohttp.ClientSession, proxy: ProxyHandle, **body: Any) -> tuple[int, Any]:
    body.setdefault("model", "m")
    async with http.post(proxy.url + "/v1/responses", json=body) as resp:
        return resp.status, await resp.json()


def counted(backend: FakeBackend) -> int:
    return sum(1 for seen in backend.seen if seen.path == "/tokenize")


def generations(backend: FakeBackend) -> int:
    return len(backend.responses_seen)


def words(n_bytes: int, seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n_bytes // 8))[:n_bytes]


@pytest.mark.parametrize("kind", ["llama", "vllm"])
async def test_the_window_is_learned_by_the_health_probe(kind: str, make_proxy: MakeProxy) -> None:
    async with FakeBackend(window=(kind, WINDOW)) as backend:  # type: ignore[arg-type]
        proxy = await windowed_proxy(make_proxy, backend)
        assert proxy.metric("ocxproxy_backend_context_window_tokens", backend=backend.url) == WINDOW
        found = proxy.proxy.pool.window_for(None)
        assert found is not None and found[1].tokens == WINDOW


async def test_the_flag_sets_the_window_without_asking(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, context_window=1000)
    status, answer = await create(http, proxy, input="x" * 8000)
    assert status == 200, answer  # no count: an estimate alone refuses nothing
    found = proxy.proxy.pool.window_for(None)
    assert found is not None and found[1].tokens == 1000
    assert [seen.path for seen in backend.seen] == ["/v1/responses"]


@pytest.mark.parametrize("kind", ["llama", "vllm"])
async def test_disabled_refuses_an_overflow_before_any_generation(
    kind: str, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    async with FakeBackend(window=(kind, WINDOW)) as backend:  # type: ignore[arg-type]
        proxy = await windowed_proxy(make_proxy, backend)
        previous = None
        turns = 0
        while True:
            body: dict[str, Any] = {"input": words(2000, turns), "max_output_tokens": 16}
            if previous is not None:
                body["previous_response_id"] = previous
            before = generations(backend)
            status, answer = await create(http, proxy, **body)
            if status != 200:
                break
            previous = answer["id"]
            turns += 1
            assert turns < 20
        assert status == 400
        assert answer == {
            "error": {
                "message": answer["error"]["message"],
                "type": "invalid_request_error",
                "param": "input",
                "code": "context_length_exceeded",
            }
        }
        assert "context window" in answer["error"]["message"]
        assert generations(backend) == before  # the backend generated nothing for it
        assert turns >= 5  # a chain well inside the window went through
        assert proxy.metric("ocxproxy_context_length_exceeded_total", truncation="disabled") == 1
        # The chain is still there: a smaller next turn from an earlier response works.
        status, answer = await create(http, proxy, input="short", previous_response_id=previous)
        assert status == 400  # still over: the history alone is past the window


async def test_turns_far_from_the_window_cost_no_round_trip(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    async with FakeBackend(window=("llama", 100_000)) as backend:
        proxy = await windowed_proxy(make_proxy, backend)
        previous = None
        for turn in range(12):
            body: dict[str, Any] = {"input": words(1000, turn)}
            if previous is not None:
                body["previous_response_id"] = previous
            status, answer = await create(http, proxy, **body)
            assert status == 200
            previous = answer["id"]
        assert counted(backend) == 0
        assert proxy.metric("ocxproxy_token_counts_total", backend=backend.url) == 0


def forwarded_inputs(backend: FakeBackend) -> list[list[Any]]:
    return [orjson.loads(seen.body)["input"] for seen in backend.responses_seen]


async def test_auto_drops_items_in_steps_that_keep_the_prefix(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    async with FakeBackend(window=("llama", WINDOW)) as backend:
        proxy = await windowed_proxy(make_proxy, backend)
        previous = None
        chain_bytes = 0
        n_turns = 0
        while chain_bytes < 3 * 4 * WINDOW:  # the chain grows to three windows
            text = words(600, n_turns)
            body: dict[str, Any] = {
                "input": [
                    {"role": "user", "content": text + (" CALL:lookup" if n_turns % 3 == 1 else "")}
                ],
                "truncation": "auto",
                "instructions": "You are terse.",
            }
            if previous is not None:
                body["previous_response_id"] = previous
            status, answer = await create(http, proxy, **body)
            assert status == 200, answer
            assert answer["truncation"] == "auto"
            if answer["output"][-1]["type"] == "function_call":
                call = answer["output"][-1]
                status, answer = await create(
                    http,
                    proxy,
                    previous_response_id=answer["id"],
                    truncation="auto",
                    instructions="You are terse.",
                    input=[
                        {"type": "function_call_output", "call_id": call["call_id"], "output": "42"}
                    ],
                )
                assert status == 200, answer
            previous = answer["id"]
            chain_bytes += 700
            n_turns += 1
        sent = [seen.body for seen in backend.responses_seen]
        inputs = forwarded_inputs(backend)
        moved = [
            n
            for n, (before, after) in enumerate(itertools.pairwise(sent), 1)
            if not top_level_span(after, "input").startswith(top_level_span(before, "input")[:-1])
        ]  # the turns whose prefix changed: the drop point moved
        assert len(moved) == proxy.metric("ocxproxy_truncation_steps_total") >= 4
        # A step frees a quarter of the window: several turns grow into it before the next.
        assert min(b - a for a, b in itertools.pairwise(moved)) >= 4, moved
        assert max(len(body) for body in sent) < 4 * WINDOW
        for items in inputs:
            first = items[0]
            assert first.get("role") == "user"  # the cut is at a user message
            calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
            outputs = {i["call_id"] for i in items if i.get("type") == "function_call_output"}
            assert outputs <= calls  # never an output without its call
        assert all(orjson.loads(s)["instructions"] == "You are terse." for s in sent)
        assert proxy.metric("ocxproxy_context_length_exceeded_total", truncation="auto") == 0
        assert counted(backend) < len(sent) / 2  # counted near the window only


async def test_auto_refuses_a_turn_that_alone_exceeds_the_window(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    async with FakeBackend(window=("llama", WINDOW)) as backend:
        proxy = await windowed_proxy(make_proxy, backend)
        status, answer = await create(http, proxy, input=words(5 * WINDOW, 1), truncation="auto")
        assert status == 400
        assert answer["error"]["code"] == "context_length_exceeded"
        assert generations(backend) == 0


async def test_a_backends_own_context_error_is_relayed_in_openai_shape(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """No window known here (no probes): the backend decides, and its llama.cpp-shaped
    error reaches the client as OpenAI's context_length_exceeded."""
    async with FakeBackend(window=("llama", 1000)) as backend:
        proxy = await make_proxy(backend.url)
        status, answer = await create(http, proxy, input=words(8000, 1))
        assert status == 400
        assert answer["error"]["code"] == "context_length_exceeded"
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["param"] == "input"
        assert "context size" in answer["error"]["message"]  # the backend's own words
        assert generations(backend) == 1
        async with http.ws_connect(proxy.url + "/v1/responses") as ws:
            await ws.send_json({"type": "response.create", "model": "m", "input": words(8000, 2)})
            event = await ws.receive_json()
        assert event["type"] == "error", event
        assert "context_length_exceeded" in orjson.dumps(event).decode(), event


async def test_auto_over_websocket_and_store_false(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """A WebSocket chain of store:false turns (kept in the connection's memory) goes past
    the window with truncation auto: every turn completes, the forwarded input is cut."""
    async with FakeBackend(window=("llama", WINDOW)) as backend:
        proxy = await windowed_proxy(make_proxy, backend)
        async with http.ws_connect(proxy.url + "/v1/responses") as ws:
            previous = None
            for turn in range(40):
                fields: dict[str, Any] = {
                    "type": "response.create",
                    "model": "m",
                    "input": words(800, turn),
                    "truncation": "auto",
                    "store": False,
                }
                if previous is not None:
                    fields["previous_response_id"] = previous
                await ws.send_json(fields)
                while True:
                    event = await ws.receive_json()
                    if event["type"] in ("response.completed", "error", "response.failed"):
                        break
                assert event["type"] == "response.completed", event
                assert event["response"]["truncation"] == "auto"
                previous = event["response"]["id"]
        assert proxy.metric("ocxproxy_truncation_steps_total") >= 2
        assert max(len(seen.body) for seen in backend.responses_seen) < 4 * WINDOW
        assert forwarded_inputs(backend)[-1][0]["role"] == "user"


def assert_paired(items: list[Any]) -> None:
    """Every tool output forwarded with its call, and every call with its output (but the
    last item's)."""
    calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
    outputs = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
    assert set(outputs) <= set(calls), items
    assert set(calls) - set(outputs) <= {items[-1].get("call_id")}, items


TASK = "Fix the failing test. CALL:run"


async def test_auto_cuts_inside_a_tool_loop_that_alone_exceeds_the_window(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """One agentic turn (a user message, then a tool loop over previous_response_id)
    grows to three windows: every step completes; the backend gets the instructions, the
    turn's user message and its newest calls with their outputs, and the cut inside the
    turn moves in steps that keep the prefix between them."""
    async with FakeBackend(window=("llama", WINDOW)) as backend:
        proxy = await windowed_proxy(make_proxy, backend)
        fields: dict[str, Any] = {"truncation": "auto", "instructions": "You are terse."}
        earlier = [{"role": "user", "content": "An earlier question."}]
        status, answer = await create(http, proxy, input=earlier, **fields)
        assert status == 200, answer
        status, answer = await create(
            http, proxy, input=TASK, previous_response_id=answer["id"], **fields
        )
        for step in range(3 * 4 * WINDOW // 700):
            assert status == 200, answer
            call = answer["output"][-1]
            assert call["type"] == "function_call", answer
            output = words(600, step) + " CALL:run"
            status, answer = await create(
                http,
                proxy,
                previous_response_id=answer["id"],
                input=[
                    {"type": "function_call_output", "call_id": call["call_id"], "output": output}
                ],
                **fields,
            )
        assert status == 200, answer
        sent = [seen.body for seen in backend.responses_seen]
        inputs = forwarded_inputs(backend)
        for items in inputs[1:]:
            assert_paired(items)
            assert any(i.get("content") == TASK for i in items)  # the turn's user message
        assert all(orjson.loads(body)["instructions"] == "You are terse." for body in sent)
        assert inputs[-1][0]["content"] == TASK  # the earlier turn is gone, then the oldest calls
        assert inputs[-1][1]["type"] == "function_call"
        assert max(len(body) for body in sent) < 4 * WINDOW
        moved = [
            n
            for n, (before, after) in enumerate(itertools.pairwise(sent), 1)
            if not top_level_span(after, "input").startswith(top_level_span(before, "input")[:-1])
        ]
        assert len(moved) == proxy.metric("ocxproxy_truncation_steps_total") >= 3
        assert min(b - a for a, b in itertools.pairwise(moved)) >= 3, moved
        assert proxy.metric("ocxproxy_context_length_exceeded_total", truncation="auto") == 0


async def test_auto_cuts_inside_a_tool_loop_sent_in_full(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The same loop as Codex sends it over HTTP: store:false, the whole turn by value each
    time, with its session's prompt_cache_key: the cut stays between steps as on a chain;
    a last output that alone exceeds the window is still refused, unforwarded."""
    async with FakeBackend(window=("llama", WINDOW)) as backend:
        proxy = await windowed_proxy(make_proxy, backend)
        history: list[Any] = [{"role": "user", "content": TASK}]
        fields: dict[str, Any] = {
            "truncation": "auto",
            "instructions": "You are terse.",
            "prompt_cache_key": "session-1",
        }
        for step in range(3 * 4 * WINDOW // 700):
            status, answer = await create(http, proxy, input=history, store=False, **fields)
            assert status == 200, answer
            call = answer["output"][-1]
            assert call["type"] == "function_call", answer
            output = words(600, step) + " CALL:run"
            history += [
                call,
                {"type": "function_call_output", "call_id": call["call_id"], "output": output},
            ]
        for items in forwarded_inputs(backend):
            assert_paired(items)
            assert items[0]["content"] == TASK
        sent = [seen.body for seen in backend.responses_seen]
        assert max(len(body) for body in sent) < 4 * WINDOW
        moved = [
            n
            for n, (before, after) in enumerate(itertools.pairwise(sent), 1)
            if not top_level_span(after, "input").startswith(top_level_span(before, "input")[:-1])
        ]
        assert len(moved) == proxy.metric("ocxproxy_truncation_steps_total") >= 3
        assert min(b - a for a, b in itertools.pairwise(moved)) >= 3, moved
        assert proxy.metric("ocxproxy_context_length_exceeded_total", truncation="auto") == 0
        before = generations(backend)
        history[-1] = {**history[-1], "output": words(5 * WINDOW, 99)}
        status, answer = await create(http, proxy, input=history, store=False, **fields)
        assert status == 400, answer
        assert answer["error"]["code"] == "context_length_exceeded"
        assert generations(backend) == before


async def test_conversation_turns_are_estimated_from_their_real_counts(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """A conversation grows past half the window by the backend's count, past all of it by the
    byte estimate of a turn that knows no real count: each turn finds the count the
    conversation's last turn reported, so none asks the backend to count."""
    async with FakeBackend(window=("llama", WINDOW)) as backend:
        proxy = await windowed_proxy(make_proxy, backend)
        async with http.post(proxy.url + "/v1/conversations", json={}) as resp:
            conversation = (await resp.json())["id"]
        for turn in range(7):
            status, answer = await create(
                http, proxy, input=words(1000, turn), conversation=conversation
            )
            assert status == 200, answer
        assert answer["usage"]["input_tokens"] > WINDOW * 0.6
        assert counted(backend) == 0
