"""continuation/references.py: finding item references and splicing the stored items in."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

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
