"""The store cuts the members the envelope filled in out of a turn's response (Turn.fill)
where the turn says they are: the compiled cut is the Python one, byte for byte."""

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
    assert SPEEDUPS.cut(data, at, part) == _cut_bytes(data, at, part)


@pytest.mark.parametrize(
    ("data", "at", "part", "bare"),
    [
        (b'{"id":"r","a":1,"b":2}', 10, b'"a":1,', b'{"id":"r","b":2}'),
        (b'{"id":"r","a":1}', 10, b',"a":1', None),  # (not there: one byte off)
        (b'{"id":"r","a":1}', 9, b',"a":1', b'{"id":"r"}'),
        (b"{}", 1, b"}x", None),  # (past the end)
        (b"{}", -1, b"}", None),
        (b"{}", 2**70, b"}", None),
    ],
)
def test_a_cut_takes_out_only_what_is_there(
    data: bytes, at: int, part: bytes, bare: bytes | None
) -> None:
    assert SPEEDUPS is not None
    assert SPEEDUPS.cut(data, at, part) == bare
    if at < 2**63:
        assert _cut_bytes(data, at, part) == bare
