"""The compiled pending event (`_speedups.pending_event`) against the Python path it
stands for (`Envelope._pending_event`): on any event and any request, the same bytes, or
it declines and leaves the event as it was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ocxproxy.continuation import envelope as envelope_module
from ocxproxy.continuation.envelope import Envelope
from ocxproxy.continuation.expand import forwarded_members
from ocxproxy.upstream.sse import Event, encode_event, framed, parse_event
from tests.continuation.envelope_state import forget_shapes

_c = envelope_module._c
pytestmark = pytest.mark.skipif(_c is None, reason="the compiled fast paths are not built here")
KINDS = ("response.created", "response.in_progress")


def pending(kind: str, rid: str, created_at: Any, extra: dict[str, Any], seq: int = 0) -> Event:
    response = {"id": rid, "object": "response", "created_at": created_at, **extra}
    payload = {"type": kind, "response": response, "sequence_number": seq}
    return parse_event(encode_event(kind, orjson.dumps(payload)))


def lasts() -> tuple[Any, ...]:
    """What the Python passes `_c.pending_event` after the envelope and the event."""
    return (
        envelope_module._KEPT.lasts,
        envelope_module._KEPT.last_fills,
        envelope_module._FROM_REQUEST,
    )


def copy(event: Event) -> Event:
    return Event(event.raw, event.name, event.data, event.at)


def envelope(
    body: dict[str, Any],
    echo: Any,
    served: tuple[str, ...],
    forwarded: bool,
    created_at: int | None,
    pinned: bool,
) -> Envelope:
    members = forwarded_members(body) if forwarded else None
    made = Envelope(body, echo, served, members, created_at=created_at)
    if pinned:
        made.pin(background=True)
    return made


@pytest.fixture(autouse=True)
def fresh_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_shapes(monkeypatch)


def test_turn_after_turn_the_compiled_path_completes_both_pending_events() -> None:
    """A continuation's pending events, from its second turn on, are completed in one
    compiled call each (the members worked out for an earlier request with the same
    forwarded members), to the Python path's bytes."""
    body = {"model": "m", "instructions": "Be brief.", "temperature": 0.5}
    for n in range(4):
        echo = ("previous_response_id", f"resp_prev{n}")
        compiled = Envelope(body, echo, (), forwarded_members(body), created_at=7)
        python = Envelope(body, echo, (), forwarded_members(body), created_at=7)
        for seq, kind in enumerate(KINDS):
            extra = {"status": "in_progress", "model": "bench", "output": []}
            event = pending(kind, f"resp_t{n}", 1700000000 + n, extra, seq)
            fast = copy(event)
            done = _c.pending_event(compiled, fast, *lasts())
            if n >= 2:  # (the first turn sees the shapes, the second works out the members)
                assert done is fast
            if done is None:
                fast = compiled._pending_event(fast)
            slow = python._pending_event(copy(event))
            assert (fast.raw, fast.data, fast.at) == (slow.raw, slow.data, slow.at)
            assert parse_event(framed(fast)) == fast
            response = orjson.loads(fast.data)["response"]
            assert response["previous_response_id"] == f"resp_prev{n}"
            assert response["instructions"] == "Be brief." and response["temperature"] == 0.5


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "stream": True},  # (nothing the Responses are filled from)
        {"model": "m", "instructions": "Be brief.", "tools": [{"type": "web_search"}]},
    ],
)
def test_first_turn_after_first_turn_the_compiled_path_completes_both_pending_events(
    body: dict[str, Any],
) -> None:
    """A new conversation's pending events (no previous response: the request's members
    were not encoded by the proxy), from the third on, are completed in one compiled call
    each, with the members worked out for an earlier request with the same fills."""
    for n in range(4):
        compiled = Envelope(body, None, (), None, created_at=7 + n)
        python = Envelope(body, None, (), None, created_at=7 + n)
        for seq, kind in enumerate(KINDS):
            extra = {"status": "in_progress", "model": "bench", "output": []}
            event = pending(kind, f"resp_t{n}", 1700000000 + n, extra, seq)
            fast = copy(event)
            done = _c.pending_event(compiled, fast, *lasts())
            if n >= 2:
                assert done is fast
            if done is None:
                fast = compiled._pending_event(fast)
            slow = python._pending_event(copy(event))
            assert (fast.raw, fast.data, fast.at) == (slow.raw, slow.data, slow.at)
            response = orjson.loads(fast.data)["response"]
            assert response["previous_response_id"] is None
            assert response["created_at"] == 1700000000 + n
            assert response["instructions"] == body.get("instructions")


def test_requests_alike_but_for_their_model_each_get_their_own_members() -> None:
    """Requests alike but for their model, none of whose members a Response is filled in
    from: their bodies' keys are the parser's same objects (known by their addresses once
    learnt), and the model shown in a Response without one is each request's, compiled or
    not (a request for another model is not the last one's fills)."""
    models = ["a", "a", "a", "b", "b", "a"]
    shown, compiled = [], []
    extra = {"status": "in_progress", "output": []}  # (no model: the request's is shown)
    for n, model in enumerate(models):
        body = orjson.loads(orjson.dumps({"model": model, "input": "hi", "stream": True}))
        made = Envelope(body, ("previous_response_id", f"resp_prev{n}"), ())
        event = pending("response.created", f"resp_t{n}", 1700000000 + n, extra)
        done = _c.pending_event(made, copy(event), *lasts())
        compiled.append(done is not None)
        if done is None:
            done = made._pending_event(event)
        shown.append(orjson.loads(done.data)["response"]["model"])
    assert shown == models
    assert compiled == [False, False, True, False, True, False]


TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
PLAIN = st.from_regex(r"resp_[A-Za-z0-9_]{1,24}", fullmatch=True)
# (what JSON must escape, or DEL, past the first eight characters and within them)
TRICKY = st.sampled_from(
    [
        "resp_abcdefgh",
        'resp_abcdefgh"x',
        "resp_abcdefgh\\x",
        "resp_abcdefgh\x7f",
        "re\x1fsp",
        "resp_abcdefghijklmno\x00",
        "resp_\u00e9",
        "resp_\x7f",
    ]
)
IDS = st.one_of(PLAIN, PLAIN, PLAIN, TEXT, TRICKY)
ECHOES = st.one_of(
    st.none(),
    st.tuples(st.just("previous_response_id"), st.one_of(IDS, st.none())),
    st.tuples(
        st.just("conversation"),
        st.one_of(
            st.fixed_dictionaries({"id": IDS}),
            st.fixed_dictionaries({"id": IDS, "x": st.integers(-(2**63), 2**63 - 1)}),
        ),
    ),
)
BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "bench", ""])},
    optional={
        "instructions": st.sampled_from(["Be brief.", 'Say "hi"\\n']),
        "store": st.booleans(),
        "temperature": st.sampled_from([0.5, 1.0]),
    },
)
USUAL = st.fixed_dictionaries(
    {"status": st.just("in_progress"), "output": st.just([])},
    optional={"model": st.just("bench"), "completed_at": st.none()},
)
ANY_EXTRAS = st.fixed_dictionaries(
    {"status": st.just("in_progress"), "output": st.just([])},
    optional={
        "model": st.sampled_from(["bench", "", "m"]),
        "completed_at": st.none(),
        "previous_response_id": st.none(),
        "conversation": st.none(),
        "tools": st.just([]),
    },
)
EXTRAS = st.one_of(USUAL, USUAL, ANY_EXTRAS)
MOSTLY = st.sampled_from([True, True, True, False])
REQUESTS = st.tuples(
    BODIES,
    ECHOES,
    st.sampled_from([(), ("m",), ("alias", "m")]),
    MOSTLY,  # members forwarded
    st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),  # created_at
    MOSTLY.map(lambda mostly: not mostly),  # pinned
)
MUTATIONS = st.one_of(
    st.none(),
    st.none(),
    st.none(),
    st.tuples(st.just("id"), st.binary(max_size=12)),
    st.tuples(st.just("digits"), st.binary(max_size=12)),
    st.tuples(st.just("cut"), st.integers(0, 400)),
    st.tuples(st.just("insert"), st.integers(0, 400), st.binary(min_size=1, max_size=6)),
)


def mutated(event: Event, rid: bytes, mutation: Any) -> Event:
    if mutation is None:
        return event
    data = event.data
    if mutation[0] == "id":
        data = data.replace(b'"id":"%s"' % rid, b'"id":"%s"' % mutation[1], 1)
    elif mutation[0] == "digits":
        data = data.replace(b'"created_at":1700000123', b'"created_at":%s' % mutation[1], 1)
    elif mutation[0] == "cut":
        data = data[: mutation[1]]
    else:
        data = data[: mutation[1]] + mutation[2] + data[mutation[1] :]
    return parse_event(encode_event(event.name, data))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    extra=EXTRAS,
    seen_by=REQUESTS,
    request=st.one_of(REQUESTS, st.none(), st.none()),
    turn=st.tuples(IDS, st.one_of(st.none(), st.integers(0, 2**40))),
    warm=st.booleans(),
    rid=IDS,
    mutation=MUTATIONS,
)
def test_the_compiled_pending_event_gives_the_python_paths_bytes_or_declines(
    kind: str,
    extra: dict[str, Any],
    seen_by: Any,
    request: Any,
    turn: tuple[str, int | None],
    warm: bool,
    rid: str,
    mutation: Any,
) -> None:
    envelope_module._PENDING.clear()
    envelope_module._KEPT.lasts.clear()
    # The shape seen twice (the second time its members are worked out), by one request
    first = envelope(*seen_by)
    for n in range(2):
        first._pending_event(pending(kind, f"resp_seen{n}", 1700000000, extra))
    if request is None:  # the next turn of the same request: its own id and created_at
        body, echo, *rest = seen_by
        if echo is not None:
            echo = (echo[0], turn[0] if echo[0] == "previous_response_id" else {"id": turn[0]})
        request = (body, echo, rest[0], rest[1], turn[1], rest[3])
    event = pending(kind, rid, 1700000123, extra)
    event = mutated(event, orjson.dumps(rid)[1:-1], mutation)
    compiled, python = envelope(*request), envelope(*request)
    if warm:  # (its members worked out for an earlier event of the turn)
        for made in (compiled, python):
            made._pending_event(pending(kind, "resp_earlier", 1700000000, extra))
    fast = copy(event)
    done = _c.pending_event(compiled, fast, *lasts())
    if done is None:
        assert (fast.raw, fast.data, fast.at) == (event.raw, event.data, event.at)
        return
    assert done is fast
    slow = python._pending_event(copy(event))
    assert (fast.raw, fast.data, fast.at) == (slow.raw, slow.data, slow.at)


@pytest.mark.parametrize(
    "args",
    [
        (),
        (None, None),
        (None, None, None, None),
        (object(), object(), object()),
        (Envelope(), Event(b"", None, b""), {}),
        (Envelope(), Event(b"", None, b"", 0), {None: (b"", 0, b"", 0, b"", 0, 1, None)}),
        (Envelope(), Event(b"\n\n", None, b"", 0), {None: ()}),
        (Envelope(), Event(b"data: {}\n\n", None, b"{}", 6), {None: "not a tuple"}),
    ],
)
def test_the_compiled_pending_event_declines_what_it_is_not_given_right(args: Any) -> None:
    try:
        done = _c.pending_event(*args)
    except (TypeError, AttributeError):
        return
    assert done is None


def three_turns() -> Iterator[tuple[int, Envelope, Event]]:
    """Three continuation turns of one request family: each turn's number, its Envelope
    and each of its pending events (the third turn's are the usual ones)."""
    body = {"model": "m", "instructions": "Be brief."}
    extra = {"status": "in_progress", "model": "bench", "output": []}
    for n in range(3):
        echo = ("previous_response_id", f"resp_prev{n}")
        made = Envelope(body, echo, (), forwarded_members(body), created_at=7)
        for seq, kind in enumerate(KINDS):
            yield n, made, pending(kind, f"resp_t{n}", 1700000000 + n, extra, seq)


E = TypeVar("E", bound=Event)


def copied(kind: type[E], event: Event) -> E:
    """`event` as an instance of the subclass `kind`, its slots set past any setter of it."""
    made = kind.__new__(kind)
    for name in ("raw", "name", "data", "at"):
        getattr(Event, name).__set__(made, getattr(event, name))
    return made


def test_an_event_type_with_its_own_setattr_is_left_to_the_python_path() -> None:
    """An event's bytes are written at their slots' offsets only for a type with the
    generic getattr and setattr: the compiled path declines a subclass with its own
    `__setattr__`, which sees what the Python path sets."""
    seen: list[str] = []

    class Watched(Event):
        __slots__ = ()

        def __setattr__(self, name: str, value: Any) -> None:
            seen.append(name)
            super().__setattr__(name, value)

    for n, made, event in three_turns():
        watched = copied(Watched, event)
        seen.clear()
        assert _c.pending_event(made, watched, *lasts()) is None
        assert watched.raw is event.raw and not seen
        done = made.pending_event(watched)
        if n >= 2:  # (the usual event, changed in place)
            assert done is watched and "raw" in seen and "data" in seen
        assert b'"previous_response_id":"resp_prev%d"' % n in framed(done)


class Unsettable(Event):
    """An event whose data cannot be set (its raw bytes can)."""

    __slots__ = ()

    @property  # type: ignore[override]
    def data(self) -> bytes:
        return Event.data.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @data.setter
    def data(self, value: bytes) -> None:
        raise AttributeError("data is read-only")


def test_an_event_whose_data_cannot_be_set_is_left_as_it_was() -> None:
    """The compiled path sets an event's raw bytes and its data both or neither: an event
    whose data is not a slot is declined before its raw bytes are changed."""
    for n, made, event in three_turns():
        if n < 2:  # (the shapes seen, the members worked out)
            made.pending_event(event)
            continue
        fixed = copied(Unsettable, event)
        assert _c.pending_event(made, fixed, *lasts()) is None
        assert (fixed.raw, fixed.data) == (event.raw, event.data)
