"""Compaction served by the proxy (CONTRACT.md C10), through real clients in front of the
fake backend, which records every body it is sent: a create ending in
`compaction_trigger` (JSON, SSE, WebSocket), `POST /v1/responses/compact`, compaction
items sent back by value and through `previous_response_id`, and sealed items that must
not open (tampered, another key, another credential)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from ocxproxy.continuation.compaction import (
    COMPACTION_PROMPT,
    SUMMARY_MAX_OUTPUT_TOKENS,
    SUMMARY_PREFIX,
)
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only, sse_payloads, top_level_span
from tests.http.test_websocket import connect, create
from tests.openresponses import item_problems

Json = dict[str, Any]
TRIGGER = {"type": "compaction_trigger"}
HISTORY: list[Json] = [
    {"role": "developer", "content": "You are a coding agent."},
    {"role": "user", "content": "Rename foo to bar in main.py"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    {"role": "user", "content": "Now run the tests"},
]


def forwarded_items(backend: FakeBackend) -> list[list[Json]]:
    return [seen.json["input"] for seen in backend.responses_seen]


def billed_input_tokens(backend: FakeBackend, requests: int) -> int:
    """The input tokens the fake reported for its last `requests` requests (it counts
    a quarter of the input items' JSON)."""
    seen = backend.responses_seen[-requests:]
    return sum(max(1, (len(orjson.dumps(s.json["input"])) + 3) // 4) for s in seen)


def assert_never_forwarded(backend: FakeBackend) -> None:
    """No backend body ever held a compaction trigger or a compaction item."""
    for seen in backend.responses_seen:
        assert b"compaction_trigger" not in seen.body
        assert b'"compaction"' not in seen.body
        assert b"ocxc1." not in seen.body


def compaction_item(output: list[Any]) -> Json:
    assert len(output) == 1, output
    item: Json = output[0] if isinstance(output[0], dict) else output[0].model_dump()
    assert item["type"] == "compaction"
    assert item["id"].startswith("cmp_")
    assert item["encrypted_content"].startswith("ocxc1.")
    return item


async def test_trigger_answers_exactly_one_sealed_item(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    response = await client.responses.create(
        model="m", input=[*HISTORY, TRIGGER], store=False, instructions="Be brief."
    )
    item = compaction_item(response.output)
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens > 0
    (sent,) = forwarded_items(backend)
    # The context as any turn forwards it, then the proxy's prompt; never the trigger.
    assert sent[:-1] == HISTORY
    assert sent[-1] == {"type": "message", "role": "user", "content": COMPACTION_PROMPT}
    body = backend.responses_seen[0].json
    assert body["instructions"] == "Be brief." and body["stream"] is False
    # A request with no output cap gets the summary's own, so a model that never ends its
    # text cannot hold the backend until its context is full.
    assert body["max_output_tokens"] == SUMMARY_MAX_OUTPUT_TOKENS
    # The summary (the fake model echoes the last user text) is sealed, not readable.
    assert "Write a summary" not in item["encrypted_content"]
    assert_never_forwarded(backend)
    assert proxy.metric("ocxproxy_compactions_total", route="trigger", outcome="completed") == 1


async def test_trigger_streams_the_full_event_sequence(
    proxy: ProxyHandle, http: aiohttp.ClientSession, backend: FakeBackend
) -> None:
    body = {"model": "m", "input": [*HISTORY, TRIGGER], "stream": True, "store": False}
    async with http.post(proxy.base_url + "/responses", json=body) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        events = sse_payloads(await answer.read())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3, 4]
    assert events[0]["response"]["status"] == "in_progress"
    done = compaction_item([events[3]["item"]])
    completed = events[-1]["response"]
    assert compaction_item(completed["output"]) == done
    assert completed["usage"]["total_tokens"] > 0
    assert_never_forwarded(backend)

    # The SDK's stream reads the same events.
    client = proxy.client()
    stream = await client.responses.create(model="m", input=[*HISTORY, TRIGGER], stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.completed" and "response.output_item.done" in kinds


async def test_a_compaction_item_sent_back_reaches_the_backend_as_its_summary(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    response = await client.responses.create(model="m", input=[*HISTORY, TRIGGER], store=False)
    item = compaction_item(response.output)
    summary_text = "echo#5: " + COMPACTION_PROMPT  # what the fake model wrote
    window = [HISTORY[1], HISTORY[3], item]  # what Codex sends back: kept messages + item
    for question in ("What next?", "And then?"):
        await client.responses.create(
            model="m", input=[*window, {"role": "user", "content": question}], store=False
        )
    first, second = backend.responses_seen[1:]
    expected = {"type": "message", "role": "user", "content": SUMMARY_PREFIX + summary_text}
    assert first.json["input"][2] == expected
    # Byte-identical every time: the backend's prefix cache holds the turn before.
    prefix = top_level_span(first.body, "input")
    shared = prefix[: prefix.index(b"What next?")]
    assert top_level_span(second.body, "input").startswith(shared)
    assert_never_forwarded(backend)


async def test_a_stored_compaction_starts_the_chain_again_from_its_window(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    first = await client.responses.create(model="m", input=HISTORY)
    compaction = await client.responses.create(
        model="m", previous_response_id=first.id, input=[TRIGGER]
    )
    item = compaction_item(compaction.output)
    # The summary request held the whole chain.
    summarized = forwarded_items(backend)[1]
    assert summarized[: len(HISTORY)] == HISTORY and len(summarized) == len(HISTORY) + 2
    # A retrieved compaction response is the item, as answered.
    stored = await client.responses.retrieve(compaction.id)
    assert compaction_item(stored.output) == item
    # The next turn forwards the compacted window: kept user messages, then the summary.
    await client.responses.create(model="m", previous_response_id=compaction.id, input="What next?")
    after = forwarded_items(backend)[-1]
    assert [m.get("content") for m in after[:2]] == [HISTORY[1]["content"], HISTORY[3]["content"]]
    assert after[2]["content"].startswith(SUMMARY_PREFIX)
    assert after[3] == {"role": "user", "content": "What next?"}
    assert len(after) == 4  # the assistant's turn and the developer message were compacted
    # Through an item_reference, the item resolves to the same summary bytes.
    reference = {"type": "item_reference", "id": item["id"]}
    await client.responses.create(
        model="m", input=[reference, {"role": "user", "content": "x"}], store=False
    )
    assert forwarded_items(backend)[-1][0] == after[2]
    assert_never_forwarded(backend)


async def test_compact_endpoint_with_the_sdk(proxy: ProxyHandle, backend: FakeBackend) -> None:
    client = proxy.client()
    compacted = await client.responses.compact(
        model="m",
        input=HISTORY,  # type: ignore[arg-type]
        instructions="Be brief.",
        prompt_cache_key="session-1",
    )
    assert compacted.object == "response.compaction"
    assert compacted.id and compacted.created_at > 0
    assert compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0
    *kept, last = [o.model_dump(exclude_none=True, warnings=False) for o in compacted.output]
    texts = [HISTORY[1]["content"], HISTORY[3]["content"]]
    assert [m["content"] for m in kept] == [[{"type": "input_text", "text": t}] for t in texts]
    # Complete items, as OpenAI's window carries them (the Open Responses schema's rules).
    assert [item_problems(m, f"output[{i}]") for i, m in enumerate(kept)] == [[], []]
    assert all(m["id"].startswith("msg_") and m["status"] == "completed" for m in kept)
    item = compaction_item([last])
    sent = backend.responses_seen[0].json
    assert sent["input"][-1]["content"] == COMPACTION_PROMPT
    assert sent["instructions"] == "Be brief." and sent["prompt_cache_key"] == "session-1"
    assert sent["max_output_tokens"] == SUMMARY_MAX_OUTPUT_TOKENS
    # The window fed back as input works and reaches the backend as the summary.
    window = [*kept, item, {"role": "user", "content": "go on"}]
    answer = await client.responses.create(model="m", input=window, store=False)
    assert answer.output_text == "echo#4: go on"
    assert forwarded_items(backend)[-1][2]["content"].startswith(SUMMARY_PREFIX)
    assert_never_forwarded(backend)
    assert proxy.metric("ocxproxy_compactions_total", route="compact", outcome="completed") == 1


async def test_compact_endpoint_needs_a_model(proxy: ProxyHandle, backend: FakeBackend) -> None:
    async with aiohttp.ClientSession() as http:
        url = proxy.url + "/v1/responses/compact"
        async with http.post(url, json={"input": HISTORY}) as answer:
            assert answer.status == 400
            error = (await answer.json())["error"]
    assert error["param"] == "model" and error["type"] == "invalid_request_error"
    assert backend.responses_seen == []


async def test_compact_endpoint_expands_previous_response_id(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    first = await client.responses.create(model="m", input=HISTORY)
    compacted = await client.responses.compact(
        model="m", previous_response_id=first.id, input="one more"
    )
    sent = forwarded_items(backend)[-1]
    assert sent[: len(HISTORY)] == HISTORY
    assert sent[-2] == {"role": "user", "content": "one more"}
    assert compacted.output[-1].type == "compaction"


async def test_sealed_items_that_do_not_open_are_refused(
    make_proxy: MakeProxy, backend: FakeBackend, tmp_path: Path
) -> None:
    proxy = await make_proxy(backend.url)
    other = await make_proxy(backend.url, state_dir=tmp_path / "other")  # its own key
    made = await proxy.client().responses.create(model="m", input=[*HISTORY, TRIGGER])
    item = compaction_item(made.output)
    token = item["encrypted_content"]
    flipped = token[:20] + ("A" if token[20] != "A" else "B") + token[21:]
    cases = [
        (proxy.client(), {**item, "encrypted_content": flipped}, "altered"),
        (other.client(), item, "another key"),
        (proxy.client("sk-test-b"), item, "another API key"),
        (proxy.client(), {**item, "encrypted_content": "plain text"}, "not made by this proxy"),
    ]
    before = len(backend.responses_seen)
    for client, sent, reason in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(
                model="m", input=[HISTORY[1], sent, {"role": "user", "content": "hi"}]
            )
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["code"] == "invalid_encrypted_content" and error["param"] == "input"
        assert "input[1]" in error["message"] and item["id"] in error["message"]
        assert reason in error["message"]
    assert len(backend.responses_seen) == before  # nothing forwarded


async def test_the_key_is_generated_once_into_the_state_dir(
    make_proxy: MakeProxy, backend: FakeBackend, tmp_path: Path
) -> None:
    state = tmp_path / "shared-state"
    first = await make_proxy(backend.url, state_dir=state)
    key_file = state / "compaction.key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    made = await first.client().responses.create(model="m", input=[*HISTORY, TRIGGER])
    item = compaction_item(made.output)
    await first.server.close()
    again = await make_proxy(backend.url, state_dir=state)  # a restart: same key
    answer = await again.client().responses.create(
        model="m", input=[item, {"role": "user", "content": "next"}], store=False
    )
    assert answer.output_text == "echo#2: next"
    await again.server.close()
    # A key given by the operator wins over the file, and is never written there.
    given = await make_proxy(backend.url, state_dir=state, compaction_key="operator secret")
    with pytest.raises(openai.BadRequestError):
        await given.client().responses.create(model="m", input=[item], store=False)
    assert key_file.read_text().strip() not in (b"operator secret".hex(), "operator secret")


async def test_trigger_over_websocket(
    proxy: ProxyHandle, http: aiohttp.ClientSession, backend: FakeBackend
) -> None:
    ws = await connect(http, proxy)
    first = await create(ws, model="m", input=HISTORY, store=False)
    first_id = first[-1]["response"]["id"]
    events = await create(ws, model="m", previous_response_id=first_id, input=[TRIGGER])
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    item = compaction_item(events[-1]["response"]["output"])
    after = await create(
        ws, model="m", previous_response_id=events[-1]["response"]["id"], input="next?"
    )
    assert after[-1]["type"] == "response.completed"
    assert forwarded_items(backend)[-1][2]["content"].startswith(SUMMARY_PREFIX)
    # The item by value on the same socket opens too.
    by_value = await create(ws, model="m", input=[item, {"role": "user", "content": "x"}])
    assert by_value[-1]["type"] == "response.completed"
    assert_never_forwarded(backend)
    await ws.close()


async def test_a_trigger_that_is_not_last_is_refused(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().responses.create(model="m", input=[TRIGGER, *HISTORY])
    assert "last input item" in str(caught.value)
    assert backend.responses_seen == []


async def test_a_backend_error_is_relayed_and_counted(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    backend.fail_next(
        400,
        {
            "error": {
                "message": "context too long",
                "type": "invalid_request_error",
                "code": "context_length_exceeded",
                "param": None,
            }
        },
    )
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().responses.create(model="m", input=[*HISTORY, TRIGGER])
    assert "context too long" in str(caught.value)
    assert proxy.metric("ocxproxy_compactions_total", route="trigger", outcome="backend_error") == 1


def test_sealed_document_round_trip() -> None:
    from ocxproxy.continuation.compaction import Sealer, summary_message

    sealer = Sealer(b"k" * 32)
    token = sealer.seal("the summary", scope="s1", model="m")
    assert sealer.open(token, "s1") == summary_message("the summary")
    assert orjson.loads(summary_message("x"))["content"] == SUMMARY_PREFIX + "x"


def test_the_cipher_is_loaded_at_the_first_seal_not_with_the_proxy() -> None:
    """cryptography's bindings cost every process ~8 MiB: a proxy that never compacts
    does not load them; the first seal does."""
    script = (
        "import sys\n"
        "import ocxproxy.cli, ocxproxy.server\n"
        "import ocxproxy.http.context\n"
        "from ocxproxy.continuation.compaction import Sealer\n"
        "sealer = Sealer.ephemeral()\n"
        "print(any(m.startswith('cryptography') for m in sys.modules))\n"
        "sealer.open(sealer.seal('s', scope='a', model='m'), 'a')\n"
        "print(any(m.startswith('cryptography') for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


async def test_trigger_on_a_conversation(proxy: ProxyHandle, backend: FakeBackend) -> None:
    client = proxy.client()
    conv = await client.conversations.create(items=[HISTORY[1]])  # type: ignore[list-item]
    await client.responses.create(model="m", input="turn", conversation=conv.id)
    compaction = await client.responses.create(model="m", input=[TRIGGER], conversation=conv.id)
    compaction_item(compaction.output)
    assert compaction.conversation is not None and compaction.conversation.id == conv.id
    await client.responses.create(model="m", input="after", conversation=conv.id)
    after = forwarded_items(backend)[-1]
    assert after[-2]["content"].startswith(SUMMARY_PREFIX)
    assert after[-1] == {"role": "user", "content": "after"}
    assert_never_forwarded(backend)


def test_the_prompt_in_use_is_the_documented_one() -> None:
    from ocxproxy.continuation.compaction import PROMPT_VERSION

    behavior = (Path(__file__).resolve().parents[2] / "docs" / "BEHAVIOR.md").read_text()
    assert f"> {COMPACTION_PROMPT}\n" in behavior
    assert f"The compaction prompt (version {PROMPT_VERSION}," in behavior
    assert SUMMARY_PREFIX.replace("\n", "\\n") in behavior


@pytest.mark.parametrize("spacing", ["compact", "pretty", "nested"])
async def test_a_stored_turn_with_an_item_splices_byte_for_byte_next_turn(
    proxy: ProxyHandle, http: aiohttp.ClientSession, backend: FakeBackend, spacing: str
) -> None:
    client = proxy.client()
    made = await client.responses.create(model="m", input=[*HISTORY, TRIGGER], store=False)
    item = compaction_item(made.output)
    if spacing == "nested":  # bytes the quick edit cannot place: built item by item
        item = {**item, "extra": {"note": "}"}}
    body = {"model": "m", "input": [HISTORY[1], item, {"role": "user", "content": "go"}]}
    raw = orjson.dumps(body, option=orjson.OPT_INDENT_2 if spacing == "pretty" else 0)
    headers = {"Authorization": "Bearer sk-test-a", "Content-Type": "application/json"}
    async with http.post(proxy.base_url + "/responses", data=raw, headers=headers) as answer:
        assert answer.status == 200, await answer.text()
        first = await answer.json()
    await client.responses.create(model="m", input="more", previous_response_id=first["id"])
    sent = backend.responses_seen[-2:]
    assert sent[0].json["input"][1]["content"].startswith(SUMMARY_PREFIX)
    if spacing == "pretty":  # the items as written; only the whitespace between them goes
        before = sent[0].json["input"]
        assert sent[1].json["input"][: len(before)] == before
    else:
        assert_append_only([seen.body for seen in sent])
    assert_never_forwarded(backend)


LONG = "Some context the session built up over many turns. " * 120  # ~1,600 tokens
MANAGED = [{"type": "compaction", "compact_threshold": 1000}]


async def test_context_management_compacts_first_then_answers(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    first = await client.responses.create(model="m", input=LONG)
    turn = await client.responses.create(
        model="m",
        input="What next?",
        previous_response_id=first.id,
        context_management=MANAGED,  # type: ignore[arg-type]
    )
    assert [item.type for item in turn.output] == ["compaction", "message"]
    compaction_item(turn.output[:1])
    assert turn.output_text == "echo#3: What next?"
    # Billed in this one response: the summary request's tokens and the turn's.
    assert turn.usage is not None
    assert turn.usage.input_tokens == billed_input_tokens(backend, 2)
    own_output = (len(b"echo#3: What next?") + 3) // 4
    assert turn.usage.output_tokens > own_output  # and the summary's
    assert turn.usage.total_tokens == turn.usage.input_tokens + turn.usage.output_tokens
    summarized, answered = forwarded_items(backend)[1:]
    assert summarized[-1]["content"] == COMPACTION_PROMPT and len(summarized) == 4
    # The turn itself ran on the compacted window: the kept user message, the summary,
    # then the new input.
    assert answered[0] == {"role": "user", "content": LONG}
    assert answered[1]["content"].startswith(SUMMARY_PREFIX)
    assert answered[2] == {"role": "user", "content": "What next?"}
    for seen in backend.responses_seen:
        assert "context_management" not in seen.json
    # Continued, the chain forwards the window, this turn and its answer: byte for byte.
    await client.responses.create(model="m", input="And then?", previous_response_id=turn.id)
    assert_append_only([seen.body for seen in backend.responses_seen[-2:]])
    stored = await client.responses.retrieve(turn.id)
    assert [item.type for item in stored.output] == ["compaction", "message"]
    assert stored.usage == turn.usage
    assert proxy.metric("ocxproxy_compactions_total", route="threshold", outcome="completed") == 1
    assert_never_forwarded(backend)


async def test_context_management_in_a_stream(
    proxy: ProxyHandle, http: aiohttp.ClientSession, backend: FakeBackend
) -> None:
    body = {
        "model": "m",
        "input": [{"role": "user", "content": LONG}, {"role": "user", "content": "go"}],
        "stream": True,
        "context_management": MANAGED,
    }
    async with http.post(proxy.base_url + "/responses", json=body) as answer:
        events = sse_payloads(await answer.read())
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[2]["item"]["type"] == "compaction" and events[2]["output_index"] == 0
    rest = [e for e in events[4:] if "output_index" in e]
    assert rest and all(e["output_index"] == 1 for e in rest)
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["compaction", "message"]
    assert final["usage"]["input_tokens"] == billed_input_tokens(backend, 2)
    assert_never_forwarded(backend)


async def test_context_management_under_its_threshold_and_malformed(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    small = await client.responses.create(
        model="m",
        input="short",
        context_management=MANAGED,  # type: ignore[arg-type]
    )
    assert [item.type for item in small.output] == ["message"]
    assert "context_management" not in backend.responses_seen[-1].json
    for bad in ([{"type": "other"}], [{"type": "compaction", "compact_threshold": 10}], "x"):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(
                model="m",
                input="x",
                context_management=bad,  # type: ignore[arg-type]
            )
        assert "context_management" in str(caught.value)
    assert len(backend.responses_seen) == 1


async def test_context_management_over_websocket(
    proxy: ProxyHandle, http: aiohttp.ClientSession, backend: FakeBackend
) -> None:
    ws = await connect(http, proxy)
    first = await create(ws, model="m", input=LONG, store=False)
    events = await create(
        ws,
        model="m",
        input="next",
        previous_response_id=first[-1]["response"]["id"],
        context_management=MANAGED,
    )
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["compaction", "message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    after = await create(ws, model="m", input="more", previous_response_id=final["id"])
    assert after[-1]["type"] == "response.completed"
    assert forwarded_items(backend)[-1][1]["content"].startswith(SUMMARY_PREFIX)
    assert_never_forwarded(backend)
    await ws.close()


async def test_the_threshold_uses_the_chains_real_token_count(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    """Long instructions the backend does not count (the fake counts input items only):
    by its bytes the turn is far past the threshold, by the chain's reported tokens far
    short of it. The count the window is checked with decides: no compaction."""
    client = proxy.client()
    instructions = "Be exact. " * 800  # 8000 bytes
    first = await client.responses.create(model="m", input="hi", instructions=instructions)
    assert first.usage is not None and first.usage.input_tokens < 100
    second = await client.responses.create(
        model="m",
        input="again",
        instructions=instructions,
        previous_response_id=first.id,
        context_management=MANAGED,  # type: ignore[arg-type]
    )
    assert [item.type for item in second.output] == ["message"]
    assert len(backend.responses_seen) == 2  # no summary request
    assert proxy.metric("ocxproxy_compactions_total", route="threshold", outcome="completed") == 0


TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]


@pytest.mark.parametrize("eager", ["unless_none", "always"])
async def test_a_model_that_calls_a_tool_still_writes_the_summary(
    eager: str, make_proxy: MakeProxy
) -> None:
    """A model eager to call tools: the summary request keeps the turn's tools (its cached
    prefix) with tool_choice none; a backend that does not enforce it is asked once more
    without tools. Either way the client gets its compaction item, billed for both."""
    async with FakeBackend(eager_tools=eager) as backend:  # type: ignore[arg-type]
        proxy = await make_proxy(backend.url)
        client = proxy.client()
        answer = await client.responses.create(
            model="m",
            input=[*HISTORY, TRIGGER],  # type: ignore[list-item]
            tools=TOOLS,  # type: ignore[list-item]
        )
        compaction_item(answer.output)
        asked = backend.responses_seen
        assert asked[0].json["tool_choice"] == "none" and asked[0].json["tools"] == TOOLS
        if eager == "always":
            assert len(asked) == 2 and "tools" not in asked[1].json
            assert answer.usage is not None
            assert answer.usage.input_tokens == billed_input_tokens(backend, 2)
        else:
            assert len(asked) == 1
        retries = proxy.metric("ocxproxy_compaction_retries_total", route="trigger")
        assert retries == (1 if eager == "always" else 0)
        compacted = await client.responses.compact(
            model="m",
            input=HISTORY,  # type: ignore[arg-type]
            extra_body={"tools": TOOLS},  # as Codex sends them
        )
        assert compacted.output[-1].type == "compaction"


async def test_a_compacted_conversation_forwards_its_window(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    """After a compaction, a conversation keeps every item but forwards the compacted
    window: its user messages, a call still waiting for its output, the summary, then
    what came after; the same bytes every turn."""
    client = proxy.client()
    conv = await client.conversations.create(items=[HISTORY[1]])  # type: ignore[list-item]
    lookup = await client.responses.create(
        model="m", input="Look it up. CALL:lookup", conversation=conv.id
    )
    answered = {
        "type": "function_call_output",
        "call_id": lookup.output[-1].call_id,  # type: ignore[union-attr]
        "output": "not there, CALL:grep",
    }
    grep = await client.responses.create(model="m", input=[answered], conversation=conv.id)  # type: ignore[list-item]
    call = grep.output[-1]
    assert call.type == "function_call"
    await client.responses.create(model="m", input=[TRIGGER], conversation=conv.id)  # type: ignore[list-item]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "found"}
    await client.responses.create(model="m", input=[output], conversation=conv.id)  # type: ignore[list-item]
    await client.responses.create(model="m", input="And now?", conversation=conv.id)
    first, second = forwarded_items(backend)[-2:]
    assert [item.get("content") for item in first[:2]] == [
        HISTORY[1]["content"],
        "Look it up. CALL:lookup",
    ]
    assert first[2]["type"] == "function_call" and first[2]["call_id"] == call.call_id
    assert first[3]["content"].startswith(SUMMARY_PREFIX)
    assert first[4] == output and len(first) == 5
    assert_append_only([seen.body for seen in backend.responses_seen[-2:]])
    assert second[-1]["content"] == "And now?"
    # The earlier answers, and the answered call, are summarized, not forwarded.
    assert sum(1 for item in second if item.get("type") == "function_call") == 1
    assert not any(item.get("role") == "assistant" for item in second[:4])
    assert not any(item.get("call_id") == answered["call_id"] for item in second)
    listed = await client.conversations.items.list(conv.id, limit=100)
    assert len(listed.data) > len(second)  # the conversation keeps every item
    assert_never_forwarded(backend)


async def test_prewarm_sends_the_compacted_window_ahead_of_the_next_turn(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    """With --compaction-prewarm, after a compaction the backend gets the compacted
    window (one output token), off the reply path; the next turn starts with those bytes,
    so its prefix is cached."""
    proxy = await make_proxy(backend.url, compaction_prewarm=True)
    client = proxy.client()
    fields: dict[str, Any] = {"model": "m", "instructions": "Be terse.", "tools": TOOLS}
    first = await client.responses.create(input=LONG, **fields)
    compaction = await client.responses.create(
        input=[TRIGGER],  # type: ignore[list-item]
        previous_response_id=first.id,
        **fields,
    )
    await backend.wait_for(lambda: len(backend.responses_seen) == 3)
    warm = backend.responses_seen[2]
    assert warm.json["max_output_tokens"] == 1 and warm.json["stream"] is False
    assert warm.json["input"][-1]["content"].startswith(SUMMARY_PREFIX)
    assert warm.json["tools"] == TOOLS  # as the client sent them: the Response's are a copy
    async with asyncio.timeout(5):
        while not proxy.metric("ocxproxy_compaction_prewarms_total", outcome="completed"):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    after = await client.responses.create(
        input="What next?", previous_response_id=compaction.id, **fields
    )
    sent = backend.responses_seen[3]
    assert top_level_span(sent.body, "input").startswith(top_level_span(warm.body, "input")[:-1])
    assert sent.json["instructions"] == warm.json["instructions"]
    assert sent.json["tools"] == warm.json["tools"]
    assert after.usage is not None
    assert after.usage.input_tokens_details.cached_tokens >= 0.9 * after.usage.input_tokens
    assert_never_forwarded(backend)
