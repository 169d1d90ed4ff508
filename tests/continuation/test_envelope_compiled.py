"""The envelope's compiled fast paths (ocxproxy/_speedups.c) against the Python they stand
for: on any Response, JSON answer or terminal event, the compiled one gives what the
Python gives (bytes, dict, patch, event) or declines (None), and then changes nothing."""

from __future__ import annotations

import copy
import time
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ocxproxy.continuation import envelope as envelope_module
from ocxproxy.continuation.envelope import Envelope, Patch, ServedModels
from ocxproxy.continuation.expand import forwarded_members
from ocxproxy.upstream.sse import Event, encode_event, parse_event
from tests.continuation.envelope_state import forget_shapes, python_paths

pytestmark = pytest.mark.skipif(envelope_module._c is None, reason="not built here")

_PATCH = (
    "plan",
    "filled",
    "encoded",
    "inserted",
    "ids",
    "rewrite",
    "items",
    "unmerged",
    "fill",
    "fill_in",
    "fill_at",
    "own",
)
# What a backend answers with, the usual way (instant_backend's, llama.cpp's), to mutate.
ITEM = {
    "type": "message",
    "id": "msg_x",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "ok", "annotations": []}],
}
USAGE = {
    "input_tokens": 5,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 1,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 6,
}
BASE: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1700000000,
    "status": "completed",
    "model": "bench",
    "output": [ITEM],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": USAGE,
}

odd = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.just("completed"),
    st.builds(list),
    st.builds(dict),
    st.lists(st.integers(-9, 9), max_size=2),
)
ids = st.one_of(
    st.just("resp_p"),
    st.text(max_size=8),
    st.sampled_from(['a"b', "a\\b", "é", "\x00", "\x7f", "x" * 600, "\ud800"]),
)
usual_echoes = st.sampled_from([None, ("previous_response_id", "resp_p")])
echoes = st.one_of(
    usual_echoes,
    usual_echoes,
    usual_echoes,
    st.tuples(st.just("previous_response_id"), ids),
    st.tuples(st.just("previous_response_id"), st.none()),
    st.tuples(st.just("conversation"), st.builds(dict, id=st.just("conv_1"))),
)
bodies = st.one_of(
    st.just({"model": "m"}),
    st.just({"model": "m", "input": "hi", "stream": True}),
    st.just({"model": "m", "input": "hi"}),
    st.just({"model": 3}),
    st.just({"model": "m", "instructions": "Be brief.", "tools": []}),
    st.just({"model": "m", "store": False, "temperature": 0.5}),
    st.just({"model": "m", "metadata": {"k": "v"}}),
    st.just({}),
)


def _item(draw: st.DrawFn) -> Any:
    kind = draw(st.integers(0, 7))
    item = copy.deepcopy(ITEM)
    if kind == 1:
        del item["status"]
    elif kind == 2:
        item["content"][0].pop("annotations")
    elif kind == 3:
        item = {"type": "reasoning", "id": "rs", "summary": [], "status": "completed"}
    elif kind == 4:
        item = {"type": "function_call", "status": "completed", "name": "f", "arguments": ""}
    elif kind == 5:
        item["content"] = draw(st.sampled_from([[], "x", [1], [{"type": "refusal"}]]))
    elif kind == 6:
        return draw(odd)
    elif kind == 7:
        item["type"] = draw(odd)
    return item


@st.composite
def responses(draw: st.DrawFn) -> dict[str, Any]:
    response = copy.deepcopy(BASE)
    if draw(st.booleans()):
        return response  # (the usual answer)
    for name in draw(st.lists(st.sampled_from(list(BASE)), max_size=3)):
        response.pop(name, None)
    odd_members = st.lists(st.sampled_from([*BASE, "completed_at", "text"]), max_size=2)
    for name in draw(odd_members) if draw(st.booleans()) else ():
        response[name] = draw(odd)
    if draw(st.booleans()):
        response["output"] = [_item(draw) for _ in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()) and type(response.get("usage")) is dict:
        usage = response["usage"]
        name = draw(st.sampled_from([*USAGE, "input_tokens_details"]))
        if draw(st.booleans()):
            usage[name] = draw(odd)
        else:
            usage.pop(name, None)
    if draw(st.booleans()):
        response["previous_response_id"] = draw(st.one_of(st.none(), st.just("resp_0")))
    if draw(st.booleans()):
        response["completed_at"] = draw(st.one_of(st.none(), st.just(1700000001)))
    return response


def _state(patch: Any) -> tuple[Any, ...]:
    return tuple(getattr(patch, name) for name in _PATCH)


def _same_second(run: Any) -> Any:
    """`run()` within one second of the clock (completed_at is the time of day): run again
    when the clock turned, so `run` makes what it changes anew each time."""
    for _ in range(5):
        now = int(time.time())
        done = run()
        if int(time.time()) == now:
            return done
    pytest.skip("the clock kept turning a second")


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_shapes(monkeypatch)


def _envelope(body: dict[str, Any], echo: Any, served: tuple[str, ...], members: bool) -> Envelope:
    forwarded = forwarded_members(body) if members else None
    return Envelope(body, echo, served, forwarded, created_at=5)


def _python(run: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as patched:
        python_paths(patched)
        return run()


def _compiled_terminal(envelope: Envelope, event: Event, payload: dict[str, Any]) -> Any:
    """The compiled terminal event, on what the envelope keeps past a request."""
    kept = envelope_module._KEPT
    return envelope_module._c.terminal_event(
        envelope, event, payload, kept.last_answer, kept.last_fills,
        envelope_module._FROM_REQUEST, Patch, envelope_module._TERMINAL_LAYOUTS,
    )  # fmt: skip


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=responses(),
    second=st.one_of(st.none(), responses()),
    body=bodies,
    echo=echoes,
    served=st.sampled_from(
        [(), (), (), ("alias",), ("bench", "m"), ServedModels(("bench",), {"temperature": 0.8})]
    ),
    members=st.booleans(),
    seen=st.sampled_from([0, 1, 2, 3, 3, 3, 3]),
    usual=st.booleans(),
)
def test_a_json_answer_compiled_is_the_pythons_or_declined(
    monkeypatch: pytest.MonkeyPatch,
    first: dict[str, Any],
    second: dict[str, Any] | None,
    body: dict[str, Any],
    echo: Any,
    served: tuple[str, ...],
    members: bool,
    seen: int,
    usual: bool,
) -> None:
    forget_shapes(monkeypatch)
    if usual:  # an answer of a shape seen valid, the usual case
        second, seen, served = None, 3, ()
        echo = echo if echo in (None, ("previous_response_id", "resp_p")) else None
    if second is None:  # an answer of the first's shape and values
        second = {**copy.deepcopy(first), "id": "resp_2"} if "id" in first else first
    for _ in range(seen):  # (the shape seen valid: what the compiled path needs)
        data = orjson.dumps(first)
        try:
            _python(
                lambda data=data: _envelope(body, echo, served, members).answer(
                    data, orjson.loads(data)
                ),
                monkeypatch,
            )
        except (ValueError, TypeError, UnicodeEncodeError, OverflowError):
            return  # (the Python raises: orjson on what it cannot encode)
    data = orjson.dumps(second)
    compiled_dict = orjson.loads(data)
    python_dict = orjson.loads(data)
    last = envelope_module._KEPT.last_answer
    envelope = _envelope(body, echo, served, members)

    def both() -> tuple[Any, Any]:
        nonlocal compiled_dict, python_dict, last  # (anew: a second run's are not the first's)
        compiled_dict, python_dict = orjson.loads(data), orjson.loads(data)
        last = envelope_module._KEPT.last_answer
        done = envelope_module._c.answer(
            envelope,
            data,
            compiled_dict,
            envelope_module._KEPT.last_answer,
            envelope_module._KEPT.last_fills,
            envelope_module._FROM_REQUEST,
            Patch,
        )
        reference = _python(
            lambda: _envelope(body, echo, served, members).answer(data, python_dict), monkeypatch
        )
        return done, reference

    try:
        done, reference = _same_second(both)
    except (ValueError, TypeError, UnicodeEncodeError, OverflowError):
        return  # (the Python raises too: orjson on what it cannot encode)
    event("declined" if done is None else "compiled")
    if done is None:
        assert compiled_dict == orjson.loads(data)  # declined: nothing changed
        assert list(compiled_dict) == list(orjson.loads(data))
        return
    stored, patch = done
    assert stored == reference[0]
    assert list(compiled_dict.items()) == list(python_dict.items())
    assert _state(patch) == _state(reference[1])
    assert last is envelope_module._KEPT.last_answer  # (kept as it was: nothing new to learn)


def _terminal(response: dict[str, Any], order: int, seq: int, crlf: bool) -> Event:
    kind = "response.completed"
    if order == 0:
        payload = {"type": kind, "response": response, "sequence_number": seq}
    elif order == 1:
        payload = {"response": response, "sequence_number": seq, "type": kind}
    else:
        payload = {"type": kind, "sequence_number": seq, "response": response}
    data = orjson.dumps(payload)
    if crlf:
        return parse_event(b"event: " + kind.encode() + b"\r\ndata: " + data + b"\r\n\r\n")
    return parse_event(encode_event(kind, data))


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=responses(),
    second=st.one_of(st.none(), responses()),
    body=bodies,
    echo=echoes,
    members=st.booleans(),
    seen=st.sampled_from([0, 1, 2, 3, 3, 3, 3]),
    usual=st.booleans(),
    order=st.integers(0, 2),
    seq=st.integers(-5, 2**63 - 1),
    crlf=st.booleans(),
)
def test_a_terminal_event_compiled_is_the_pythons_or_declined(
    monkeypatch: pytest.MonkeyPatch,
    first: dict[str, Any],
    second: dict[str, Any] | None,
    body: dict[str, Any],
    echo: Any,
    members: bool,
    seen: int,
    usual: bool,
    order: int,
    seq: int,
    crlf: bool,
) -> None:
    forget_shapes(monkeypatch)
    if usual:  # an answer of a shape seen valid, the usual case
        second, seen = None, 3
        echo = echo if echo in (None, ("previous_response_id", "resp_p")) else None
    if second is None:  # an answer of the first's shape and values
        second = {**copy.deepcopy(first), "id": "resp_2"} if "id" in first else first
    for _ in range(seen):
        primer = _terminal(first, order, seq, crlf)
        try:
            _python(
                lambda primer=primer: _envelope(body, echo, (), members).terminal_event(
                    primer, orjson.loads(primer.data)
                ),
                monkeypatch,
            )
        except (ValueError, TypeError, UnicodeEncodeError, OverflowError):
            return  # (the Python raises: orjson on what it cannot encode)
    compiled_event = _terminal(second, order, seq, crlf)
    python_event = _terminal(second, order, seq, crlf)
    compiled_payload = orjson.loads(compiled_event.data)
    python_payload = orjson.loads(python_event.data)
    raw = compiled_event.raw
    envelope = _envelope(body, echo, (), members)

    def both() -> tuple[Any, Any]:
        nonlocal compiled_event, python_event, compiled_payload, python_payload, raw
        compiled_event = _terminal(second, order, seq, crlf)  # (anew, as above)
        python_event = _terminal(second, order, seq, crlf)
        compiled_payload = orjson.loads(compiled_event.data)
        python_payload = orjson.loads(python_event.data)
        raw = compiled_event.raw
        done = _compiled_terminal(envelope, compiled_event, compiled_payload)
        reference = _python(
            lambda: _envelope(body, echo, (), members).terminal_event(python_event, python_payload),
            monkeypatch,
        )
        return done, reference

    try:
        done, reference = _same_second(both)
    except (ValueError, TypeError, UnicodeEncodeError, OverflowError):
        return
    event("declined" if done is None else "compiled")
    if done is None:
        assert compiled_event.raw is raw
        assert compiled_payload == orjson.loads(compiled_event.data)
        return
    patch, in_bytes = done
    assert in_bytes == reference[1]
    assert (compiled_event.raw, compiled_event.data) == (python_event.raw, python_event.data)
    assert list(compiled_payload["response"].items()) == list(python_payload["response"].items())
    assert _state(patch) == _state(reference[0])


def test_a_terminal_event_whose_data_cannot_be_set_is_left_as_it_was() -> None:
    """The compiled path sets an event's raw bytes and its data both or neither: an event
    whose data is not a slot is declined before anything is changed (the Python path
    completes it)."""
    from tests.continuation.test_pending_speedups import Unsettable, copied

    envelope = _envelope({"model": "m"}, ("previous_response_id", "resp_p"), (), True)
    for _ in range(3):  # (the shape seen valid)
        primer = _terminal(BASE, 0, 9, False)
        envelope.terminal_event(primer, orjson.loads(primer.data))
    event = _terminal(BASE, 0, 9, False)
    fixed = copied(Unsettable, event)
    payload = orjson.loads(event.data)
    done = _compiled_terminal(envelope, fixed, payload)
    assert done is None
    assert (fixed.raw, fixed.data) == (event.raw, event.data)
    assert payload == orjson.loads(event.data)


@pytest.mark.parametrize("name", ["response.completed", "response.incomplete", None, "x" * 18])
def test_a_terminal_event_is_completed_by_its_payloads_type_whatever_its_name(
    monkeypatch: pytest.MonkeyPatch, name: str | None
) -> None:
    """The compiled path looks the layout up by the event's name when it is the payload's
    type (a str hashed already), else by the type, as the Python does."""
    envelope = _envelope({"model": "m"}, ("previous_response_id", "resp_p"), (), True)
    for _ in range(3):  # (the shape seen valid)
        primer = _terminal(BASE, 0, 9, False)
        envelope.terminal_event(primer, orjson.loads(primer.data))
    payload = {"type": "response.incomplete", "response": BASE, "sequence_number": 9}
    event = parse_event(encode_event(name, orjson.dumps(payload)))
    compiled, python = copy.copy(event), copy.copy(event)
    done = _compiled_terminal(envelope, compiled, orjson.loads(event.data))
    reference = _python(
        lambda: _envelope(
            {"model": "m"}, ("previous_response_id", "resp_p"), (), True
        ).terminal_event(python, orjson.loads(event.data)),
        monkeypatch,
    )
    assert done is not None and done[1][1] and reference[1] is not None
    ours, theirs = orjson.loads(compiled.data), orjson.loads(python.data)
    for made in (ours, theirs):  # (the time of day)
        made["response"].pop("completed_at")
    assert ours == theirs and ours["type"] == "response.incomplete"
