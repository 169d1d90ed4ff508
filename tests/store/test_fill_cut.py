"""The store cuts out of a turn's response, in one copy, the members the envelope filled in
(Turn.fill) where the turn says they are and the output where the turn found it
(Turn.output_at): the compiled cut is the Python one, byte for byte."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ocxproxy.speedups import SPEEDUPS
from ocxproxy.store.local.store import _cut_bytes

pytestmark = pytest.mark.skipif(SPEEDUPS is None, reason="not built here")


@given(st.binary(max_size=40), st.binary(max_size=8), st.integers(-3, 60))
def test_the_compiled_cut_is_the_pythons(data: bytes, part: bytes, at: int) -> None:
    assert SPEEDUPS is not None
    assert SPEEDUPS.cut(data, at, part, None) == _cut_bytes(data, at, part, None)


@given(st.binary(max_size=40), st.data())
def test_a_span_is_cut_with_the_part(data: bytes, draw: st.DataObject) -> None:
    """Both out of one copy, the span before or after the part, or alone."""
    assert SPEEDUPS is not None
    size = len(data)
    at = draw.draw(st.integers(0, size))
    n = draw.draw(st.integers(0, size - at))
    part = data[at : at + n]
    before = draw.draw(st.booleans()) if n else True
    low, high = (0, at) if before else (at + n, size)
    start = draw.draw(st.integers(low, high))
    length = draw.draw(st.integers(0, high - start))
    kept = SPEEDUPS.cut(data, at, part, (start, length))
    assert kept == _cut_bytes(data, at, part, (start, length))
    runs = sorted(((at, n), (start, length)))
    expected = data[: runs[0][0]] + data[sum(runs[0]) : runs[1][0]] + data[sum(runs[1]) :]
    assert kept == expected


@pytest.mark.parametrize(
    ("data", "at", "part", "span", "kept"),
    [
        (b'{"id":"r","a":1,"b":2}', 10, b'"a":1,', None, b'{"id":"r","b":2}'),
        (b'{"id":"r","a":1}', 10, b',"a":1', None, None),  # (not there: one byte off)
        (b'{"id":"r","a":1}', 9, b',"a":1', None, b'{"id":"r"}'),
        (b'{"id":"r","a":1}', 9, b',"a":1', (7, 1), b'{"id":""}'),
        (b'{"id":"r","a":1}', 9, b',"a":1', (6, 0), b'{"id":"r"}'),
        (b'{"o":[1],"a":1}', -1, b"", (6, 1), b'{"o":[],"a":1}'),
        (b'{"o":[1],"a":1}', 8, b',"a":1', (6, 1), b'{"o":[]}'),
        (b"{}", 1, b"}x", None, None),  # (past the end)
        (b"{}", -1, b"}", None, None),
        (b"{}", 2**70, b"}", None, None),
        (b"{}", 2**70, b"}", (0, 1), None),
    ],
)
def test_a_cut_takes_out_only_what_is_there(
    data: bytes, at: int, part: bytes, span: tuple[int, int] | None, kept: bytes | None
) -> None:
    assert SPEEDUPS is not None
    assert SPEEDUPS.cut(data, at, part, span) == kept
    assert _cut_bytes(data, at, part, span) == kept


@pytest.mark.parametrize("span", [(5, 3), (0, 7), (2, 30), (-1, 1)])
def test_a_span_over_the_part_or_past_the_end_is_an_error(span: tuple[int, int]) -> None:
    """(The store never asks for one: it finds the output anew when the fill is before it.)"""
    assert SPEEDUPS is not None
    data = b'{"o":[1],"a":1}'
    with pytest.raises(ValueError):
        SPEEDUPS.cut(data, 6, b"1]", span)
    if span[0] >= 0 and sum(span) <= len(data):  # (the Python's slices take any span)
        with pytest.raises(ValueError):
            _cut_bytes(data, 6, b"1]", span)
