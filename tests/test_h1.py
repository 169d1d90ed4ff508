# ruff: noqa: E501  (the tables read best one case a line)
"""ocxproxy/h1.py: requests and answers in, heads and bodies or BadMessage out. Tables of
raw messages, each fed whole, one byte at a time, and (for the front end's way of reading)
head then body from a buffer; no sockets."""

from __future__ import annotations

import pytest

from ocxproxy.h1 import (
    MAX_FIELD,
    MAX_HEAD,
    MAX_HEADERS,
    BadMessage,
    RequestParser,
    ResponseParser,
    chunk,
    encode_fields,
    status_line,
)


def request(
    *lines: str | bytes, body: bytes = b"", line: bytes = b"POST /v1/responses HTTP/1.1"
) -> bytes:
    raw = [line] + [x.encode() if isinstance(x, str) else x for x in lines]
    return b"\r\n".join(raw) + b"\r\n\r\n" + body


def answer(*lines: str | bytes, body: bytes = b"", line: bytes = b"HTTP/1.1 200 OK") -> bytes:
    return request(*lines, body=body, line=line)


def split(raw: bytes, how: str) -> list[bytes]:
    return [raw] if how == "whole" else [raw[i : i + 1] for i in range(len(raw))]


# -- requests ------------------------------------------------------------------------------

GOOD_REQUESTS = [
    # (id, raw, method, target, body, keep_alive)
    ("plain", request("Host: p", "Content-Length: 2", body=b"hi"), "POST", "/v1/responses", b"hi", True),
    ("close", request("Host: p", "Connection: close", "Content-Length: 0"), "POST", "/v1/responses", b"", False),
    (
        "chunked with extension and trailer",
        request("Host: p", "Transfer-Encoding: chunked", body=b"5;x=1\r\nhello\r\n0\r\nT: 1\r\n\r\n"),
        "POST", "/v1/responses", b"hello", True,
    ),
    ("upper-case chunked", request("Host: p", "Transfer-Encoding: CHUNKED", body=b"0\r\n\r\n"), "POST", "/v1/responses", b"", True),
    ("query", request("Host: p", line=b"GET /v1/models?a=1&b=%20 HTTP/1.1"), "GET", "/v1/models?a=1&b=%20", b"", True),
    ("HTTP/1.0 without Host", request(line=b"GET / HTTP/1.0"), "GET", "/", b"", False),
    ("HTTP/1.0 keep-alive", request("Connection: keep-alive", line=b"GET / HTTP/1.0"), "GET", "/", b"", True),
    ("non-ASCII value", request("Host: p", "X-Name: café", "Content-Length: 0"), "POST", "/v1/responses", b"", True),
    ("tab in a value", request("Host: p", "X-A: a\tb", "Content-Length: 0"), "POST", "/v1/responses", b"", True),
    (f"{MAX_HEADERS} fields", request("Host: p", *[f"X-{i}: v" for i in range(MAX_HEADERS - 1)]), "POST", "/v1/responses", b"", True),
    (f"a {MAX_FIELD}-byte value", request("Host: p", "X-Big: " + "v" * MAX_FIELD), "POST", "/v1/responses", b"", True),
]  # fmt: skip


@pytest.mark.parametrize("how", ["whole", "bytewise"])
@pytest.mark.parametrize(
    ("raw", "method", "target", "body", "keep_alive"),
    [case[1:] for case in GOOD_REQUESTS],
    ids=[case[0] for case in GOOD_REQUESTS],
)
def test_a_good_request_is_read(
    raw: bytes, method: str, target: str, body: bytes, keep_alive: bool, how: str
) -> None:
    parser = RequestParser()
    for piece in split(raw, how):
        parser.feed(piece)
    head = parser.head
    assert head is not None and parser.complete
    assert (head.method, head.target, head.keep_alive) == (method, target, keep_alive)
    assert b"".join(parser.body) == body


def test_header_fields_keep_their_order_case_and_bytes() -> None:
    parser = RequestParser()
    parser.feed(request("Host: p", "X-A: 1", "x-a: 2", "X-Name: café", "Content-Length: 0"))
    assert parser.head is not None
    assert list(parser.head.headers.items()) == [
        ("Host", "p"), ("X-A", "1"), ("x-a", "2"), ("X-Name", "café"), ("Content-Length", "0"),
    ]  # fmt: skip
    assert (parser.head.length, parser.head.chunked) == (0, False)


BAD_REQUESTS = [
    # today's cases (they got 400 and a close before this module too)
    ("CL and TE", request("Host: p", "Content-Length: 5", "Transfer-Encoding: chunked", body=b"0\r\n\r\n")),
    ("duplicate CL", request("Host: p", "Content-Length: 2", "Content-Length: 2", body=b"hi")),
    ("conflicting CL", request("Host: p", "Content-Length: 2", "Content-Length: 3", body=b"hi")),
    ("CL list", request("Host: p", "Content-Length: 2, 2", body=b"hi")),
    ("CL sign", request("Host: p", "Content-Length: +2", body=b"hi")),
    ("CL not ASCII digits", request("Host: p", "Content-Length: ²", body=b"hi")),
    ("TE gzip", request("Host: p", "Transfer-Encoding: gzip", body=b"hi")),
    ("TE chunked then gzip", request("Host: p", "Transfer-Encoding: chunked, gzip", body=b"0\r\n\r\n")),
    ("TE gzip, chunked", request("Host: p", "Transfer-Encoding: gzip, chunked", body=b"0\r\n\r\n")),
    ("TE over two lines", request("Host: p", "Transfer-Encoding: gzip", "Transfer-Encoding: chunked", body=b"0\r\n\r\n")),
    ("TE xchunked", request("Host: p", "Transfer-Encoding: xchunked", body=b"0\r\n\r\n")),
    ("chunk size zz", request("Host: p", "Transfer-Encoding: chunked", body=b"zz\r\n")),
    ("chunk size 0x5", request("Host: p", "Transfer-Encoding: chunked", body=b"0x5\r\nhello\r\n0\r\n\r\n")),
    ("chunk size with a space", request("Host: p", "Transfer-Encoding: chunked", body=b"5 5\r\nhello\r\n0\r\n\r\n")),
    ("chunk size -5", request("Host: p", "Transfer-Encoding: chunked", body=b"-5\r\nhello\r\n0\r\n\r\n")),
    ("chunk without CRLF", request("Host: p", "Transfer-Encoding: chunked", body=b"3\r\nabcX\r\n0\r\n\r\n")),
    ("obs-fold", request("Host: p", "X-A: a", " b", "Content-Length: 0")),
    ("no colon", request("Host: p", "NoColonHere", "Content-Length: 0")),
    ("space before colon", request("Host: p", "X-Spaced : v", "Content-Length: 0")),
    ("space in a name", request("Host: p", "X Spaced: v", "Content-Length: 0")),
    ("empty name", request("Host: p", ": v", "Content-Length: 0")),
    ("bare LF in a value", request("Host: p", b"X-Odd: b\nX-Injected: 1", "Content-Length: 0")),
    ("bare CR in a value", request("Host: p", b"X-Odd: b\rc", "Content-Length: 0")),
    ("NUL in a value", request("Host: p", b"X-Odd: b\x00c", "Content-Length: 0")),
    ("DEL in a value", request("Host: p", b"X-Odd: b\x7fc", "Content-Length: 0")),
    ("control byte in the target", request("Host: p", line=b"POST /v1/responses?a\x01b HTTP/1.1")),
    ("non-ASCII target", request("Host: p", line=b"POST /v1/responses?x=\xff HTTP/1.1")),
    ("bare LF in the target", request("Host: p", line=b"POST /v1/responses?a\nX-Injected:1 HTTP/1.1")),
    ("HTTP/2 line", request("Host: p", line=b"POST / HTTP/2.0")),
    # the target and names
    ("tab in the target", request("Host: p", line=b"POST /v1/responses?a=1\tHTTP/1.0 HTTP/1.1")),
    ("space in the target", request("Host: p", line=b"POST /v1/res ponses HTTP/1.1")),
    ("non-token name", request("Host: p", 'X(a)@"b"{c}: 1', "Content-Length: 0")),
    ("non-ASCII name", request("Host: p", "Xé: 1", "Content-Length: 0")),
    ("no Host on 1.1", request("Content-Length: 0")),
    ("two Hosts", request("Host: a", "Host: b", "Content-Length: 0")),
    ("two Hosts on 1.0", request("Host: a", "Host: b", line=b"GET / HTTP/1.0")),
    # malformed line ends
    ("head ending LF CR LF", b"POST /v1/responses HTTP/1.1\r\nHost: p\r\nContent-Length: 0\n\r\n"),
    ("bare LF line ends", b"GET /healthz HTTP/1.1\nHost: p\n\n"),
    ("bare CR line ends", b"GET /healthz HTTP/1.1\rHost: p\r\r"),
    ("bare CR after the request line", b"POST /v1/responses HTTP/1.1\rHost: p\r\n\r\n"),
    # aiohttp's limits
    (f"{MAX_HEADERS + 1} fields", request("Host: p", *[f"X-{i}: v" for i in range(MAX_HEADERS)])),
    ("a value over the limit", request("Host: p", "X-Big: " + "v" * (MAX_FIELD + 1))),
    ("a name over the limit", request("Host: p", "X" * (MAX_FIELD + 1) + ": v")),
    ("a target over the limit", request("Host: p", line=b"GET /" + b"a" * MAX_FIELD + b" HTTP/1.1")),
]  # fmt: skip


@pytest.mark.parametrize("how", ["whole", "bytewise"])
@pytest.mark.parametrize(
    "raw", [case[1] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_a_bad_request_is_refused(raw: bytes, how: str) -> None:
    parser = RequestParser()
    with pytest.raises(BadMessage):
        for piece in split(raw, how):
            parser.feed(piece)


@pytest.mark.parametrize(
    "raw", [case[1] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_a_bad_request_is_refused_the_front_ends_way(raw: bytes) -> None:
    """As the front end reads: the head from a buffer, then a Content-Length body."""
    parser = RequestParser()
    with pytest.raises(BadMessage):
        head = parser.feed_head(bytearray(raw))
        assert head is not None
        if head.length is not None:
            parser.feed_body(bytearray(raw))
        else:  # not read by the front end: the rest as it comes
            parser.feed(raw[head.size :])


def test_the_front_ends_way_reads_pipelined_requests_one_at_a_time() -> None:
    second = request("Host: p", "Content-Length: 3", body=b"two")
    other = request("Host: p", "Transfer-Encoding: chunked", body=b"3\r\nabc\r\n0\r\n\r\n")
    buffer = bytearray(request("Host: p", "Content-Length: 3", body=b"one") + second + other)
    parser = RequestParser()
    bodies = []
    for _ in range(2):
        head = parser.feed_head(buffer)
        assert head is not None and head.length == 3
        bodies.append(parser.feed_body(buffer))
    assert bodies == [b"one", b"two"]
    head = parser.feed_head(buffer)  # the head only: its body is left in the buffer
    assert head is not None and head.chunked and head.length is None
    assert bytes(buffer) == other  # the whole request, to hand on as it came
    assert head.size == other.index(b"\r\n\r\n") + 4


def test_the_front_ends_way_waits_for_a_head_dribbled_in() -> None:
    raw = request("Host: p", "Content-Length: 2", body=b"hi")
    buffer = bytearray()
    parser = RequestParser()
    heads = []
    for i in range(len(raw)):
        buffer += raw[i : i + 1]
        heads.append(parser.feed_head(buffer))
    end = raw.index(b"\r\n\r\n") + 4
    assert heads[: end - 1] == [None] * (end - 1)
    assert heads[end - 1] is not None
    assert parser.feed_body(buffer) == b"hi" and buffer == b""


def test_leading_empty_lines_before_a_request_are_skipped() -> None:
    buffer = bytearray(b"\r\n\r\n" + request("Host: p", "Content-Length: 0"))
    head = RequestParser().feed_head(buffer)
    assert head is not None and head.method == "POST"


def test_an_endless_head_is_refused_at_the_bound() -> None:
    parser = RequestParser()
    buffer = bytearray(b"POST / HTTP/1.1\r\nHost: p\r\nX-Long: ")
    with pytest.raises(BadMessage):
        while len(buffer) <= MAX_HEAD + 10:
            buffer += b"v" * 4096
            parser.feed_head(buffer)


@pytest.mark.parametrize(
    ("raw", "expect", "upgrade"),
    [
        (request("Host: p", "Expect: 100-continue", "Content-Length: 1"), True, False),
        (request("Host: p", "Connection: Upgrade", "Upgrade: websocket"), False, True),
    ],
)
def test_expect_and_upgrade_are_seen(raw: bytes, expect: bool, upgrade: bool) -> None:
    head = RequestParser().feed_head(bytearray(raw))
    assert head is not None and (head.expect, head.upgrade) == (expect, upgrade)


# -- answers -------------------------------------------------------------------------------

CHUNKED = answer(
    "Transfer-Encoding: chunked",
    "X-Kind: chunked",
    body=b'5;ext=1\r\nhello\r\n1\r\n \r\nA;name="quoted"\r\nchunked!!!\r\n0\r\nX-T: t\r\n\r\n',
)

GOOD_ANSWERS = [
    # (id, raw, head_only, status, body, keep_alive)
    ("length", answer("Content-Length: 2", body=b"hi"), False, 200, b"hi", True),
    ("chunked", CHUNKED, False, 200, b"hello chunked!!!", True),
    ("interim first", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: <x>\r\n\r\n" + answer("Content-Length: 1", body=b"x"), False, 200, b"x", True),
    ("no reason", answer("Content-Length: 0", line=b"HTTP/1.1 200"), False, 200, b"", True),
    ("599", answer("Content-Length: 0", line=b"HTTP/1.1 599 X"), False, 599, b"", True),
    ("close", answer("Connection: close", "Content-Length: 2", body=b"hi"), False, 200, b"hi", False),
    ("HTTP/1.0", answer("Content-Length: 2", body=b"hi", line=b"HTTP/1.0 200 OK"), False, 200, b"hi", False),
    ("204 with a length", answer("Content-Length: 42", line=b"HTTP/1.1 204 No Content"), False, 204, b"", True),
    ("304 with a length", answer("Content-Length: 42", line=b"HTTP/1.1 304 NM"), False, 304, b"", True),
    ("HEAD with a length", answer("Content-Length: 42"), True, 200, b"", True),
]  # fmt: skip


@pytest.mark.parametrize("how", ["whole", "bytewise"])
@pytest.mark.parametrize(
    ("raw", "head_only", "status", "body", "keep_alive"),
    [case[1:] for case in GOOD_ANSWERS],
    ids=[case[0] for case in GOOD_ANSWERS],
)
def test_a_good_answer_is_read_to_its_framed_end(
    raw: bytes, head_only: bool, status: int, body: bytes, keep_alive: bool, how: str
) -> None:
    parser = ResponseParser(head_only=head_only)
    for piece in split(raw, how):
        parser.feed(piece)
    assert (parser.status, parser.complete, parser.trailing) == (status, True, False)
    assert b"".join(parser.body) == body
    assert parser.keep_alive == keep_alive


def test_an_answers_head_reads_as_it_came() -> None:
    parser = ResponseParser()
    parser.feed(
        answer(
            "Content-Length: 0",
            "X-Thing: one",
            "x-thing: two",
            "X-Name: café",
            line=b"HTTP/1.1 201 Created Now",
        )
    )
    assert (parser.status, parser.reason, parser.content_length) == (201, "Created Now", 0)
    assert parser.headers.getall("X-THING") == ["one", "two"]
    assert parser.headers["X-Name"] == "café"
    assert "Link" not in parser.headers


def test_an_answer_without_framing_runs_to_the_close_and_is_not_reused() -> None:
    parser = ResponseParser()
    parser.feed(answer("X-A: 1", body=b"until the end"))
    assert (parser.status, parser.complete, parser.keep_alive) == (200, False, False)
    assert (parser.content_length, parser.chunked) == (None, False)
    assert b"".join(parser.body) == b"until the end"


@pytest.mark.parametrize(
    "after", [b"X", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"], ids=["byte", "answer"]
)
@pytest.mark.parametrize("how", ["same read", "later read"])
def test_bytes_after_the_framed_end_mark_the_answer_trailing(after: bytes, how: str) -> None:
    parser = ResponseParser()
    raw = answer("Content-Length: 2", body=b"hi")
    if how == "same read":
        parser.feed(raw + after)
    else:
        parser.feed(raw)
        assert not parser.trailing
        parser.feed(after)
    assert (parser.complete, parser.trailing, b"".join(parser.body)) == (True, True, b"hi")


def test_a_body_after_a_head_answer_marks_it_trailing() -> None:
    parser = ResponseParser(head_only=True)
    parser.feed(answer("Content-Length: 3", body=b"abc"))
    assert (parser.complete, parser.trailing, parser.body) == (True, True, [])


BAD_ANSWERS = [
    # framing in doubt: request smuggling and response desyncs
    ("CL 5 then 160", answer("Content-Length: 5", "Content-Length: 160", body=b"hello")),
    ("CL twice the same", answer("Content-Length: 5", "Content-Length: 5", body=b"hello")),
    ("TE xchunked", answer("Transfer-Encoding: xchunked", body=b"hello")),
    ("TE gzip then chunked", answer("Transfer-Encoding: gzip", "Transfer-Encoding: chunked", body=b"5\r\nhello\r\n0\r\n\r\n")),
    ("TE gzip, chunked", answer("Transfer-Encoding: gzip, chunked", body=b"5\r\nhello\r\n0\r\n\r\n")),
    ("TE chunked twice", answer("Transfer-Encoding: chunked", "Transfer-Encoding: chunked", body=b"0\r\n\r\n")),
    ("CL and TE", answer("Content-Length: 2", "Transfer-Encoding: chunked", body=b"0\r\n\r\n")),
    # status and names
    ("status 000", answer("Content-Length: 0", line=b"HTTP/1.1 000 Zero")),
    ("status 099", answer("Content-Length: 0", line=b"HTTP/1.1 099 X")),
    ("status 600", answer("Content-Length: 0", line=b"HTTP/1.1 600 X")),
    ("status 999", answer("Content-Length: 0", line=b"HTTP/1.1 999 X")),
    ("101 not asked for", answer("Connection: upgrade", "Upgrade: h2c", line=b"HTTP/1.1 101 Switching")),
    ("non-token name", answer('X(a)@"b"{c}: 1', "Content-Length: 0")),
    ("non-ASCII name", answer("Xé: 1", "Content-Length: 0")),
    # today's cases
    ("HTTP/2", answer("Content-Length: 0", line=b"HTTP/2 200 OK")),
    ("ICY", answer("Content-Length: 0", line=b"ICY 200 OK")),
    ("two-digit status", answer("Content-Length: 0", line=b"HTTP/1.1 20 OK")),
    ("letters for a status", answer("Content-Length: 0", line=b"HTTP/1.1 abc OK")),
    ("non-ASCII digit in the status", answer("Content-Length: 0", line=b"HTTP/1.1 2\xb20 OK")),
    ("garbage", b"garbage\r\n\r\n"),
    ("obs-fold", answer(" Folded: x", "Content-Length: 0")),
    ("no colon", answer("No colon here", "Content-Length: 0")),
    ("space before colon", answer("Bad : space", "Content-Length: 0")),
    ("bare LF in a value", answer(b"Split: a\nInjected: 1", "Content-Length: 0")),
    ("bare CR in a value", answer(b"Cr: a\rb", "Content-Length: 0")),
    ("NUL in a value", answer(b"Nul: a\x00b", "Content-Length: 0")),
    ("bare LF line ends", b"HTTP/1.1 200 OK\nContent-Length: 0\n\n"),
    ("CL abc", answer("Content-Length: abc")),
    ("CL -1", answer("Content-Length: -1")),
    ("CL 1, 1", answer("Content-Length: 1, 1", body=b"x")),
    ("CL not ASCII", answer(b"Content-Length: \xb2")),
    ("chunk size zz", answer("Transfer-Encoding: chunked", body=b"zz\r\n")),
    ("empty chunk size", answer("Transfer-Encoding: chunked", body=b"\r\n")),
    ("chunk size -5", answer("Transfer-Encoding: chunked", body=b"-5\r\n")),
    ("chunk size 5 5", answer("Transfer-Encoding: chunked", body=b"5 5\r\n")),
    ("chunk size 0x5", answer("Transfer-Encoding: chunked", body=b"0x5\r\n")),
    ("chunk size +5", answer("Transfer-Encoding: chunked", body=b"+5\r\n")),
    ("chunk size 5_0", answer("Transfer-Encoding: chunked", body=b"5_0\r\n")),
    ("chunk without CRLF", answer("Transfer-Encoding: chunked", body=b"3\r\nabcX\r\n0\r\n\r\n")),
    (f"{MAX_HEADERS + 1} fields", answer(*[f"X-{i}: v" for i in range(MAX_HEADERS + 1)])),
    ("a value over the limit", answer("X-Big: " + "v" * (MAX_FIELD + 1))),
]  # fmt: skip


@pytest.mark.parametrize("how", ["whole", "bytewise"])
@pytest.mark.parametrize("raw", [case[1] for case in BAD_ANSWERS], ids=[c[0] for c in BAD_ANSWERS])
def test_a_bad_answer_is_refused(raw: bytes, how: str) -> None:
    parser = ResponseParser()
    with pytest.raises(BadMessage):
        for piece in split(raw, how):
            parser.feed(piece)
    assert not parser.complete


def test_the_reason_for_a_refusal_is_said() -> None:
    with pytest.raises(BadMessage, match="Transfer-Encoding other than chunked"):
        ResponseParser().feed(answer("Transfer-Encoding: xchunked"))
    with pytest.raises(BadMessage, match="Duplicate Content-Length"):
        ResponseParser().feed(answer("Content-Length: 5", "Content-Length: 160"))
    with pytest.raises(BadMessage, match="status 0 is not 100-599"):
        ResponseParser().feed(answer(line=b"HTTP/1.1 000 X"))


# -- writing -------------------------------------------------------------------------------


def test_a_chunk_and_status_lines_are_written_as_http_says() -> None:
    assert b"".join(chunk(b"x" * 300)) == b"12c\r\n" + b"x" * 300 + b"\r\n"
    # several parts are one chunk of them all, each part passed on as it is
    parts = (b"event: a\ndata: 1\n\n", b"", b"data: 22\n\n")
    framed = chunk(*parts)
    assert framed[1:-1] == parts and all(a is b for a, b in zip(framed[1:-1], parts, strict=True))
    assert b"".join(framed) == b"%x\r\n" % len(b"".join(parts)) + b"".join(parts) + b"\r\n"
    assert status_line(200) == b"HTTP/1.1 200 OK\r\n"
    assert status_line(599) == b"HTTP/1.1 599 \r\n"


def test_fields_with_a_line_break_are_never_written() -> None:
    assert encode_fields([("A", "1"), ("B", "café")]) == "A: 1\r\nB: café\r\n".encode()
    for value in ("a\r\nX-Evil: 1", "a\nb", "a\rb"):
        with pytest.raises(ValueError, match="line break"):
            encode_fields([("X", value)])
