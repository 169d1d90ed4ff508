"""The pure parts of conversations: item splitting, ids, views, pages, metadata."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ocxproxy.continuation.conversation import (
    Meta,
    assign_ids,
    check_items,
    check_metadata,
    conversation_id_of,
    split_items,
)
from ocxproxy.continuation.listing import ListQuery, item_view, page, parse_list_query
from ocxproxy.errors import InvalidRequest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@given(st.lists(json_values, min_size=1, max_size=6))
def test_split_items_returns_each_value_as_stored(values: list[Any]) -> None:
    encoded = [orjson.dumps(v) for v in values]
    assert split_items(b",".join(encoded)) == encoded


def test_split_items_keeps_a_clients_own_spelling() -> None:
    data = b'{"a": [1, 2], "b": "x,y"} , {"c":{"d":"}"}}'
    assert split_items(data) == [b'{"a": [1, 2], "b": "x,y"}', b'{"c":{"d":"}"}}']
    assert split_items(b"") == []


def test_assign_ids_keeps_unique_own_ids_and_mints_the_rest() -> None:
    taken = {"msg_old"}
    items = [
        {"type": "message", "id": "msg_old", "role": "user", "content": "x"},
        {"role": "user", "content": "y"},
        {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": ""},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
        {"type": "function_call", "id": "fc_1", "call_id": "d", "name": "f", "arguments": ""},
    ]
    ids = assign_ids(items, taken)
    assert ids[0].startswith("msg_") and ids[0] != "msg_old"
    assert ids[1].startswith("msg_")
    assert ids[2] == "fc_1"
    assert ids[3].startswith("fco_")
    assert ids[4].startswith("fc_") and ids[4] != "fc_1"
    assert len(set(ids)) == 5 and taken >= set(ids)


def test_item_view_types_messages_and_honours_include() -> None:
    view = item_view({"role": "assistant", "content": "hi"}, "msg_1")
    assert view == {
        "id": "msg_1",
        "role": "assistant",
        "type": "message",
        "status": "completed",
        "content": [{"type": "output_text", "text": "hi"}],
    }
    part = {"type": "output_text", "text": "t", "logprobs": [1]}
    message = {"type": "message", "role": "assistant", "content": [part]}
    assert "logprobs" not in item_view(message, "m")["content"][0]
    kept = item_view(message, "m", frozenset({"message.output_text.logprobs"}))
    assert kept["content"][0]["logprobs"] == [1]
    reasoning = {"type": "reasoning", "id": "rs_own", "summary": [], "encrypted_content": "E"}
    assert "encrypted_content" not in item_view(reasoning, "rs_own")
    assert (
        item_view(reasoning, "rs_own", frozenset({"reasoning.encrypted_content"}))[
            "encrypted_content"
        ]
        == "E"
    )


def test_page_in_both_orders_with_after() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    first = page(items, ListQuery(None, 2, "desc", frozenset()))
    assert [i["id"] for i in first["data"]] == ["i4", "i3"] and first["has_more"]
    assert (first["first_id"], first["last_id"]) == ("i4", "i3")
    rest = page(items, ListQuery("i3", 10, "desc", frozenset()))
    assert [i["id"] for i in rest["data"]] == ["i2", "i1", "i0"] and not rest["has_more"]
    asc = page(items, ListQuery("i1", 2, "asc", frozenset()))
    assert [i["id"] for i in asc["data"]] == ["i2", "i3"] and asc["has_more"]
    empty = page([], ListQuery(None, 20, "desc", frozenset()))
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None,
                     "has_more": False}  # fmt: skip
    with pytest.raises(InvalidRequest):
        page(items, ListQuery("nope", 2, "asc", frozenset()))


@pytest.mark.parametrize(
    "query",
    [{"limit": "0"}, {"limit": "101"}, {"limit": "x"}, {"order": "sideways"}],
)
def test_bad_list_queries(query: dict[str, str]) -> None:
    with pytest.raises(InvalidRequest):
        parse_list_query(query, [])


def test_list_query_defaults_and_include() -> None:
    query = parse_list_query({}, ["reasoning.encrypted_content"])
    assert (query.after, query.limit, query.order) == (None, 20, "desc")
    with pytest.raises(InvalidRequest):
        parse_list_query({}, ["bogus"])


def test_metadata_and_items_limits() -> None:
    assert check_metadata(None) == {}
    assert check_metadata({"a": "b"}) == {"a": "b"}
    for bad in (
        "x",
        {f"k{i}": "v" for i in range(17)},
        {"k": 1},
        {"k" * 65: "v"},
        {"k": "v" * 513},
    ):
        with pytest.raises(InvalidRequest):
            check_metadata(bad)
    assert check_items(None, required=False) == []
    for bad_items in (None, "x", [1], [{}] * 21):
        with pytest.raises(InvalidRequest):
            check_items(bad_items, required=True)


def test_conversation_field_forms() -> None:
    assert conversation_id_of({}) is None
    assert conversation_id_of({"conversation": "conv_a"}) == "conv_a"
    assert conversation_id_of({"conversation": {"id": "conv_b"}}) == "conv_b"
    for bad in (1, "", {"id": 3}, {}):
        with pytest.raises(InvalidRequest):
            conversation_id_of({"conversation": bad})


def test_meta_round_trips_and_finds_items() -> None:
    meta = Meta(5, {"k": "v"}, [["a", "b"], ["c"]])
    head = meta.encode()
    assert b'"a"' not in head  # the ids are kept beside the head, not in it
    again = Meta.decode(head, meta.ids)
    assert again == meta
    # A conversation an earlier release wrote: its head holds the ids.
    legacy = b'{"created_at":5,"metadata":{"k":"v"},"ids":[["a","b"],["c"]]}'
    assert Meta.decode(legacy, None) == meta
    assert again.find("c") == (1, 0) and again.find("b") == (0, 1) and again.find("z") is None
    assert again.all_ids() == {"a", "b", "c"}
