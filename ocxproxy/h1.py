"""HTTP/1.1 messages, read by llhttp (through httptools) and checked for what a proxy must
refuse. No sockets here: bytes go in, heads and bodies come out, BadMessage says why not.

Both directions use it: the front end reads requests (http/front.py), the backend client
reads answers (upstream/http1.py). llhttp in its strict mode already refuses what used to
be checked by hand (bare CR or LF, obs-fold, control bytes, non-token header names,
Content-Length with Transfer-Encoding, a repeated Content-Length, bad chunk sizes); on top
of it this module refuses what llhttp lets through but a proxy must not pass on:

- any Transfer-Encoding other than one field that is exactly `chunked` (llhttp reads
  `gzip` then `chunked` as chunked, and an answer with `xchunked` as read-until-close);
- a version other than 1.0 and 1.1 (a bare LF in a target reads as HTTP/0.9);
- on a request: no Host, or more than one (RFC 9112 §3.2);
- on an answer: a status outside 100-599;
- more than MAX_HEADERS fields, or a target, name or value over MAX_FIELD bytes
  (aiohttp's limits, so both ways in accept the same heads).

An answer that cannot be framed exactly is the reason a pooled connection gets desynced;
so an answer counts as whole only at its framed end, and any byte after it marks the
connection as not reusable (`trailing`).
"""

from __future__ import annotations

import http

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "LAST_CHUNK",
    "MAX_FIELD",
    "MAX_HEAD",
    "MAX_HEADERS",
    "BadMessage",
    "RequestParser",
    "ResponseParser",
    "chunk",
    "encode_fields",
    "status_line",
]

MAX_HEADERS = 128  # header fields in one head (aiohttp's max_headers)
MAX_FIELD = 8190  # bytes of a target, a header name or a header value (aiohttp's limits)
MAX_HEAD = (MAX_HEADERS + 1) * (2 * MAX_FIELD + 4)  # a head still incomplete past this: refused

LAST_CHUNK = b"0\r\n\r\n"


class BadMessage(Exception):
    """A message that cannot be framed or passed on safely; the text says why."""


def chunk(*data: bytes) -> tuple[bytes, ...]:
    """One chunk of a chunked body holding the parts `data`, for `writelines` (never
    empty: that would end the body)."""
    return (b"%x\r\n" % sum(map(len, data)), *data, b"\r\n")


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or _status_line(status)


def encode_fields(items: list[tuple[str, str]]) -> bytes:
    """Header lines, each ending CRLF. ValueError if a name or value holds a line break,
    which would make two fields of one."""
    fields = "".join([f"{name}: {value}\r\n" for name, value in items])
    if fields.count("\n") != len(items) or fields.count("\r") != len(items):
        raise ValueError("a header holds a line break")
    return fields.encode("utf-8", "surrogateescape")


def _tokens(value: str) -> list[str]:
    return [token.strip().lower() for token in value.split(",")]


_SPECIAL_SIZES = frozenset(
    map(len, ("content-length", "transfer-encoding", "connection", "host", "expect"))
)


class _Fields:
    """What _headers() found in a head's fields."""

    __slots__ = ("chunked", "connection", "expect", "headers", "hosts", "length")

    def __init__(self) -> None:
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.length: int | None = None
        self.chunked = False
        self.connection: list[str] = []  # the Connection tokens, lower-case
        self.hosts = 0
        self.expect = False


class _Reader:
    """What both directions share: the fields of the head, the body as it comes, the end."""

    __slots__ = ("_fields", "_parser", "body", "complete", "keep_body", "trailing")

    _parser: httptools.HttpRequestParser | httptools.HttpResponseParser | None

    def __init__(self) -> None:
        self._fields: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []  # bytes of the body not yet taken
        self.keep_body = True  # False: the body is only framed, never kept
        self.complete = False  # the message ended at its framed end
        self.trailing = False  # bytes came after that end

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Parse `data`. BadMessage if the message is malformed or cannot be framed.
        Bytes past the end of a complete message (or after `release`) only set `trailing`."""
        parser = self._parser
        if self.complete or parser is None:
            if data:
                self.trailing = True
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # the head is read; what follows is another protocol's, not parsed here
        except httptools.HttpParserError as exc:
            if self.complete:  # llhttp read on into the bytes after the end
                self.trailing = True
                return
            cause = exc.__context__
            raise BadMessage(str(cause if isinstance(cause, BadMessage) else exc)) from None

    def release(self) -> None:
        """Done with this reader: drop llhttp's parser, whose callbacks are this reader's
        bound methods. That reference cycle would leave a finished reader to the cyclic GC,
        and `serve` freezes what is alive every second out of it (heap.py): a reader alive
        then (any answer streaming for over a second) would wait for the full pass."""
        self._parser = None

    # -- llhttp's callbacks (kept small: each costs a Python call) -----------------------

    def on_message_begin(self) -> None:
        if self.complete:
            self.trailing = True

    def on_header(self, name: bytes, value: bytes) -> None:
        fields = self._fields
        if len(fields) >= MAX_HEADERS:
            raise BadMessage(f"more than {MAX_HEADERS} header fields")
        if len(name) > MAX_FIELD or len(value) > MAX_FIELD:
            raise BadMessage(f"a header field over {MAX_FIELD} bytes")
        fields.append((name, value))

    def on_body(self, body: bytes) -> None:
        if self.complete:  # the body of an answer to HEAD: not expected, not reused
            self.trailing = True
        elif self.keep_body:
            self.body.append(body)

    def _headers(self) -> _Fields:
        """The fields as text, and what framing and routing need of them. BadMessage for
        the framing llhttp allows but a proxy must not (see the module's docstring)."""
        items = []
        found = _Fields()
        encodings = 0
        for raw_name, raw_value in self._fields:
            # A token is ASCII (llhttp checked); values keep their bytes as they came.
            name = raw_name.decode("latin-1")
            value = raw_value.decode("utf-8", "surrogateescape")
            items.append((name, value))
            if len(name) in _SPECIAL_SIZES:  # most names are none of these: skip lower()
                lower = name.lower()
                if lower == "content-length":
                    found.length = int(value)  # llhttp allows one, of digits only
                elif lower == "transfer-encoding":
                    encodings += 1
                    if encodings > 1 or value.strip().lower() != "chunked":
                        raise BadMessage("a Transfer-Encoding other than chunked")
                    found.chunked = True
                elif lower == "connection":
                    found.connection += _tokens(value)
                elif lower == "host":
                    found.hosts += 1
                elif lower == "expect":
                    found.expect = True
        self._fields = []
        found.headers = CIMultiDict(items)
        return found

    def _version(self) -> str:
        assert self._parser is not None  # (only asked from llhttp's callbacks)
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise BadMessage(f"HTTP/{version} is not HTTP/1.x")
        return version


class RequestHead:
    """A request's line and headers, as the front end reads them."""

    __slots__ = (
        "chunked",
        "expect",
        "headers",
        "keep_alive",
        "length",
        "method",
        "size",
        "target",
        "upgrade",
        "version",
    )

    def __init__(self, method: str, target: str, version: str, fields: _Fields) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = CIMultiDictProxy(fields.headers)
        self.length = fields.length
        self.chunked = fields.chunked
        self.expect = fields.expect
        self.upgrade = "upgrade" in fields.connection
        if version == "1.1":
            self.keep_alive = "close" not in fields.connection
        else:
            self.keep_alive = "keep-alive" in fields.connection
        self.size = 0  # bytes of the head on the wire (set by feed_head)

    def __repr__(self) -> str:
        return f"<RequestHead {self.method} {self.target!r} length={self.length}>"


class RequestParser(_Reader):
    """Requests from one client connection, one after another."""

    __slots__ = ("_fed", "_target", "head")

    _parser: httptools.HttpRequestParser | None

    def __init__(self) -> None:
        super().__init__()
        self._parser = httptools.HttpRequestParser(self)
        self._target = b""
        self._fed = 0  # bytes of the current message fed from the buffer
        self.head: RequestHead | None = None

    def feed_head(self, buffer: bytearray) -> RequestHead | None:
        """Parse the head at the start of `buffer`, never past its end (the bytes after it
        are the body, or the next request, which may not be ours to read); the head once
        complete, else None. BadMessage if it is malformed or too large."""
        start = self._fed
        while self.head is None:
            end = buffer.find(b"\r\n\r\n", max(start - 3, 0))
            stop = len(buffer) if end < 0 else end + 4
            if stop > start:
                self.feed(memoryview(buffer)[start:stop])  # freed on return: buffer resizable
                start = stop
            if end < 0:
                break
        self._fed = start
        head = self.head
        if head is None:
            if start > MAX_HEAD:
                raise BadMessage("the head is too large")
            return None
        head.size = start
        return head

    def feed_body(self, buffer: bytearray) -> bytes:
        """The Content-Length body after the head at the start of `buffer` (all of it must
        be there); the message is then taken off the buffer."""
        head = self.head
        assert head is not None and head.length is not None
        end = head.size + head.length
        self.feed(memoryview(buffer)[head.size : end])
        assert self.complete
        body = b"".join(self.body)
        del buffer[:end]
        self.next()
        return body

    def next(self) -> None:
        """Ready for the next request on the connection."""
        self.head = None
        self.body = []
        self.complete = False
        self._fed = 0

    def on_message_begin(self) -> None:
        self.head = None
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self._target += url
        if len(self._target) > MAX_FIELD:
            raise BadMessage(f"a request target over {MAX_FIELD} bytes")

    def on_headers_complete(self) -> None:
        version = self._version()
        fields = self._headers()
        if fields.hosts > 1 or (fields.hosts == 0 and version == "1.1"):
            raise BadMessage("an HTTP/1.1 request needs exactly one Host")
        assert self._parser is not None
        method = self._parser.get_method().decode("ascii")
        target = self._target.decode("ascii")  # llhttp let no other byte through
        self._target = b""
        self.head = RequestHead(method, target, version, fields)

    def on_message_complete(self) -> None:
        self.complete = True


class ResponseParser(_Reader):
    """One answer from a backend. `head_only`: the answer to a HEAD request, whose
    Content-Length tells of a body that is not sent."""

    __slots__ = (
        "chunked",
        "content_length",
        "head_only",
        "headers",
        "keep_alive",
        "reason",
        "status",
    )

    _parser: httptools.HttpResponseParser | None

    def __init__(self, *, head_only: bool = False) -> None:
        super().__init__()
        self._parser = httptools.HttpResponseParser(self)
        self.head_only = head_only
        self.status = 0  # set once the head is in
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.content_length: int | None = None
        self.chunked = False
        self.keep_alive = False

    def on_status(self, reason: bytes) -> None:
        self.reason = reason.decode("utf-8", "surrogateescape")

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if not 100 <= status <= 599:
            raise BadMessage(f"status {status} is not 100-599")
        if status == 101:  # never asked for: the bytes after it are not HTTP
            raise BadMessage("a switch of protocols that was not asked for")
        version = self._version()
        fields = self._headers()
        if status < 200:  # interim (100 Continue, 103 Early Hints): the final one follows
            self.reason = ""
            return
        self.status = status
        self.headers = CIMultiDictProxy(fields.headers)
        self.content_length = fields.length
        self.chunked = fields.chunked
        keep_alive = version == "1.1" and "close" not in fields.connection
        # Reused only if framed: a read-until-close body ends with the connection.
        self.keep_alive = keep_alive and (fields.length is not None or fields.chunked)
        if self.head_only or status in (204, 304):
            self.keep_alive = keep_alive
            self.complete = True

    def on_message_complete(self) -> None:
        if self.status:  # not an interim answer's end
            self.complete = True
            self.release()  # (one answer a reader; llhttp holds its parser until it returns)
