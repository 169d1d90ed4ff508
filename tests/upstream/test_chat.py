"""Responses ↔ Chat Completions translation (upstream/chat.py, chat_stream.py): pure, no
event loop; tables of requests in and chat bodies out, chunks in and events out."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from ocxproxy.errors import InvalidRequest
from ocxproxy.upstream.chat import ChatRequest, chat_error, chat_messages, to_chat
from ocxproxy.upstream.chat_stream import ChatStream, usage_of
from tests.http.helpers import sse_payloads

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a":1}'}
CALL_2 = {**CALL, "call_id": "call_2", "name": "g"}


def tool_call(item: dict[str, Any]) -> dict[str, Any]:
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


# -- requests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "messages"),
    [
        ("hi", [{"role": "user", "content": "hi"}]),
        ([{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}]),
        (
            [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]}],
            [{"role": "user", "content": "a"}],
        ),
        (
            [{"role": "developer", "content": "rules"}, {"role": "system", "content": "more"}],
            [{"role": "system", "content": "rules"}, {"role": "system", "content": "more"}],
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {
                            "type": "input_image",
                            "image_url": "data:image/png;base64,AA",
                            "detail": "low",
                        },
                    ],
                }
            ],
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,AA", "detail": "low"},
                        },
                    ],
                }
            ],
        ),
        (  # a replayed assistant output message: its text, as a string
            [
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": "x", "annotations": []},
                        {"type": "output_text", "text": "y", "annotations": []},
                    ],
                }
            ],
            [{"role": "assistant", "content": "xy"}],
        ),
        (  # consecutive calls: one assistant message
            [CALL, CALL_2],
            [{"role": "assistant", "tool_calls": [tool_call(CALL), tool_call(CALL_2)]}],
        ),
        (  # text right before calls joins them; outputs become tool messages
            [
                {"role": "assistant", "content": "checking"},
                CALL,
                {"type": "function_call_output", "call_id": "call_1", "output": "42"},
                {
                    "type": "function_call_output",
                    "call_id": "call_1",
                    "output": [
                        {"type": "input_text", "text": "4"},
                        {"type": "input_text", "text": "2"},
                    ],
                },
            ],
            [
                {"role": "assistant", "content": "checking", "tool_calls": [tool_call(CALL)]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}],
                },
            ],
        ),
        (  # a tool message ends the run: the next call starts a new assistant message
            [CALL, {"type": "function_call_output", "call_id": "call_1", "output": "o"}, CALL_2],
            [
                {"role": "assistant", "tool_calls": [tool_call(CALL)]},
                {"role": "tool", "tool_call_id": "call_1", "content": "o"},
                {"role": "assistant", "tool_calls": [tool_call(CALL_2)]},
            ],
        ),
        (  # reasoning is remembered, not sent
            [
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e"},
                {"role": "user", "content": "q"},
            ],
            [{"role": "user", "content": "q"}],
        ),
    ],
)
def test_items_become_messages(items: Any, messages: list[dict[str, Any]]) -> None:
    assert chat_messages(items) == messages


def test_full_request_mapping() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": "hi",
        "tools": [
            {"type": "function", "name": "f", "description": "d", "parameters": {}, "strict": True}
        ],
        "tool_choice": {"type": "function", "name": "f"},
        "parallel_tool_calls": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_output_tokens": 100,
        "text": {
            "format": {
                "type": "json_schema",
                "name": "s",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
        "reasoning": {"effort": "low", "summary": "auto"},
        "stream": True,
        "store": False,
        "metadata": {"k": "v"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "pck",
        "client_metadata": {"x": 1},
    }
    chat = to_chat(body)
    assert chat.body == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {}, "strict": True},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 100,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": True},
        },
        "reasoning_effort": "low",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert chat.stream
    assert to_chat({"input": "x", "text": {"format": {"type": "json_object"}}}).body[
        "response_format"
    ] == {"type": "json_object"}
    assert (
        "response_format" not in to_chat({"input": "x", "text": {"format": {"type": "text"}}}).body
    )


def test_translation_is_deterministic() -> None:
    body = {"model": "m", "input": [{"role": "user", "content": "a"}, CALL], "tools": []}
    assert to_chat(body).encode() == to_chat(orjson.loads(orjson.dumps(body))).encode()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"instructions": [{"role": "system", "content": "x"}]}, "instructions"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}]},
            "input[0].content[0]",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image", "image_url": "u"}],
                    }
                ]
            },
            "input[0].output[0]",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]"),
    ],
)
def test_unsupported_features_name_their_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        to_chat({"model": "m", "input": "x", **body})
    assert info.value.param == param and info.value.status == 400


def test_harmless_defaults_are_accepted() -> None:
    to_chat({"input": "x", "background": False, "truncation": "disabled", "top_logprobs": 0})


# -- answers -------------------------------------------------------------------------------


def ids() -> Any:
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{next(counter)}"


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "c", "created": 7, "model": "llama", "choices": choices, **extra}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def run(
    chunks: list[bytes], *, request: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], ChatStream]:
    stream = ChatStream(
        to_chat(request or {"model": "m", "input": "x", "stream": True}),
        new_id=ids(),
        now=lambda: 9,
    )
    raw = b"".join(stream.feed(c) for c in chunks) + stream.end()
    events = sse_payloads(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(raw_event.startswith(b"event: ") for raw_event in raw.split(b"\n\n") if raw_event)
    return events, stream


USAGE = {
    "prompt_tokens": 30,
    "completion_tokens": 4,
    "total_tokens": 34,
    "prompt_tokens_details": {"cached_tokens": 28},
}


def test_text_stream_event_order_and_final_response() -> None:
    events, stream = run(
        [
            chunk({"role": "assistant", "content": None}),
            chunk({"content": "Hel"}),
            chunk({"content": "lo"}),
            chunk({}, "stop"),
            chunk(None, usage=USAGE),
            b"data: [DONE]\n\n",
        ]
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    assert events[2]["item"] == {
        "id": "msg_1",
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    assert events[4] == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "Hel",
        "logprobs": [],
    }
    final = events[-1]["response"]
    assert final == stream.response
    assert final["id"] == "resp_0" and final["created_at"] == 7 and final["completed_at"] == 9
    assert final["model"] == "llama" and final["status"] == "completed"
    assert final["output"] == [
        {
            "id": "msg_1",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
            ],
        }
    ]
    assert final["usage"] == {
        "input_tokens": 30,
        "input_tokens_details": {"cached_tokens": 28},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 34,
    }


def test_tool_call_stream_waits_for_the_name_and_closes_at_finish() -> None:
    events, stream = run(
        [
            chunk({"role": "assistant"}),
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_a",
                            "type": "function",
                            "function": {"arguments": '{"x"'},
                        }
                    ]
                }
            ),
            chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ":1}"}}]}),
            chunk(
                {
                    "tool_calls": [
                        {"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}
                    ]
                }
            ),
            chunk({}, "tool_calls"),
            b"data: [DONE]\n\n",
        ]
    )
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2]["item"]["call_id"] == "call_a" and events[2]["item"]["name"] == "f"
    assert events[3]["delta"] == '{"x":1}'
    assert stream.response is not None
    assert [
        (i["call_id"], i["name"], i["arguments"], i["status"]) for i in stream.response["output"]
    ] == [
        ("call_a", "f", '{"x":1}', "completed"),
        ("call_b", "g", "{}", "completed"),
    ]
    assert stream.response["usage"] is None  # no include_usage chunk came


def test_length_is_incomplete_with_max_output_tokens() -> None:
    events, _ = run([chunk({"content": "cut"}), chunk({}, "length"), chunk(None, usage=USAGE)])
    assert events[-1]["type"] == "response.incomplete"
    response = events[-1]["response"]
    assert response["status"] == "incomplete" and response["completed_at"] is None
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 28


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([chunk({"content": "a"}), b'data: {"error":{"message":"boom","code":500}}\n\n'], "boom"),
        (
            [chunk({"content": "a"})],
            "The backend ended the stream before the response was finished.",
        ),
        ([], "The backend ended the stream before the response was finished."),
        ([b'data: {"error":"Input validation error"}\n\n'], "Input validation error"),
        ([b'data: {"object":"error","message":"oom","code":500}\n\n'], "oom"),
    ],
)
def test_broken_streams_end_failed(chunks: list[bytes], message: str) -> None:
    events, stream = run(chunks)
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": message}
    assert stream.response is not None and stream.response["status"] == "failed"


def test_reasoning_content_becomes_a_reasoning_item_before_the_message() -> None:
    events, stream = run(
        [
            chunk({"reasoning_content": "hmm"}),
            chunk({"content": "ok"}),
            chunk({}, "stop"),
            b"data: [DONE]\n\n",
        ]
    )
    assert stream.response is not None
    reasoning, message = stream.response["output"]
    assert reasoning == {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hmm"}],
    }
    assert message["content"][0]["text"] == "ok" and message["id"] == "msg_2"
    assert "response.reasoning_text.delta" in [e["type"] for e in events]


def test_an_empty_answer_is_still_one_message() -> None:
    _, stream = run(
        [chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), b"data: [DONE]\n\n"]
    )
    assert stream.response is not None
    [message] = stream.response["output"]
    assert message["content"][0]["text"] == ""


def test_split_sse_lines_and_missing_done_are_fine() -> None:
    raw = chunk({"content": "ab"}) + chunk({}, "stop")
    events, stream = run([raw[i : i + 5] for i in range(0, len(raw), 5)])
    assert events[-1]["type"] == "response.completed"
    assert (
        stream.response is not None and stream.response["output"][0]["content"][0]["text"] == "ab"
    )


def test_a_whole_completion_gives_the_same_response_as_its_stream() -> None:
    completion = {
        "id": "c",
        "created": 7,
        "model": "llama",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "Let me see.",
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
        "usage": USAGE,
    }
    whole = ChatStream(to_chat({"input": "x"}), new_id=ids(), now=lambda: 9)
    events = sse_payloads(whole.feed_completion(completion) + whole.end())
    _, streamed = run(
        [
            chunk({"role": "assistant", "content": "Let me see."}),
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": "{}"}}
                    ]
                }
            ),
            chunk({}, "tool_calls", usage=USAGE),
        ],
        request={"input": "x"},
    )
    assert whole.response == streamed.response
    assert events[-1]["type"] == "response.completed"


def test_a_completion_that_is_not_one_fails() -> None:
    stream = ChatStream(to_chat({"input": "x"}))
    stream.feed_completion({"object": "list"})
    stream.end()
    assert stream.response is not None and stream.response["status"] == "failed"


def test_usage_mapping_defaults() -> None:
    assert usage_of(None) is None
    assert usage_of({"prompt_tokens": 3, "completion_tokens": 2}) == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
    }


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (
            400,
            b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}',
            {  # a context overflow is OpenAI's (CONTRACT.md C10)
                "message": "too long",
                "type": "invalid_request_error",
                "param": "input",
                "code": "context_length_exceeded",
            },
        ),
        (
            400,
            b'{"object":"error","message":"bad","type":"BadRequestError","param":"messages","code":400}',
            {
                "message": "bad",
                "type": "BadRequestError",
                "param": "messages",
                "code": "invalid_request_error",  # never null: the status's (not 400)
            },
        ),
        (
            422,
            b'{"error":"Input validation error","error_type":"validation"}',
            {
                "message": "Input validation error",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_request_error",
            },
        ),
        (
            503,
            b"upstream overloaded",
            {
                "message": "upstream overloaded",
                "type": "server_error",
                "param": None,
                "code": "server_error",
            },
        ),
        (
            500,
            b"",
            {
                "message": "The backend answered 500.",
                "type": "server_error",
                "param": None,
                "code": "server_error",
            },
        ),
        (
            429,
            b'{"error":{"message":"slow down","type":"rate_limit_exceeded",'
            b'"code":"rate_limit_exceeded"}}',
            {
                "message": "slow down",
                "type": "rate_limit_exceeded",
                "param": None,
                "code": "rate_limit_exceeded",
            },
        ),
    ],
)
def test_chat_errors_become_openai_errors(status: int, body: bytes, error: dict[str, Any]) -> None:
    assert orjson.loads(chat_error(status, body)) == {"error": error}


def test_chat_request_is_a_value() -> None:
    request = to_chat({"model": "m", "input": "x"})
    assert isinstance(request, ChatRequest)
    assert (
        request.encode()
        == b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":false}'
    )
