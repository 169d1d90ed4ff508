"""Backends that speak Chat Completions only, made to answer like Responses backends
(CONTRACT.md C6).

The pool builds one `Translator` per request. For a backend of the `chat` dialect it turns a
`POST /v1/responses` body into a `POST /v1/chat/completions` request (an unsupported field
raises InvalidRequest before anything is sent) and wraps the answer in a `ChatAnswer`: the
same surface the http layer reads from a backend's answer (`status`, `headers`,
`content.readany()`, `read()`), producing Responses JSON or Responses SSE. Every other
request, and every request to a `responses` backend, passes through untouched. The
translation itself is pure (chat.py, chat_stream.py); this module only moves the bytes.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from ocxproxy.errors import InvalidRequest, UpstreamError
from ocxproxy.upstream.chat import CHAT_PATH, ChatRequest, chat_error, to_chat
from ocxproxy.upstream.chat_stream import ChatStream
from ocxproxy.upstream.http1 import Http1Response

CHAT = "chat"
RESPONSES_PATH = "/v1/responses"
# Headers that describe the backend's body, not the translated one.
_BODY_HEADERS = frozenset(("content-type", "content-length", "content-encoding", "etag"))


class BodyReader(Protocol):
    async def readany(self) -> bytes: ...

    def at_eof(self) -> bool: ...


class UpstreamResponse(Protocol):
    """What the proxy reads from a backend's answer: an Http1Response, or a ChatAnswer
    standing in for one."""

    @property
    def status(self) -> int: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def content(self) -> BodyReader: ...

    @property
    def content_length(self) -> int | None: ...

    async def read(self) -> bytes: ...


class Translator:
    """One request as each dialect needs it; the chat form is built once, on first use."""

    __slots__ = ("_applies", "_chat", "_encoded", "data", "path_qs")

    def __init__(self, method: str, path_qs: str, data: Any) -> None:
        self.path_qs = path_qs
        self.data = data
        self._applies = (
            method == "POST"
            and path_qs.partition("?")[0] == RESPONSES_PATH
            and isinstance(data, bytes)
        )
        self._chat: ChatRequest | None = None
        self._encoded = b""

    def request(self, dialect: str) -> tuple[str, Any]:
        """The path and body to send to a backend of `dialect`."""
        if dialect != CHAT or not self._applies:
            return self.path_qs, self.data
        if self._chat is None:
            try:
                body = orjson.loads(self.data)
            except orjson.JSONDecodeError as exc:
                raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise InvalidRequest("The request body must be a JSON object.")
            self._chat = to_chat(body)
            self._encoded = self._chat.encode()
        return CHAT_PATH, self._encoded

    def response(self, dialect: str, raw: Http1Response) -> UpstreamResponse:
        if dialect != CHAT or self._chat is None:
            return raw
        return ChatAnswer(raw, self._chat)


class ChatAnswer:
    """A chat backend's answer, read as a Responses answer. SSE when the client asked for a
    stream and the backend answered 200, else JSON; non-200 answers keep their status
    with an OpenAI-shaped error body."""

    def __init__(self, raw: Http1Response, request: ChatRequest) -> None:
        self._raw = raw
        self._translation = ChatStream(request)
        self._sse_in = raw.headers.get("Content-Type", "").startswith("text/event-stream")
        self._sse_out = raw.status == 200 and request.stream
        self._eof = False
        self._body: bytes | None = None
        self.status = raw.status
        self.reason = raw.reason
        self.content_length: int | None = None
        headers = CIMultiDict(
            [(k, v) for k, v in raw.headers.items() if k.lower() not in _BODY_HEADERS]
        )  # (a list: multidict tries a generator as a mapping first, raising twice)
        headers["Content-Type"] = "text/event-stream" if self._sse_out else "application/json"
        self.headers = CIMultiDictProxy(headers)

    def __repr__(self) -> str:
        mode = "sse" if self._sse_out else "json"
        return f"<ChatAnswer {self.status} {mode}{' eof' if self._eof else ''}>"

    @property
    def content(self) -> BodyReader:
        return self

    def at_eof(self) -> bool:
        return self._eof

    async def readany(self) -> bytes:
        """The next translated bytes; b"" once the answer is over."""
        while not self._eof:
            if not self._sse_out:
                self._eof = True
                return await self._whole()
            if not self._sse_in:  # a backend that ignored stream:true
                self._eof = True
                completion = _loads(await self._raw.read())
                return self._translation.feed_completion(completion) + self._translation.end()
            chunk = await self._raw.content.readany()
            if not chunk:
                self._eof = True
                return self._translation.end()
            out = self._translation.feed(chunk)
            if out:
                return out
        return b""

    async def read(self) -> bytes:
        if self._body is None:
            parts = []
            while chunk := await self.readany():
                parts.append(chunk)
            self._body = b"".join(parts)
        return self._body

    async def _whole(self) -> bytes:
        """The JSON answer: a Response object, or an error body."""
        if self.status != 200:
            return chat_error(self.status, await self._raw.read())
        translation = self._translation
        if self._sse_in:
            while chunk := await self._raw.content.readany():
                translation.feed(chunk)
            translation.end()
        else:
            translation.feed_completion(_loads(await self._raw.read()))
            translation.end()
        response = translation.response
        if response is None or response.get("status") == "failed":
            error = response.get("error") if response else None
            message = error.get("message") if isinstance(error, dict) else None
            failure = UpstreamError(message or "The backend's answer could not be translated.")
            self.status = failure.status
            return failure.body()
        return orjson.dumps(response)


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
