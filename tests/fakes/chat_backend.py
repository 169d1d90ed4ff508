"""A fake Chat-Completions-only backend (think TGI, or llama.cpp's /v1/chat/completions) on
a real socket: an aiohttp server on 127.0.0.1 that records every body it receives.

Answers are deterministic and reveal which messages it was given::

    echo#<n_messages>: <last user text>

``CALL:<name>`` in the last user text answers with one tool call per name (arguments
``{"n": <n_messages>}``); ``PREAMBLE`` adds assistant text before the calls; ``THINK`` adds
``reasoning_content``. A last message with role ``tool`` answers ``tool said <content>``.
Streams look like llama.cpp's: a role chunk, content chunks, tool-call chunks (name first,
then the arguments in pieces), a finish chunk, a ``choices: []`` usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``. Prefix caching is
simulated in ``usage.prompt_tokens_details.cached_tokens`` (common prefix of the
``messages`` JSON with earlier requests, 4 bytes a token).

Scripting for the next chat requests (FIFO): :meth:`ChatBackend.fail_next`,
:meth:`ChatBackend.finish_next` (e.g. ``"length"``), :meth:`ChatBackend.break_next`
(stream an error chunk, or end the body, without a finish).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

import orjson
from aiohttp import web
from multidict import CIMultiDict

from tests.fakes.backend import Seen

CHAT_PATH = "/v1/chat/completions"
_CALL_RE = re.compile(r"CALL:([A-Za-z0-9_\-]+)")

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Script:
    kind: Literal["fail", "finish", "break"]
    status: int = 0
    body: bytes = b""
    finish: str = "stop"
    error_chunk: bool = False


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _shared_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _pieces(text: str, parts: int = 3) -> list[str]:
    size = max(1, -(-len(text) // parts))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class ChatBackend:
    """A real aiohttp server imitating a stateless Chat Completions backend."""

    def __init__(self, *, ignore_stream: bool = False, delay: float = 0.0) -> None:
        self.ignore_stream = ignore_stream  # answer JSON even to stream:true
        self.delay = delay
        self.url = ""
        self.seen: list[Seen] = []
        self.script: list[Script] = []
        self._history: list[bytes] = []
        self._calls = 0
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> Self:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post(CHAT_PATH, self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- scripting and inspection ----------------------------------------------------------

    def fail_next(self, status: int, body: Json | bytes) -> None:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        self.script.append(Script("fail", status=status, body=raw))

    def finish_next(self, finish: str) -> None:
        """End the next answer with this finish_reason (``length`` truncates the text)."""
        self.script.append(Script("finish", finish=finish))

    def break_next(self, *, error_chunk: bool) -> None:
        """Stream a little, then an error chunk (or just the end of the body), no finish."""
        self.script.append(Script("break", error_chunk=error_chunk))

    @property
    def chats(self) -> list[Json]:
        """The chat request bodies received, parsed."""
        return [s.json for s in self.seen if s.method == "POST" and s.path == CHAT_PATH]

    @property
    def posts(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST"]

    # -- routes ------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "chat-model"}]})

    async def _not_found(self, request: web.Request) -> web.Response:
        self.seen.append(
            Seen(request.method, request.path, CIMultiDict(request.headers), await request.read())
        )
        return web.json_response(
            {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}},
            status=404,
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append(Seen(request.method, request.path, CIMultiDict(request.headers), raw))
        script = self.script.pop(0) if self.script else None
        if script is not None and script.kind == "fail":
            return web.Response(
                status=script.status, body=script.body, content_type="application/json"
            )
        payload = orjson.loads(raw)
        messages = payload.get("messages") or []
        message, finish = self._answer(messages)
        if script is not None and script.kind == "finish":
            finish = script.finish
            if finish == "length" and message.get("content"):
                message["content"] = " ".join(message["content"].split()[:2])
        usage = self._usage(messages, message)
        created = int(time.time())
        self._calls += 1
        base = {"id": f"chatcmpl-{self._calls}", "created": created, "model": "chat-model"}
        if not payload.get("stream") or self.ignore_stream:
            return web.json_response(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": usage,
                }
            )
        include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        broken = script if script is not None and script.kind == "break" else None
        return await self._stream(request, base, message, finish, usage, include_usage, broken)

    def _answer(self, messages: list[Json]) -> tuple[Json, str]:
        n = len(messages)
        last = messages[-1] if messages else {}
        if last.get("role") == "tool":
            return {"role": "assistant", "content": f"tool said {_text(last.get('content'))}"}, (
                "stop"
            )
        user = next((m for m in reversed(messages) if m.get("role") == "user"), {})
        text = _text(user.get("content"))
        message: Json = {"role": "assistant", "content": f"echo#{n}: {text}"}
        names = _CALL_RE.findall(text)
        if "THINK" in text:
            message["reasoning_content"] = f"thinking about {n} messages"
        if not names:
            return message, "stop"
        message["content"] = "Let me check." if "PREAMBLE" in text else None
        message["tool_calls"] = [
            {
                "id": f"call_{self._calls}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": orjson.dumps({"n": n}).decode()},
            }
            for i, name in enumerate(names)
        ]
        return message, "tool_calls"

    def _usage(self, messages: list[Json], message: Json) -> Json:
        canonical = orjson.dumps(messages)
        prefix = max((_shared_prefix(canonical, old) for old in self._history), default=0)
        self._history.append(canonical)
        prompt = -(-len(canonical) // 4)
        completion = -(-len(orjson.dumps(message)) // 4)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(prefix // 4, prompt)},
        }

    async def _stream(
        self,
        request: web.Request,
        base: Json,
        message: Json,
        finish: str,
        usage: Json,
        include_usage: bool,
        broken: Script | None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk_base = {**base, "object": "chat.completion.chunk"}

        async def send(delta: Json, finish_reason: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            await resp.write(
                b"data: " + orjson.dumps({**chunk_base, "choices": [choice]}) + b"\n\n"
            )
            if self.delay:
                await asyncio.sleep(self.delay)

        await send({"role": "assistant", "content": None})
        for piece in _pieces(message.get("reasoning_content") or ""):
            if piece:
                await send({"reasoning_content": piece})
        content = message.get("content") or ""
        for piece in _pieces(content) if content else []:
            await send({"content": piece})
            if broken is not None:
                if broken.error_chunk:
                    error = {"error": {"message": "slot crashed", "type": "server_error"}}
                    await resp.write(b"data: " + orjson.dumps(error) + b"\n\n")
                await resp.write_eof()
                return resp
        for index, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            head = {"name": function["name"], "arguments": ""}
            await send({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                        "function": head}]})  # fmt: skip
            for piece in _pieces(function["arguments"]):
                await send({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        await send({}, finish)
        if include_usage:
            tail = {**chunk_base, "choices": [], "usage": usage}
            await resp.write(b"data: " + orjson.dumps(tail) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
