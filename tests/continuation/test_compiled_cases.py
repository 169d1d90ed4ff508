"""The compiled fast paths against the Python, on the cases they must see are not theirs:
an answer of the shape last seen valid whose values are not those seen valid, or that
needs more than its members filled in; a pending event of a seen shape for a request
that its memo does not stand for. Each compiled call gives the Python's bytes, dict and
patch, or declines (the generated differential tests rarely draw these)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from ocxproxy.continuation import envelope as envelope_module
from ocxproxy.continuation.envelope import Envelope, Patch
from ocxproxy.continuation.expand import forwarded_members
from ocxproxy.upstream.sse import Event, encode_event, parse_event
from tests.continuation.envelope_state import forget_shapes
from tests.continuation.test_envelope_compiled import ITEM, USAGE, _python, _same_second, _state

_c = envelope_module._c
pytestmark = pytest.mark.skipif(_c is None, reason="not built here")

# A backend's usual answer, with the members whose values are checked once per shape.
USUAL: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "model": "bench",
    "output": [ITEM],
    "tools": [],
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": None, "summary": None},
    "usage": USAGE,
}
BODY = {"model": "m", "instructions": "Be brief."}
PREVIOUS = ("previous_response_id", "resp_p")
_FIXED = (envelope_module._FROM_REQUEST, Patch)


def _changed(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    response = copy.deepcopy(USUAL)
    at: Any = response
    for name in path[:-1]:
        at = at[name]
    if value is KeyError:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return response


# (the Response, the request's echo, its served models)
ANSWERS = {
    "the values seen valid": (USUAL, PREVIOUS, ()),
    "another object": (_changed(("object",), "responses"), PREVIOUS, ()),
    "no model": (_changed(("model",), ""), PREVIOUS, ()),
    "another text": (_changed(("text",), {"verbosity": "low"}), PREVIOUS, ()),
    "reasoning without a summary": (_changed(("reasoning",), {"effort": "low"}), PREVIOUS, ()),
    "a tool to complete": (_changed(("tools",), [{"type": "function", "name": "f"}]), PREVIOUS, ()),
    "usage without its details": (
        _changed(("usage", "output_tokens_details"), KeyError),
        PREVIOUS,
        (),
    ),
    "usage of a float": (_changed(("usage", "input_tokens"), 5.0), PREVIOUS, ()),
    "a reasoning item": (
        _changed(
            ("output",), [{"type": "reasoning", "id": "rs", "summary": [], "status": "completed"}]
        ),
        PREVIOUS,
        (),
    ),
    "a part without annotations": (
        _changed(("output", 0, "content", 0, "annotations"), KeyError),
        PREVIOUS,
        (),
    ),
    "an item without a status": (_changed(("output", 0, "status"), KeyError), PREVIOUS, ()),
    # (The compiled checks know a usage, an item, a part by the keys of the last one found
    # usual: the same keys, other values or another order.)
    "usage in another order": (_changed(("usage",), dict(reversed(USAGE.items()))), PREVIOUS, ()),
    "usage in another order, its values too": (
        _changed(
            ("usage",),
            {"input_tokens_details": 5, "input_tokens": {"cached_tokens": 0}}
            | {name: USAGE[name] for name in list(USAGE)[2:]},
        ),
        PREVIOUS,
        (),
    ),
    "details of a float": (
        _changed(("usage", "input_tokens_details", "cached_tokens"), 0.0),
        PREVIOUS,
        (),
    ),
    "details of more members": (
        _changed(("usage", "output_tokens_details", "audio_tokens"), 0),
        PREVIOUS,
        (),
    ),
    "a reasoning item of a message's members": (
        _changed(("output", 0, "type"), "reasoning"),
        PREVIOUS,
        (),
    ),
    "a function call of a message's members": (
        _changed(("output", 0, "type"), "function_call"),
        PREVIOUS,
        (),
    ),
    "a refusal part": (_changed(("output", 0, "content", 0, "type"), "refusal"), PREVIOUS, ()),
    "annotations of a dict": (
        _changed(("output", 0, "content", 0, "annotations"), {}),
        PREVIOUS,
        (),
    ),
    "not completed": (_changed(("status",), "incomplete"), PREVIOUS, ()),
    "served models": (USUAL, PREVIOUS, ("alias",)),
    "pinned members": (USUAL, PREVIOUS, (), True),
    "served models naming the request's": (USUAL, PREVIOUS, ("bench", "m")),
    "a conversation given null": (
        _changed(("conversation",), None),
        ("conversation", {"id": "conv_1"}),
        (),
    ),
    "a conversation given": (
        _changed(("conversation",), {"id": "conv_0"}),
        ("conversation", {"id": "conv_1"}),
        (),
    ),
    **{
        f"a previous id {shown}": (USUAL, ("previous_response_id", rid), ())
        for shown, rid in [
            ("with a quote", 'resp_"p'),
            ("with a backslash", "resp_\\p"),
            ("not ASCII", "resp_é"),
            ("with a control character", "resp_\x01"),
            ("with DEL", "resp_\x7f"),
            ("long", "resp_" + "p" * 600),
            ("null", None),
        ]
    },
}


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_shapes(monkeypatch)


def _envelope(echo: Any, served: tuple[str, ...] = (), pinned: Any = ()) -> Envelope:
    envelope = Envelope(BODY, echo, served, forwarded_members(BODY), created_at=5)
    if pinned:
        envelope.pin(background=True)
    return envelope


def _seen_valid(response: dict[str, Any], echo: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual answer of the Response's shape seen valid (its values kept), as by the
    requests before."""
    usual = {name: USUAL.get(name) for name in response}
    data = orjson.dumps(usual)
    for _ in range(2):
        _python(lambda: _envelope(echo).answer(data, orjson.loads(data)), monkeypatch)
    assert envelope_module._KEPT.last_answer[0] == tuple(response)
    assert envelope_module._KEPT.last_answer[2].fast[3]  # (values to compare)


@pytest.mark.parametrize("case", list(ANSWERS))
def test_an_answer_of_a_seen_shape_is_the_pythons_or_declined(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    response, echo, served, *pinned = ANSWERS[case]
    _seen_valid(response, echo, monkeypatch)
    data = orjson.dumps(response)
    compiled, python = orjson.loads(data), orjson.loads(data)
    last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills

    def both() -> tuple[Any, Any]:
        nonlocal compiled, python  # (anew: _same_second may run it again)
        compiled, python = orjson.loads(data), orjson.loads(data)
        done = _c.answer(_envelope(echo, served, pinned), data, compiled, *last, *_FIXED)
        reference = _python(
            lambda: _envelope(echo, served, pinned).answer(data, python), monkeypatch
        )
        return done, reference

    done, reference = _same_second(both)
    if case == "the values seen valid":
        assert done is not None  # (the usual answer: compiled)
    _assert_the_pythons_or_declined(done, reference, data, compiled, python)


@pytest.mark.parametrize("case", list(ANSWERS))
def test_a_terminal_event_of_a_seen_shape_is_the_pythons_or_declined(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    response, echo, served, *pinned = ANSWERS[case]
    _seen_valid(response, echo, monkeypatch)
    kind = "response.completed"
    payload = {"type": kind, "response": response, "sequence_number": 7}
    raw = encode_event(kind, orjson.dumps(payload))
    compiled, python = parse_event(raw), parse_event(raw)
    compiled_payload, python_payload = orjson.loads(compiled.data), orjson.loads(python.data)
    last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills
    layouts = envelope_module._TERMINAL_LAYOUTS

    def both() -> tuple[Any, Any]:
        nonlocal compiled, python, compiled_payload, python_payload  # (anew, as above)
        compiled, python = parse_event(raw), parse_event(raw)
        compiled_payload, python_payload = orjson.loads(compiled.data), orjson.loads(python.data)
        envelope = _envelope(echo, served, pinned)
        done = _c.terminal_event(envelope, compiled, compiled_payload, *last, *_FIXED, layouts)
        reference = _python(
            lambda: _envelope(echo, served, pinned).terminal_event(python, python_payload),
            monkeypatch,
        )
        return done, reference

    done, reference = _same_second(both)
    if done is None:
        assert compiled.raw == raw
        return
    assert done[1] == reference[1]
    assert (compiled.raw, compiled.data) == (python.raw, python.data)
    assert list(compiled_payload["response"].items()) == list(python_payload["response"].items())
    assert _state(done[0]) == _state(reference[0])


@pytest.mark.parametrize("status", ["completed", "incomplete"])
def test_an_answer_whose_completed_at_is_null_is_the_pythons_or_declined(
    status: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shape with the backend's completed_at seen valid null (an incomplete Response),
    then with it null again: completed, it is filled in (as the Python does)."""
    seen = {**USUAL, "completed_at": None, "status": "incomplete"}
    data = orjson.dumps(seen)
    for _ in range(2):
        _python(lambda: _envelope(PREVIOUS).answer(data, orjson.loads(data)), monkeypatch)
    data = orjson.dumps({**seen, "status": status})
    compiled, python = orjson.loads(data), orjson.loads(data)
    last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills
    done = _c.answer(_envelope(PREVIOUS), data, compiled, *last, *_FIXED)
    if status == "incomplete":
        assert done is not None  # (the shape's usual answer: compiled)
    reference = _python(lambda: _envelope(PREVIOUS).answer(data, python), monkeypatch)
    _assert_the_pythons_or_declined(done, reference, data, compiled, python)


def _assert_the_pythons_or_declined(
    done: Any, reference: Any, data: bytes, compiled: dict[str, Any], python: dict[str, Any]
) -> None:
    """The compiled answer `done` is the Python's `reference` (its bytes, its dict, its
    patch), or it declined and left its dict as parsed."""
    if done is None:
        assert compiled == orjson.loads(data)
        return
    assert done[0] == reference[0]
    assert list(compiled.items()) == list(python.items())
    assert _state(done[1]) == _state(reference[1])


def test_a_terminal_event_whose_at_is_past_its_raw_bytes_is_declined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(Not an event parse_event makes: its raw bytes are not read past.)"""
    _seen_valid(USUAL, PREVIOUS, monkeypatch)
    kind = "response.completed"
    data = orjson.dumps({"type": kind, "response": USUAL, "sequence_number": 7})
    event = Event(b"data: {}\n\n", kind, data, 1000)
    last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills
    layouts = envelope_module._TERMINAL_LAYOUTS
    done = _c.terminal_event(
        _envelope(PREVIOUS), event, orjson.loads(data), *last, *_FIXED, layouts
    )
    assert done is None and event.raw == b"data: {}\n\n"


def _pending(rid: str, created_at: int) -> Event:
    kind = "response.created"
    response = {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "model": "bench",
        "output": [],
    }
    return parse_event(encode_event(kind, orjson.dumps({"type": kind, "response": response})))


def _copy(event: Event) -> Event:
    return Event(event.raw, event.name, event.data, event.at)


# What makes a request's pending event's members other than those of the request the
# shape's memo was worked out for (that request: BODY, echoing `seen`, no served models).
CONVERSATION = ("conversation", {"id": "conv_p"})
PENDING = {
    "the same request": lambda seen: _envelope(_another(seen)),
    "pinned members": lambda seen: _pinned(_envelope(seen)),
    "the other echo": lambda seen: _envelope(PREVIOUS if seen is CONVERSATION else CONVERSATION),
    "no echo": lambda seen: _envelope(None),
    "served models": lambda seen: _envelope(seen, ("alias",)),
    "other members": lambda seen: Envelope({**BODY, "temperature": 0.5}, seen, (), b"{}"),
    "an id to escape": lambda seen: _envelope((seen[0], _another(seen, 'resp_"\\')[1])),
    "a conversation not the usual": lambda seen: _envelope(
        ("conversation", {"id": "conv_q", "x": 1})
    ),
}


def _another(echo: tuple[str, Any], rid: str = "resp_q") -> tuple[str, Any]:
    return (echo[0], rid if echo[0] == "previous_response_id" else {"id": rid})


def _pinned(envelope: Envelope) -> Envelope:
    envelope.pin(background=True)
    return envelope


@pytest.mark.parametrize("seen", [PREVIOUS, CONVERSATION])
@pytest.mark.parametrize("case", list(PENDING))
def test_a_pending_event_of_a_seen_shape_is_the_pythons_or_declined(case: str, seen: Any) -> None:
    seen_by = _envelope(seen)
    for n in range(2):  # (the shape seen, then its members worked out: its memo)
        seen_by._pending_event(_pending(f"resp_seen{n}", 1700000000))
    event = _pending("resp_2", 1700000002)
    compiled, python = PENDING[case](seen), PENDING[case](seen)
    fast = _copy(event)
    lasts = (
        envelope_module._KEPT.lasts,
        envelope_module._KEPT.last_fills,
        envelope_module._FROM_REQUEST,
    )
    done = _c.pending_event(compiled, fast, *lasts)
    if case == "the same request":
        assert done is fast  # (the usual event: compiled)
    if done is None:
        assert (fast.raw, fast.data) == (event.raw, event.data)
        return
    slow = python._pending_event(_copy(event))
    assert (fast.raw, fast.data, fast.at) == (slow.raw, slow.data, slow.at)


def test_an_answer_whose_keys_are_not_the_parsers_usual_ones_is_the_pythons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled checks find a usage, an item, a part by the very key objects of the
    last one found usual (orjson gives the same ones each time): the same members as
    other objects (another parser's) are found by lookups, with the same result."""
    _seen_valid(USUAL, PREVIOUS, monkeypatch)
    data = orjson.dumps(USUAL)
    last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills
    assert _c.answer(_envelope(PREVIOUS), data, orjson.loads(data), *last, *_FIXED) is not None
    _compiled_as_usual(data, monkeypatch, loads=json.loads)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_the_usual_answers_own_members_reach_its_dict_at_merge(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual answer's own members (its created_at, the echoed previous_response_id,
    its completed_at) are in its bytes at once, and in its dict at Patch.merge, with the
    members filled from the request: a dict nobody reads for them is left as parsed."""
    _seen_valid(USUAL, PREVIOUS, monkeypatch)
    data = orjson.dumps(USUAL)
    response = orjson.loads(data)
    envelope = _envelope(PREVIOUS)
    if compiled:
        stored, patch = envelope.answer(data, response)
    else:
        stored, patch = _python(lambda: envelope.answer(data, response), monkeypatch)
    assert response == orjson.loads(data)
    patch.merge(response)
    assert response == orjson.loads(stored)
    assert response["previous_response_id"] == "resp_p" and type(response["completed_at"]) is int
    assert response["created_at"] == 5 and response["instructions"] == "Be brief."


_STATE = ("_body", "_members", "_echo", "_served_models", "_created_at", "_pinned")
_STATE += ("_defaults", "_fills", "_inserts", "_family")
BODIES = [{"model": "m"}, None]
CALLS = [  # (positional arguments, keyword arguments)
    ((), {}),
    ((BODIES[0],), {}),
    ((BODIES[0], PREVIOUS), {}),
    ((BODIES[0], PREVIOUS, ("alias",)), {}),
    ((BODIES[0], PREVIOUS, ("alias",), b'"model":"m"'), {}),
    ((BODIES[1], None, (), None), {}),
    ((BODIES[0],), {"echo": PREVIOUS, "created_at": 5}),
    ((), {"served_models": ("alias",), "members": b"{}"}),
]


@pytest.mark.parametrize("args, kwargs", CALLS)
def test_an_envelope_called_any_way_has_the_members_of_the_python_one(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Envelope(...) made by the compiled call without an argument tuple (positional
    arguments), or by type(...) (keywords), holds what the Python _EnvelopeState does."""
    compiled = Envelope(*args, **kwargs)
    python = envelope_module._EnvelopeState(*args, **kwargs)
    assert [getattr(compiled, name) for name in _STATE] == [
        getattr(python, name) for name in _STATE
    ]


def test_an_envelope_called_wrong_or_overridden_is_called_as_a_type_is() -> None:
    """A call the compiled one does not make (too many arguments, an unknown keyword, a
    subclass's own __init__ or __new__ after `vectorcall`) is type(...)'s, and a type not
    of the envelope's state is refused."""
    with pytest.raises(TypeError):
        Envelope({}, None, (), None, 5)
    with pytest.raises(TypeError):
        Envelope(body={}, colour="red")

    class Initialised(Envelope):
        __slots__ = ()

        def __init__(self, *args: Any) -> None:
            self._pinned = {"args": len(args)}

    class Made(Envelope):
        __slots__ = ()

        def __new__(cls, *args: Any) -> Made:
            made = super().__new__(cls, *args)
            made._pinned = {"made": True}
            return made

    for kind in (Initialised, Made):
        _c.vectorcall(kind)
    assert Initialised(BODY, PREVIOUS)._pinned == {"args": 2}
    assert Initialised(BODY, PREVIOUS)._body is BODY
    assert Made(BODY)._pinned == {"made": True}
    with pytest.raises(TypeError):
        _c.vectorcall(Patch)
    with pytest.raises(TypeError):
        _c.vectorcall(object())


def test_answers_of_two_shapes_in_turn_are_the_pythons(monkeypatch: pytest.MonkeyPatch) -> None:
    """The members' places the compiled answer read for one shape's plan (kept for the
    next answer of it) are not another shape's: one of the same members in another order
    has its own."""
    reordered = dict(reversed(list(USUAL.items())))
    for response in (USUAL, reordered, USUAL, reordered):
        _seen_valid(response, PREVIOUS, monkeypatch)
        _compiled_as_usual(orjson.dumps(response), monkeypatch)


def test_answers_for_requests_of_two_fills_in_turn_are_the_pythons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a request's fills say (read once for the fill last seen, kept for the next
    answer with it) is not another request's: one with other instructions has its own."""
    _seen_valid(USUAL, PREVIOUS, monkeypatch)
    data = orjson.dumps(USUAL)
    for instructions in ("Be brief.", "Be long.", "Be brief.", "Be long."):
        done = _answered({**BODY, "instructions": instructions}, data, monkeypatch)
        assert instructions.encode() in done[0]


def _answered(body: dict[str, Any], data: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The answer `data` to a request of `body` compiled (not declined), as the Python's."""
    compiled, python = orjson.loads(data), orjson.loads(data)

    def both() -> tuple[Any, Any]:
        nonlocal compiled, python  # (anew: _same_second may run it again)
        compiled, python = orjson.loads(data), orjson.loads(data)
        last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills
        envelope = Envelope(body, PREVIOUS, (), forwarded_members(body), created_at=5)
        done = _c.answer(envelope, data, compiled, *last, *_FIXED)
        reference = Envelope(body, PREVIOUS, (), forwarded_members(body), created_at=5)
        return done, _python(lambda: reference.answer(data, python), monkeypatch)

    done, reference = _same_second(both)
    assert done is not None
    _assert_the_pythons_or_declined(done, reference, data, compiled, python)
    return done


def _compiled_as_usual(
    data: bytes,
    monkeypatch: pytest.MonkeyPatch,
    usual: bool = True,
    loads: Callable[[bytes], Any] = orjson.loads,
) -> None:
    """The answer `data`, parsed by `loads`, compiled as the Python completes it: the usual
    answer, or (not `usual`) declined."""
    compiled, python = loads(data), loads(data)
    last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills

    def both() -> tuple[Any, Any]:
        nonlocal compiled, python  # (anew: _same_second may run it again)
        compiled, python = loads(data), loads(data)
        done = _c.answer(_envelope(PREVIOUS), data, compiled, *last, *_FIXED)
        reference = _python(lambda: _envelope(PREVIOUS).answer(data, python), monkeypatch)
        return done, reference

    done, reference = _same_second(both)
    assert (done is not None) is usual
    _assert_the_pythons_or_declined(done, reference, data, compiled, python)


def test_a_request_with_the_members_of_one_without_fills_may_have_fills(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled answer knows a request whose members fill nothing by its members' names
    (the same objects as the last such request's), for the names filled from the request
    it was found with: for others, the request's members are looked up again."""
    _seen_valid(USUAL, None, monkeypatch)
    data = orjson.dumps(USUAL)
    names = envelope_module._FROM_REQUEST
    monkeypatch.setattr(envelope_module, "_FROM_REQUEST", names - {"temperature"})
    first = Envelope({"model": "m", "temperature": 0.5}, None, (), None, created_at=5)
    done = _c.answer(
        first, data, orjson.loads(data), envelope_module._KEPT.last_answer,
        envelope_module._KEPT.last_fills, envelope_module._FROM_REQUEST, Patch,
    )  # fmt: skip
    assert done is not None and b'"temperature":0.5' in done[0]  # (filled as a default)
    monkeypatch.setattr(envelope_module, "_FROM_REQUEST", names)
    body = {"model": "m", "temperature": 0.7}
    compiled, python = orjson.loads(data), orjson.loads(data)
    last = envelope_module._KEPT.last_answer, envelope_module._KEPT.last_fills

    def both() -> tuple[Any, Any]:
        nonlocal compiled, python  # (anew: _same_second may run it again)
        compiled, python = orjson.loads(data), orjson.loads(data)
        envelope = Envelope(body, None, (), None, created_at=5)
        done = _c.answer(envelope, data, compiled, *last, *_FIXED)
        python_envelope = Envelope(body, None, (), None, created_at=5)
        return done, _python(lambda: python_envelope.answer(data, python), monkeypatch)

    done, reference = _same_second(both)
    assert done is not None and b'"temperature":0.7' in done[0]
    _assert_the_pythons_or_declined(done, reference, data, compiled, python)


@pytest.mark.parametrize("model", ["ü", "модель", "🙂 m", "m\x00"])
@pytest.mark.parametrize("then", ["the same", "another"])
def test_an_answer_naming_a_model_of_any_characters_is_the_pythons(
    model: str, then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model a backend names (one of the values compared with those last seen valid)
    compares as the Python compares it, in any of a str's widths: the same again is the
    usual answer, one that differs in its last character is not."""
    seen = {**USUAL, "model": model}
    data = orjson.dumps(seen)
    for _ in range(2):
        _python(lambda: _envelope(PREVIOUS).answer(data, orjson.loads(data)), monkeypatch)
    if then == "another":
        data = orjson.dumps({**USUAL, "model": model[:-1] + chr(ord(model[-1]) + 1)})
    _compiled_as_usual(data, monkeypatch, usual=then == "the same")
