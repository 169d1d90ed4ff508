"""continuation/expand.py: request checks, byte-splicing expansion, call-id bindings."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ocxproxy.continuation.expand import (
    call_ids_of,
    check_call_bindings,
    expand,
    parse_request,
    raw_input_items,
    serialize_items,
    tail_as_sent,
)
from ocxproxy.errors import InvalidRequest
from ocxproxy.model import Record, Segment, chain_of

USER = {"role": "user", "content": "hi"}


def record_with(*segments: Segment) -> Record:
    response = Segment(b"{}", 0, frozenset(), durable=True)
    return Record("resp_1", "scope", 0.0, 1e9, True, chain_of(segments), response)


def segment(items: list[Any]) -> Segment:
    encoded = serialize_items(items)
    return Segment(b",".join(encoded), len(encoded), call_ids_of(items), durable=True)


# -- parse_request ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "prev", "stream", "store", "items"),
    [
        ({}, None, False, True, []),
        ({"input": "hi"}, None, False, True, [USER]),
        ({"input": [USER], "stream": True}, None, True, True, [USER]),
        ({"input": [], "store": False}, None, False, False, []),
        ({"previous_response_id": "resp_x", "input": None}, "resp_x", False, True, []),
        ({"stream": None, "conversation": None, "previous_response_id": "r"}, "r", False, True, []),
    ],
)
def test_parse_request_reads_fields(
    body: dict[str, Any], prev: str | None, stream: bool, store: bool, items: list[Any]
) -> None:
    request = parse_request(orjson.dumps(body))
    assert request.body == body
    assert (request.previous_response_id, request.stream, request.store) == (prev, stream, store)
    assert request.items == items


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{", None, "invalid_request_error"),
        (b"", None, "invalid_request_error"),
        (b"[1, 2]", None, "invalid_request_error"),
        (b'"text"', None, "invalid_request_error"),
        (b'{"previous_response_id": 5}', "previous_response_id", "invalid_type"),
        (b'{"previous_response_id": ""}', "previous_response_id", "invalid_type"),
        (b'{"previous_response_id": ["r"]}', "previous_response_id", "invalid_type"),
        (b'{"input": 5}', "input", "invalid_type"),
        (b'{"input": {"role": "user"}}', "input", "invalid_type"),
        (b'{"store": "yes"}', "store", "invalid_type"),
        (b'{"store": null}', "store", "invalid_type"),
        (b'{"stream": "true"}', "stream", "invalid_type"),
        (
            b'{"previous_response_id": "r", "conversation": "conv_1"}',
            "previous_response_id",
            "mutually_exclusive_parameters",
        ),
    ],
)
def test_parse_request_rejects(raw: bytes, param: str | None, code: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw)
    error = info.value.to_openai_error()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code)
    assert info.value.status == 400


# -- expand -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "history", "tail", "expected"),
    [
        (
            {"model": "m", "previous_response_id": "r", "input": "x"},
            [b"1,2", b"3"],
            [b"4"],
            b'{"model":"m","input":[1,2,3,4]}',
        ),
        (
            {"previous_response_id": "r", "input": [5, 6]},
            [b"1"],
            [b"5", b"6"],
            b'{"input":[1,5,6]}',
        ),
        ({"previous_response_id": "r"}, [b"1"], [], b'{"input":[1]}'),
        ({"previous_response_id": "r"}, [], [], b'{"input":[]}'),
        ({"previous_response_id": "r", "input": []}, [], [b"7"], b'{"input":[7]}'),
        (
            {"input": "x", "stream": True, "previous_response_id": "r", "store": False},
            [b'{"a":1}'],
            [b'{"b":2}'],
            b'{"stream":true,"store":false,"input":[{"a":1},{"b":2}]}',
        ),
    ],
)
def test_expand_splices_bytes(
    body: dict[str, Any], history: list[bytes], tail: list[bytes], expected: bytes
) -> None:
    assert expand(body, history, tail) == expected
    assert orjson.loads(expected)  # always valid JSON


def test_expand_keeps_history_bytes_verbatim() -> None:
    """Stored bytes are spliced, never re-encoded: odd spacing and escapes survive."""
    odd = b'{"role" : "user",  "content":"caf\\u00e9"}'
    forwarded = expand({"previous_response_id": "r", "input": "next"}, [odd], [b'"t"'])
    assert forwarded == b'{"input":[' + odd + b',"t"]}'


def test_expand_drops_only_previous_response_id_and_input() -> None:
    body = {"instructions": "be brief", "tools": [], "previous_response_id": "r", "input": "x"}
    forwarded = orjson.loads(expand(body, [b"1"], [b"2"]))
    assert forwarded == {"instructions": "be brief", "tools": [], "input": [1, 2]}


# -- raw_input_items ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"input": [ {"role" : "user"} , 1,"x\\"]" ]}', [b'{"role" : "user"}', b"1", b'"x\\"]"']),
        (b'{"model":"m","input":[[1,[2]],{"a":{"b":[]}}],"z":1}', [b"[1,[2]]", b'{"a":{"b":[]}}']),
        (b'{"meta":{"input":[9]},"input":[3]}', [b"3"]),  # only the top-level key
        (b'{"in\\u0070ut":[4]}', [b"4"]),  # an escaped key is still "input"
        (b'{"input":[1],"input":[2]}', [b"2"]),  # the last duplicate wins, as in the parse
        (b'{"input" :\r\n[\t1 ,\n2\t]}', [b"1", b"2"]),
        (b'{"input":[]}', []),
        (b'{"input":"text"}', None),
        (b'{"model":"m"}', None),
        (b'{"input":null}', None),
    ],
)
def test_raw_input_items(raw: bytes, expected: list[bytes] | None) -> None:
    assert raw_input_items(raw) == expected
    if expected is not None:  # the spans are exactly the parsed items
        assert [orjson.loads(span) for span in expected] == orjson.loads(raw)["input"]


# -- check_call_bindings ------------------------------------------------------------------

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
CUSTOM = {"type": "custom_tool_call", "call_id": "call_c", "name": "g", "input": ""}


def output(call_id: Any, kind: str = "function_call_output") -> dict[str, Any]:
    return {"type": kind, "call_id": call_id, "output": "ok"}


@pytest.mark.parametrize(
    ("history", "items"),
    [
        ([CALL], [output("call_1")]),
        ([CUSTOM], [output("call_c", "custom_tool_call_output")]),
        ([CALL], [USER]),
        ([], [{**CALL, "call_id": "call_new"}, output("call_new")]),  # call sent alongside
        ([USER], ["plain string item", USER]),
    ],
)
def test_bindings_accepted(history: list[Any], items: list[Any]) -> None:
    check_call_bindings(items, record_with(segment(history)))


@pytest.mark.parametrize(
    ("history", "items"),
    [
        ([CALL], [output("call_2")]),
        ([USER], [output("call_1")]),
        ([CALL], [output(None)]),
        ([CALL], [output(7)]),
        ([output("call_9")], [output("call_9")]),  # an output is not a call
        ([CUSTOM], [output("call_x", "custom_tool_call_output")]),
    ],
)
def test_bindings_rejected(history: list[Any], items: list[Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_call_bindings(items, record_with(segment(history)))
    assert info.value.param == "input"
    assert info.value.status == 400


def test_call_ids_of_ignores_outputs_and_junk() -> None:
    items = [CALL, CUSTOM, output("call_o"), {"call_id": 3, "type": "function_call"}, "s", None]
    assert call_ids_of(items) == {"call_1", "call_c"}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"input":"hi"}', [b'{"role":"user","content":"hi"}']),
        (b'{"input":[{"role":"user","content":"hi"}]}', [b'{"role":"user","content":"hi"}']),
        (b'{"input": [{"content": "hi", "role": "user"}]}', [b'{"content": "hi", "role": "user"}']),
        (b'{"input": [1, {"a": 2}]}', [b"1", b'{"a": 2}']),
        (b'{"input":["caf\\u00e9"]}', [b'"caf\\u00e9"']),
        (b'{"input":[ ]}', []),
        (b'{"model":"m"}', []),
    ],
)
def test_tail_as_sent_keeps_the_clients_bytes(raw: bytes, expected: list[bytes]) -> None:
    assert tail_as_sent(raw, parse_request(raw)) == expected
