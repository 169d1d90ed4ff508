"""continuation/record.py: which finished responses are remembered (CONTRACT.md C1.6),
and as what."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ocxproxy.continuation.record import build_turn, not_recordable_reason
from ocxproxy.store.output import split_output

MESSAGE = {"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}
CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}


def response(**fields: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "output": [MESSAGE], **fields}


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        (response(status="completed"), None),
        (response(), None),  # no status: a completed non-streaming answer
        (response(status="incomplete", incomplete_details={"reason": "max_output_tokens"}), None),
        (
            response(status="incomplete", incomplete_details={"reason": "content_filter"}),
            "incomplete",
        ),
        (response(status="incomplete", incomplete_details=None), "incomplete"),
        (response(status="incomplete"), "incomplete"),
        (response(status="failed"), "failed"),
        (response(status="cancelled"), "cancelled"),
        (response(status="in_progress"), "in_progress"),
        (response(status="queued"), "queued"),
        (response(status=3), "malformed"),
        ({"id": "resp_1", "status": "completed"}, "malformed"),  # no output
        ({"output": [], "status": "completed"}, "malformed"),  # no id
        (response(id=5), "malformed"),
        (response(output={}), "malformed"),
        (None, "malformed"),
        ([], "malformed"),
        ("completed", "malformed"),
    ],
)
def test_not_recordable_reason(candidate: Any, reason: str | None) -> None:
    assert not_recordable_reason(candidate) == reason


@pytest.mark.parametrize(
    ("tail", "tail_items", "output", "items", "n_items", "call_ids"),
    [
        ([b'{"role":"user","content":"a"}'], [{}], [MESSAGE], None, 2, set()),
        ([], [], [MESSAGE], orjson.dumps(MESSAGE), 1, set()),
        ([b'"t"'], ["t"], [], b'"t"', 1, set()),
        ([], [], [], b"", 0, set()),
        ([b"1"], [{"type": "function_call", "call_id": "c0"}], [CALL], None, 2, {"c0", "call_1"}),
        ([b"1", b"2"], [1, 2], [], b"1,2", 2, set()),
    ],
)
def test_build_turn_is_tail_then_output(
    tail: list[bytes],
    tail_items: list[Any],
    output: list[Any],
    items: bytes | None,
    n_items: int,
    call_ids: set[str],
) -> None:
    resp = response(output=output)
    turn = build_turn(
        response=resp,
        scope="s",
        durable=True,
        tail=tail,
        tail_items=tail_items,
        backend="http://b",
        affinity_key="k",
    )
    if items is None:
        items = b",".join([*tail, *(orjson.dumps(o) for o in output)])
    assert turn.items == items
    assert turn.n_items == n_items
    assert turn.call_ids == call_ids
    orjson.loads(b"[" + turn.items + b"]")  # valid JSON items, or this raises
    assert orjson.loads(turn.response) == resp
    assert (turn.response_id, turn.scope, turn.durable) == ("resp_1", "s", True)
    assert (turn.backend, turn.affinity_key) == ("http://b", "k")


def test_build_turn_encodes_the_response_like_its_items() -> None:
    raw = b'{"id": "resp_1",  "output": []}'
    turn = build_turn(
        response=orjson.loads(raw),
        scope="s",
        durable=False,
        tail=[],
        tail_items=[],
    )
    assert turn.response == b'{"id":"resp_1","output":[]}'
    assert turn.durable is False


def test_build_turn_knows_where_each_item_with_an_id_lies() -> None:
    """Input items that carry an id (as the client wrote them) and every output item with
    one: each id with its item's byte span in the segment."""
    tail_items = [
        {"role": "user", "content": "no id"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"id": "msg_dup", "role": "assistant", "content": "first"},
        {"id": "msg_dup", "role": "assistant", "content": "second"},
        {"id": 5, "role": "user", "content": "not a string id"},
    ]
    tail = [orjson.dumps(tail_items[0]), b'{ "type" : "reasoning", "id":"rs_1","summary":[]}']
    tail += [orjson.dumps(item) for item in tail_items[2:]]
    output = [{**MESSAGE, "id": "msg_out"}, {**CALL, "id": "fc_out"}]
    turn = build_turn(
        response=response(output=output), scope="s", durable=True, tail=tail, tail_items=tail_items
    )
    spans = {item_id: (start, end) for item_id, start, end in turn.item_ids}
    assert set(spans) == {"rs_1", "msg_dup", "fc_out", "msg_out"}
    assert turn.items[slice(*spans["rs_1"])] == tail[1]  # the client's own bytes
    assert orjson.loads(turn.items[slice(*spans["msg_dup"])])["content"] == "second"
    assert orjson.loads(turn.items[slice(*spans["msg_out"])]) == output[0]
    assert orjson.loads(turn.items[slice(*spans["fc_out"])]) == output[1]
    assert turn.item_ids.span("msg_out") == spans["msg_out"]
    assert turn.item_ids.span("nope") is None


@pytest.mark.parametrize("output", [[MESSAGE], [MESSAGE, CALL], []])
def test_a_turn_kept_as_encoded_knows_where_its_output_is(output: list[Any]) -> None:
    """The response's bytes are kept when they hold the output as the items do, else
    encoded anew: where they hold it (Turn.output_at) is where the store would find it
    (store/output.py), so it cuts it there without looking. None for an empty output
    (nothing to cut)."""
    tail_items: list[Any] = [{"role": "user", "content": "hi"}]
    made = response(output=output, usage={"total_tokens": 3})
    for encoded in (orjson.dumps(made), orjson.dumps(made, option=orjson.OPT_INDENT_2)):
        turn = build_turn(
            response=made,
            scope="s",
            durable=True,
            tail=[orjson.dumps(tail_items[0])],
            tail_items=tail_items,
            encoded=encoded,
        )
        assert (turn.response is encoded) == (encoded == orjson.dumps(made))
        if output:
            assert turn.output_at == split_output(turn.response, turn.items)[1] is not None
        else:
            assert turn.output_at is None
