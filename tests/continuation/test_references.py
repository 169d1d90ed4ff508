"""continuation/references.py and echo.py: finding item references, splicing the stored
items in, and echoing `previous_response_id` in the bytes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ocxproxy.continuation.echo import echo_member
from ocxproxy.continuation.references import references, splice
from ocxproxy.errors import InvalidRequest

USER = {"role": "user", "content": "hi"}
REF = {"type": "item_reference", "id": "msg_1"}


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([], {}),
        ([USER, "text", 5, None], {}),
        ([USER, REF, USER], {1: "msg_1"}),
        ([{"id": "rs_2"}, {"type": None, "id": "fc_3"}], {0: "rs_2", 1: "fc_3"}),  # type left out
        ([{"id": "msg_4", "role": "assistant", "content": "x"}], {}),  # a message with an id
        ([{"type": "reasoning", "id": "rs_5", "summary": []}], {}),  # a full item with an id
        ([{"type": "item_reference", "id": "a"}, REF], {0: "a", 1: "msg_1"}),
    ],
)
def test_references_found(items: list[Any], expected: dict[int, str]) -> None:
    assert references(items) == expected


@pytest.mark.parametrize(
    "item",
    [
        {"type": "item_reference"},
        {"type": "item_reference", "id": 5},
        {"type": "item_reference", "id": ""},
        {"id": None},
        {"id": ["msg_1"]},
    ],
)
def test_a_reference_without_an_id_is_refused(item: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        references([USER, item])
    assert (info.value.param, info.value.status) == ("input", 400)
    assert "input[1]" in info.value.message


def test_splice_puts_the_stored_bytes_in_place() -> None:
    stored = b'{"id":"msg_1", "type":"message","role":"assistant","content":"caf\\u00e9"}'
    parts = [b'{"role":"user","content":"hi"}', orjson.dumps(REF), b"3"]
    items = [USER, REF, 3]
    new_parts, new_items = splice(parts, items, {1: stored})
    assert new_parts == [parts[0], stored, b"3"]  # the stored bytes, verbatim
    assert new_items == [USER, orjson.loads(stored), 3]
    assert (parts[1], items[1]) == (orjson.dumps(REF), REF)  # the inputs are not changed
    assert splice(parts, items, {}) == (parts, items)


# -- echo_member ---------------------------------------------------------------------------

RID = "resp_prev"


def echo_previous_id(data: bytes, previous_id: str, *, in_event: bool = False) -> bytes:
    return echo_member(data, "previous_response_id", previous_id, in_event=in_event)


@pytest.mark.parametrize(
    ("data", "in_event", "expected"),
    [
        (
            b'{"id":"r","previous_response_id":null}',
            False,
            {"id": "r", "previous_response_id": RID},
        ),
        (b'{"id":"r", "previous_response_id" : null }', False, None),
        (b'{"id":"r"}', False, None),  # absent: inserted
        (b"{}", False, {"previous_response_id": RID}),
        (b' { "id" : "r" }', False, None),
        (
            b'{"type":"response.created","response":{"id":"r","previous_response_id":null}}',
            True,
            None,
        ),
        (b'{"type":"response.created","response":{"id":"r"},"sequence_number":0}', True, None),
        (b'{"type":"response.in_progress","response" : {}}', True, None),
    ],
)
def test_echo_sets_a_null_or_absent_previous_id(
    data: bytes, in_event: bool, expected: dict[str, Any] | None
) -> None:
    patched = orjson.loads(echo_previous_id(data, RID, in_event=in_event))
    response = patched["response"] if in_event else patched
    assert response["previous_response_id"] == RID
    original = orjson.loads(data)
    original_response = original["response"] if in_event else original
    assert {k: v for k, v in response.items() if k != "previous_response_id"} == {
        k: v for k, v in original_response.items() if k != "previous_response_id"
    }
    if expected is not None:
        assert patched == expected


@pytest.mark.parametrize(
    ("data", "in_event"),
    [
        (b'{"id":"r","previous_response_id":"resp_other"}', False),  # a stateful backend's own
        (b'{"type":"response.created","response":{"previous_response_id":"x"}}', True),
        (b"[]", False),
        (b"not json", False),
        (b'{"type":"response.output_text.delta","delta":"x"}', True),  # no response in it
    ],
)
def test_echo_leaves_what_it_must_not_touch(data: bytes, in_event: bool) -> None:
    assert echo_previous_id(data, RID, in_event=in_event) == data


def test_echo_ignores_the_member_name_inside_strings() -> None:
    """Text that spells the member (escaped quotes) is content, not the member."""
    text = '"previous_response_id":null'
    data = orjson.dumps({"id": "r", "output": [{"text": text}], "previous_response_id": None})
    patched = orjson.loads(echo_previous_id(data, RID))
    assert patched["output"][0]["text"] == text
    assert patched["previous_response_id"] == RID


@pytest.mark.parametrize("data", [b'{"id":"r"}', b'{"id":"r","previous_response_id":null}'])
def test_echo_escapes_the_id(data: bytes) -> None:
    odd = 'resp_"quoted"\\1\\g<0>'
    assert orjson.loads(echo_previous_id(data, odd))["previous_response_id"] == odd


CONV = {"id": "conv_1"}


@pytest.mark.parametrize(
    ("data", "in_event"),
    [
        (b'{"id":"r","conversation":null,"previous_response_id":null}', False),
        (b'{"id":"r"}', False),
        (b'{"type":"response.completed","response":{"id":"r","conversation":null}}', True),
        (b'{"type":"response.created","response":{"id":"r"},"sequence_number":0}', True),
    ],
)
def test_echo_sets_a_null_or_absent_conversation(data: bytes, in_event: bool) -> None:
    patched = orjson.loads(echo_member(data, "conversation", CONV, in_event=in_event))
    response = patched["response"] if in_event else patched
    original = orjson.loads(data)
    original_response = original["response"] if in_event else original
    assert response == {**original_response, "conversation": CONV}


def test_echo_keeps_a_conversation_the_backend_named() -> None:
    data = b'{"id":"r","conversation":{"id":"conv_other"}}'
    assert echo_member(data, "conversation", CONV) == data
