"""upstream/sse.py: incremental SSE framing; raw bytes kept for untouched relay."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ocxproxy.h1 import chunk
from ocxproxy.speedups import SPEEDUPS
from ocxproxy.upstream import sse
from ocxproxy.upstream.sse import (
    Event,
    EventSplitter,
    _wire,
    encode_event,
    framed,
    head_of,
    parse_event,
    with_data,
)

LF = b'event: response.created\ndata: {"a":1}\n\n: keep-alive\n\ndata: [DONE]\n\n'
CRLF = LF.replace(b"\n", b"\r\n")
CR = LF.replace(b"\n", b"\r")


@pytest.mark.parametrize(
    ("raw", "name", "data", "comment"),
    [
        (b"event: x\ndata: {}\n\n", "x", b"{}", False),
        (b"data:{}\n\n", None, b"{}", False),  # no space after the colon
        (b"data:  two\n\n", None, b" two", False),  # only one leading space is dropped
        (b"data: a\ndata: b\n\n", None, b"a\nb", False),  # multi-line data joins with \n
        (b"event:  spaced \r\ndata: 1\r\n\r\n", "spaced", b"1", False),
        (b"id: 7\nretry: 10\ndata: x\n\n", None, b"x", False),  # other fields ignored
        (b": comment\n\n", None, b"", True),
        (b"\n\n", None, b"", True),
        (b"event: ping\n\n", "ping", b"", False),
    ],
)
def test_parse_event(raw: bytes, name: str | None, data: bytes, comment: bool) -> None:
    event = parse_event(raw)
    is_comment = event.name is None and not event.data
    assert (event.raw, event.name, event.data, is_comment) == (raw, name, data, comment)


_VALUE = st.binary(max_size=12).filter(lambda b: b"\n" not in b and b"\r" not in b)
_LINE = st.one_of(
    st.builds(lambda v: b"data:" + v, _VALUE),
    st.builds(lambda v: b"data: " + v, _VALUE),
    st.builds(lambda v: b"event:" + v, _VALUE),
    st.builds(lambda v: b"id: " + v, _VALUE),
    st.just(b": comment"),
)


@given(st.lists(_LINE, min_size=1, max_size=4), st.sampled_from([b"\n", b"\r\n"]))
def test_any_event_parses_as_the_spec_says(lines: list[bytes], end: bytes) -> None:
    """The fast path (one LF `data:` line, maybe after `event:`) and the general one agree
    with a plain reading of the spec, whatever the lines."""
    raw = end.join(lines) + end + end
    name, data = None, []
    for line in lines:
        if line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    event = parse_event(raw)
    assert (event.raw, event.name, event.data) == (raw, name, b"\n".join(data))


@pytest.mark.parametrize("stream", [LF, CRLF, CR], ids=["lf", "crlf", "cr"])
def test_splitter_finds_events_at_every_chunk_boundary(stream: bytes) -> None:
    whole = EventSplitter().feed(stream)
    assert [e.data for e in whole] == [b'{"a":1}', b"", b"[DONE]"]
    assert [e.name for e in whole] == ["response.created", None, None]
    for cut in range(len(stream) + 1):
        splitter = EventSplitter()
        events = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:]) + splitter.flush()
        assert events == whole, cut
        assert b"".join(e.raw for e in events) == stream  # relayed bytes are untouched


def test_splitter_byte_by_byte() -> None:
    splitter = EventSplitter()
    events: list[Event] = []
    for i in range(len(CRLF)):
        events += splitter.feed(CRLF[i : i + 1])
    assert b"".join(e.raw for e in events) == CRLF
    assert splitter.flush() == []


def test_splitter_keeps_incomplete_tail_until_more_arrives() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: 1\n") == []
    assert splitter.feed(b"\ndata: 2") == [parse_event(b"data: 1\n\n")]
    assert splitter.feed(b"") == []
    assert splitter.flush() == [Event(b"data: 2\n\n", None, b"2")]
    assert splitter.flush() == []


@pytest.mark.parametrize("rest", [b"", b"\n", b"  \n"])
def test_flush_of_blank_rest_is_nothing(rest: bytes) -> None:
    splitter = EventSplitter()
    assert splitter.feed(rest) == []
    assert splitter.flush() == []


@pytest.mark.parametrize(
    ("name", "data", "raw"),
    [
        ("response.created", b"{}", b"event: response.created\ndata: {}\n\n"),
        (None, b"[DONE]", b"data: [DONE]\n\n"),
    ],
)
def test_encode_event_round_trips(name: str | None, data: bytes, raw: bytes) -> None:
    assert encode_event(name, data) == raw
    assert parse_event(raw) == Event(raw, name, data)


NEW = b'{"b":2}'


@pytest.mark.parametrize(
    ("raw", "written"),
    [
        (b'event: response.completed\ndata: {"a":1}\n\n', b""),  # plain: framed by wire
        (b'data: {"a":1}\n\n', b""),
        (b'event:x\ndata: {"a":1}\n\n', b'event:x\ndata: {"b":2}\n\n'),  # kept as it came
        (b'id: 7\nevent: x\ndata: {"a":1}\n\n', b'id: 7\nevent: x\ndata: {"b":2}\n\n'),
        (b"event: caf\xc3\xa9\ndata: 1\n\n", b"event: caf\xc3\xa9\ndata: " + NEW + b"\n\n"),
        (b"event: x\r\ndata: 1\r\n\r\n", b"event: x\ndata: " + NEW + b"\n\n"),  # re-encoded
    ],
)
def test_a_rewritten_plain_event_is_framed_where_it_is_written(raw: bytes, written: bytes) -> None:
    """An event framed plainly (`event: <name>`, one `data:` line) gets its new payload
    without new raw bytes: `wire` writes its head, payload and blank line. Any other
    framing is kept (its other lines with it), or re-encoded (CRLF)."""
    event = parse_event(raw)
    new = with_data(event, NEW)
    assert (new.raw, new.name, new.data) == (written, event.name, NEW)
    expected = written or raw.replace(b'{"a":1}', NEW)
    assert framed(new) == b"".join(_wire([new], False)) == expected
    assert parse_event(framed(new)) == new
    again = with_data(new, b"[]")  # (rewritten twice: framed as its bytes read back are)
    assert parse_event(framed(again)) == Event(b"", event.name, b"[]")
    assert again.raw == with_data(parse_event(framed(new)), b"[]").raw
    assert (again.raw == b"") == (written == b"" or raw.endswith(b"\r\n\r\n"))


def test_the_heads_kept_for_names_are_a_few() -> None:
    for i in range(200):
        assert head_of(f"name.{i}") == b"event: name.%d\ndata: " % i
    assert len(sse._HEADS) <= 64
    assert head_of("caf\u00e9") is None and head_of("a\nb") is None


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from([None, "response.created", "x", "caf\u00e9"]),
        st.binary(max_size=16).filter(lambda b: b"\n" not in b and b"\r" not in b),
        st.booleans(),
    ),
    max_size=6,
)


@pytest.mark.skipif(SPEEDUPS is None, reason="the compiled fast paths are not built here")
@given(_EVENTS)
def test_the_compiled_wire_writes_what_the_python_one_does(
    specs: list[tuple[str | None, bytes, bool]],
) -> None:
    """Events as they came and events without raw bytes (some with names `with_data`
    never leaves unframed, made by hand): the same bytes written, the raw ones as they are."""
    events = [
        Event(b"", name, data) if bare else parse_event(encode_event(name, data))
        for name, data, bare in specs
    ]
    assert SPEEDUPS is not None
    parts = SPEEDUPS.wire(events, False)
    assert b"".join(parts) == b"".join(_wire(events, False))
    assert SPEEDUPS.wire(events, True) == list(chunk(*parts))  # (as one chunk, h1's framing)
    assert [parse_event(framed(event)) for event in events] == events
    raws = [event.raw for event in events if event.raw]
    assert [part for part in parts if any(part is raw for raw in raws)] == raws  # not copied
