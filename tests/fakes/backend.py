"""A fake, stateless OpenAI Responses backend (think llama.cpp / vLLM) on a real socket.

It is a genuine aiohttp HTTP server bound to 127.0.0.1, so the proxy under test talks
to it exactly as it would to a real inference server.  Its answers are deterministic
and reveal which history it was given::

    echo#<n_items>: <last user text>

``CALL:<name>`` in the last user text makes it answer with a ``function_call`` item,
and a trailing ``function_call_output`` makes it answer ``echo#<n>: tool said <output>``,
or call again when the output holds ``CALL:<name>`` (a tool loop).
Like llama.cpp it rejects ``previous_response_id`` (it has no state).  Prefix caching
is simulated in ``usage.input_tokens_details.cached_tokens``.

With ``rejects_images``, a request holding an ``input_image`` gets a 500 every time, as
llama.cpp without a vision model answers it (the same body, the same error).

Scripted misbehaviour for the next ``POST /v1/responses`` requests (FIFO, one entry
consumed per request): :meth:`FakeBackend.fail_next`, :meth:`FakeBackend.hang_up_next`,
:meth:`FakeBackend.stall_next`, :meth:`FakeBackend.status_next`.

Standalone (for benchmarks)::

    python -m tests.fakes.backend --port 8001 [--stream-style llama] [--delay 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import orjson
from aiohttp import web
from multidict import CIMultiDict

__all__ = ["Action", "FakeBackend", "Seen", "StreamStyle"]

StreamStyle = Literal["spec", "llama"]
TerminalStatus = Literal["incomplete", "failed"]

FAKE_MODEL = "fake-model"
RESPONSES_PATH = "/v1/responses"
CACHE_HISTORY = 16
_CALL_RE = re.compile(r"CALL:([A-Za-z0-9_.\-]+)")
# Fields llama.cpp's server leaves out of its Responses stream events.
_LLAMA_OMITS = ("sequence_number", "output_index", "content_index")

Json = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID = web.RequestKey("fake_request_id", str)


@dataclass(frozen=True, slots=True)
class Seen:
    """One request the backend received."""

    method: str
    path: str
    headers: CIMultiDict[str]
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass(frozen=True, slots=True)
class Action:
    """One scripted behaviour, consumed by the next ``POST /v1/responses``."""

    kind: Literal["fail", "hang_up", "stall", "status", "drip", "error_event"]
    status: int = 0
    body: Json | None = None
    after_events: int = 0
    seconds: float = 0.0
    terminal: TerminalStatus | None = None


@dataclass(slots=True)
class _Turn:
    """What the fake model makes of one request."""

    n_items: int
    text: str | None  # assistant text, or None for a function call
    call_name: str | None
    canonical: bytes  # canonical ``input`` serialization (for the prefix cache)


@dataclass(slots=True)
class _Stats:
    requests: int = 0
    ids: int = 0
    history: deque[bytes] = field(default_factory=lambda: deque(maxlen=CACHE_HISTORY))


def error_body(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None
) -> Json:
    """An OpenAI-shaped error document."""
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _common_prefix_len(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix; O(n) memcmp work, no per-byte Python loop."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _tokens(n_bytes: int) -> int:
    return max(1, (n_bytes + 3) // 4)


def _content_text(content: Any, part_types: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in part_types
        )
    return ""


def _interpret(payload: Json) -> _Turn:
    raw = payload.get("input")
    items: list[Any]
    if isinstance(raw, str):
        items = [{"role": "user", "content": raw}]
    elif isinstance(raw, list):
        items = raw
    else:
        items = []
    last_user = ""
    for item in reversed(items):
        if (
            isinstance(item, dict)
            and item.get("role") == "user"
            and item.get("type", "message") == "message"
        ):
            last_user = _content_text(item.get("content"), ("input_text", "text"))
            break
    n = len(items)
    canonical = orjson.dumps(items)
    last = items[-1] if items else None
    if isinstance(last, dict) and last.get("type") == "function_call_output":
        output = _content_text(last.get("output"), ("input_text", "output_text", "text"))
        again = _CALL_RE.search(output)
        if again:
            return _Turn(n, None, again.group(1), canonical)
        return _Turn(n, f"echo#{n}: tool said {output}", None, canonical)
    match = _CALL_RE.search(last_user)
    if match:
        return _Turn(n, None, match.group(1), canonical)
    return _Turn(n, f"echo#{n}: {last_user}", None, canonical)


def _chunks(text: str, parts: int = 4) -> list[str]:
    if not text:
        return [""]
    size = max(1, -(-len(text) // parts))
    return [text[i : i + size] for i in range(0, len(text), size)]


class FakeBackend:
    """A real aiohttp server imitating a stateless Responses API backend."""

    def __init__(
        self,
        *,
        stream_style: StreamStyle = "spec",
        delay: float = 0.0,
        name: str = "fake",
        rejects_images: bool = False,
        window: tuple[Literal["llama", "vllm"], int] | None = None,
        eager_tools: Literal["unless_none", "always"] | None = None,
        slot_dir: Path | None = None,
        restores: bool = True,
        cuts_at_limit: bool = False,
    ) -> None:
        """`window`: a context window told as llama.cpp (`/props`, `/apply-template`,
        `/tokenize`) or vLLM (`max_model_len` in `/v1/models`, `/tokenize` of messages)
        tell it; an input past it is refused as llama.cpp refuses it. Tokens are a
        quarter of the bytes, everywhere. `eager_tools`: a model that calls the first of
        the request's tools whatever it is asked, unless `tool_choice` is `"none"`, or
        even then (a backend that does not enforce it). `slot_dir`: llama.cpp's slot
        actions (`POST /slots/0?action=save|restore`, files in that directory, `/props`,
        and `GET /slots` with the slot's last task id, numbered per process as llama.cpp
        numbers its tasks, absent before its first); a restore puts the saved prompt back
        in the simulated cache, unless `restores` is False (it then says it restored and
        does nothing, as some llama.cpp builds do). `cuts_at_limit`: an answer's text cut
        to the request's `max_output_tokens`, its Response still `completed`, as
        llama.cpp's Responses API says it."""
        self.window = window
        self.cuts_at_limit = cuts_at_limit
        self.eager_tools = eager_tools
        self.slot_dir = slot_dir
        self.restores = restores
        self.template = "fake-template"
        # (action, filename, how many /v1/responses requests came before it)
        self.slot_actions: list[tuple[str, str, int]] = []
        self.tasks = 0  # llama.cpp's task ids (a /slots read takes one too)
        self.slot_task: int | None = None  # the last task the slot ran
        self._last: tuple[bytes, int] = (b"", 0)  # the last prompt and its tokens with the output
        self.stream_style: StreamStyle = stream_style
        self.rejects_images = rejects_images  # as llama.cpp without a vision model: a 500
        self.delay = delay
        self.name = name
        self.url = ""
        self.seen: list[Seen] = []
        self.script: list[Action] = []
        self.cancelled = 0
        self._stats = _Stats()
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        app.router.add_post(RESPONSES_PATH, self._responses)
        app.router.add_post("/v1/responses/input_tokens", self._input_tokens)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if self.window is not None and self.window[0] == "llama":
            app.router.add_get("/props", self._props)
            app.router.add_post("/apply-template", self._apply_template)
        if self.window is not None:
            app.router.add_post("/tokenize", self._tokenize)
        if self.slot_dir is not None:
            app.router.add_get("/props", self._props)
            app.router.add_post("/slots/{slot}", self._slot_action)
            app.router.add_get("/slots", self._slots)
        app.on_response_prepare.append(self._add_request_id)
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound_host, bound_port = runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ scripting

    def fail_next(self, status: int, body: Json | None = None) -> None:
        """Answer the next request with ``status`` and an OpenAI error (or ``body``)."""
        self.script.append(Action("fail", status=status, body=body))

    def hang_up_next(self, after_events: int) -> None:
        """Stream ``after_events`` events, then abort the connection mid-body."""
        self.script.append(Action("hang_up", after_events=after_events))

    def error_event_next(self, after_events: int, payload: Json) -> None:
        """Stream ``after_events`` events, then an SSE ``error`` event with ``payload``
        (its ``type`` and ``sequence_number`` added), and end the stream."""
        self.script.append(Action("error_event", body=payload, after_events=after_events))

    def stall_next(self, seconds: float) -> None:
        """Wait ``seconds`` before answering (then answer normally)."""
        self.script.append(Action("stall", seconds=seconds))

    def drip_next(self, seconds: float, parts: int = 3) -> None:
        """Send the next JSON answer's head at once and its body in ``parts`` pieces,
        ``seconds`` apart (a slow body that never goes silent for long)."""
        self.script.append(Action("drip", seconds=seconds, after_events=parts))

    def status_next(self, status: TerminalStatus) -> None:
        """End the next response as ``incomplete`` (max_output_tokens) or ``failed``."""
        self.script.append(Action("status", terminal=status))

    # ------------------------------------------------------------------ inspection

    @property
    def responses_seen(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST" and s.path == RESPONSES_PATH]

    def reset(self) -> None:
        self.seen.clear()
        self.script.clear()
        self.cancelled = 0
        self._stats.history.clear()

    def forget_cache(self) -> None:
        """Drop the simulated prefix cache, as a restarted or displaced backend would."""
        self._stats.history.clear()

    async def wait_for(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        """Wait until ``predicate()`` holds, e.g. ``lambda: fb.cancelled >= 1`` or
        ``lambda: len(fb.responses_seen) == 2``; re-checked whenever ``seen`` or
        ``cancelled`` change.  Raises TimeoutError after ``within`` seconds."""
        async with asyncio.timeout(within):
            while not predicate():
                await self._changed.wait()

    def _bump(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self._stats.requests += 1
        request[REQUEST_ID] = f"req_{self._stats.requests}"
        body = await request.read()
        self.seen.append(Seen(request.method, request.path, CIMultiDict(request.headers), body))
        self._bump()
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return _json_response(
                error_body(f"{exc.reason}: {request.method} {request.path}"), exc.status
            )

    async def _add_request_id(self, request: web.Request, response: web.StreamResponse) -> None:
        rid = request.get(REQUEST_ID)
        if rid is not None:
            response.headers["x-request-id"] = rid

    def _new_id(self, prefix: str, body: bytes) -> str:
        self._stats.ids += 1
        digest = hashlib.blake2b(body, digest_size=12, key=str(self._stats.ids).encode())
        return f"{prefix}_{digest.hexdigest()}"

    async def _pause(self) -> None:
        if self.delay > 0:
            await asyncio.sleep(self.delay)

    @staticmethod
    async def _payload(request: web.Request) -> Json | web.Response:
        try:
            payload = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _json_response(error_body(f"invalid JSON body: {exc}"), 400)
        if not isinstance(payload, dict):
            return _json_response(error_body("request body must be a JSON object"), 400)
        return payload

    # ------------------------------------------------------------------ routes

    async def _health(self, request: web.Request) -> web.Response:
        return _json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        model: Json = {"id": FAKE_MODEL, "object": "model"}
        if self.window is not None and self.window[0] == "vllm":
            model["max_model_len"] = self.window[1]
        return _json_response({"object": "list", "data": [model]})

    async def _props(self, request: web.Request) -> web.Response:
        n_ctx = self.window[1] if self.window is not None else 8192
        props = {"default_generation_settings": {"n_ctx": n_ctx}, "chat_template": self.template}
        return _json_response({**props, "build_info": "fake"})

    async def _slots(self, request: web.Request) -> web.Response:
        self.tasks += 1
        slot: Json = {"id": 0, "n_ctx": 8192, "is_processing": False}
        if self.slot_task is not None:
            slot["id_task"] = self.slot_task
        return _json_response([slot])

    async def _slot_action(self, request: web.Request) -> web.Response:
        assert self.slot_dir is not None
        payload = await self._payload(request)
        if isinstance(payload, web.Response):
            return payload
        self.tasks += 1
        path = self.slot_dir / str(payload.get("filename"))
        action = request.query.get("action", "")
        self.slot_actions.append((action, path.name, len(self.responses_seen)))
        if request.query.get("action") == "save":
            prompt, tokens = self._last
            path.write_bytes(b"%d\n" % tokens + prompt)
            return _json_response({"id_slot": 0, "n_saved": tokens, "n_written": len(prompt)})
        if request.query.get("action") == "restore" and path.is_file():
            head, _, prompt = path.read_bytes().partition(b"\n")
            if self.restores:
                self._stats.history.append(prompt)
            return _json_response({"id_slot": 0, "n_restored": int(head)})
        return _json_response(error_body("Unable to restore slot"), 400)

    async def _apply_template(self, request: web.Request) -> web.Response:
        payload = orjson.loads(await request.read())
        return _json_response({"prompt": orjson.dumps(payload["messages"]).decode()})

    async def _tokenize(self, request: web.Request) -> web.Response:
        payload = orjson.loads(await request.read())
        if "messages" in payload:  # vLLM
            return _json_response({"count": _tokens(len(orjson.dumps(payload["messages"])))})
        return _json_response({"tokens": [0] * _tokens(len(payload["content"].encode()))})

    async def _input_tokens(self, request: web.Request) -> web.Response:
        """`POST /v1/responses/input_tokens`, stateless: the count reveals the items seen."""
        payload = await self._payload(request)
        if isinstance(payload, web.Response):
            return payload
        if self.rejects_images and b'"input_image"' in await request.read():
            return _json_response(
                error_body("image input is not supported by this server", type_="server_error"),
                500,
            )
        if payload.get("previous_response_id") is not None:
            return _json_response(
                error_body("'previous_response_id' is not supported", param="previous_response_id"),
                400,
            )
        turn = _interpret(payload)
        return _json_response(
            {"object": "response.input_tokens", "input_tokens": _tokens(len(turn.canonical))}
        )

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._responses_inner(request)
        except asyncio.CancelledError:
            self.cancelled += 1
            self._bump()
            raise
        except ConnectionResetError:  # the client went away mid-answer
            self.cancelled += 1
            self._bump()
            return web.Response(status=499)  # never reaches anybody; aiohttp drops it quietly

    async def _responses_inner(self, request: web.Request) -> web.StreamResponse:
        action = self.script.pop(0) if self.script else None
        if action is not None and action.kind == "stall":
            await asyncio.sleep(action.seconds)
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("client went away during stall")
        payload = await self._payload(request)
        if isinstance(payload, web.Response):
            return payload
        if action is not None and action.kind == "fail":
            body = action.body
            if body is None:
                kind = "server_error" if action.status >= 500 else "invalid_request_error"
                body = error_body(f"{self.name}: scripted failure {action.status}", type_=kind)
            return _json_response(body, action.status)
        if self.rejects_images and b'"input_image"' in await request.read():
            return _json_response(
                error_body("image input is not supported by this server", type_="server_error"),
                500,
            )
        if payload.get("previous_response_id") is not None:
            return _json_response(
                error_body("'previous_response_id' is not supported", param="previous_response_id"),
                400,
            )
        if self.window is not None:
            n_prompt = _tokens(len(_interpret(payload).canonical))
            if n_prompt >= self.window[1]:
                message = f"request ({n_prompt} tokens) exceeds the available context size"
                error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
                return _json_response({"error": error}, 400)
        terminal = action.terminal if action is not None else None
        response, item = self._build(payload, await request.read(), terminal)
        hang_up = action.after_events if action is not None and action.kind == "hang_up" else None
        if payload.get("stream"):
            if action is not None and action.kind == "error_event":
                return await self._stream(request, response, item, None, action)
            return await self._stream(request, response, item, hang_up)
        await self._pause()
        if hang_up is not None:
            return self._hang_up(request, web.Response())
        if action is not None and action.kind == "drip":
            return await self._drip(request, orjson.dumps(response), action)
        return _json_response(response)

    @staticmethod
    async def _drip(request: web.Request, body: bytes, action: Action) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        size = -(-len(body) // action.after_events)
        for at in range(0, len(body), size):
            if at:
                await asyncio.sleep(action.seconds)
            await resp.write(body[at : at + size])
        await resp.write_eof()
        return resp

    def _build(
        self, payload: Json, body: bytes, terminal: TerminalStatus | None
    ) -> tuple[Json, Json | None]:
        turn = _interpret(payload)
        tools = payload.get("tools")
        eager = self.eager_tools == "always" or payload.get("tool_choice") != "none"
        if self.eager_tools and isinstance(tools, list) and tools and eager:
            turn = replace(turn, text=None, call_name=str(tools[0].get("name", "tool")))
        canonical = turn.canonical
        input_tokens = _tokens(len(canonical))
        prefix = 0
        for prev in self._stats.history:
            if len(prev) <= prefix:
                continue
            if canonical.startswith(prev):
                prefix = len(prev)
            else:
                prefix = max(prefix, _common_prefix_len(canonical, prev))
        self._stats.history.append(canonical)
        cached = min(prefix // 4, input_tokens)
        self.tasks += 1
        self.slot_task = self.tasks

        item: Json | None
        if turn.call_name is not None:
            arguments = orjson.dumps({"n": turn.n_items}).decode()
            item = {
                "type": "function_call",
                "id": self._new_id("fc", body),
                "call_id": self._new_id("call", body),
                "name": turn.call_name,
                "arguments": arguments,
                "status": "completed",
            }
            out_len = len(turn.call_name) + len(arguments)
        else:
            text = turn.text or ""
            limit = payload.get("max_output_tokens")
            if self.cuts_at_limit and type(limit) is int and _tokens(len(text.encode())) > limit:
                text = text.encode()[: 4 * limit].decode(errors="ignore")
            item = {
                "id": self._new_id("msg", body),
                "type": "message",
                "role": "assistant",
                "status": "incomplete" if terminal == "incomplete" else "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
            out_len = len(text.encode())
        output_tokens = _tokens(out_len)
        self._last = (canonical, input_tokens + output_tokens)

        status = terminal or "completed"
        if terminal == "failed":
            item = None
            output_tokens = 0
        response: Json = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": payload.get("model") or FAKE_MODEL,
            "output": [item] if item is not None else [],
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            },
            "error": (
                {"code": "server_error", "message": f"{self.name}: scripted failure"}
                if terminal == "failed"
                else None
            ),
            "incomplete_details": (
                {"reason": "max_output_tokens"} if terminal == "incomplete" else None
            ),
            "instructions": payload.get("instructions"),
            "max_output_tokens": payload.get("max_output_tokens"),
            "tools": payload.get("tools") or [],
            "tool_choice": payload.get("tool_choice", "auto"),
            "parallel_tool_calls": payload.get("parallel_tool_calls", True),
            "temperature": payload.get("temperature", 1.0),
            "top_p": payload.get("top_p", 1.0),
            "text": payload.get("text") or {"format": {"type": "text"}},
            "truncation": payload.get("truncation", "disabled"),
            "metadata": payload.get("metadata") or {},
            "store": payload.get("store", True),
            "previous_response_id": None,
        }
        return response, item

    @staticmethod
    def _hang_up(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """Drop the connection without finishing the body (no exception: aiohttp's
        write_eof on the dead transport fails quietly)."""
        transport = request.transport
        if transport is not None:
            transport.abort()
        return resp

    def _events(self, response: Json, item: Json | None) -> list[Json]:
        """The full Responses streaming event sequence (without sequence numbers)."""
        pending = {**response, "status": "in_progress", "output": [], "usage": None}
        pending["error"] = pending["incomplete_details"] = None
        events: list[Json] = [
            {"type": "response.created", "response": pending},
            {"type": "response.in_progress", "response": pending},
        ]
        if item is not None and item["type"] == "function_call":
            iid = item["id"]
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": 0,
                    "item": {**item, "arguments": "", "status": "in_progress"},
                },
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": iid,
                    "output_index": 0,
                    "delta": item["arguments"],
                },
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": iid,
                    "output_index": 0,
                    "name": item["name"],
                    "arguments": item["arguments"],
                },
                {"type": "response.output_item.done", "output_index": 0, "item": item},
            ]
        elif item is not None:
            iid = item["id"]
            text: str = item["content"][0]["text"]
            loc = {"item_id": iid, "output_index": 0, "content_index": 0}
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": 0,
                    "item": {**item, "status": "in_progress", "content": []},
                }
            )
            events.append(
                {
                    "type": "response.content_part.added",
                    **loc,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                }
            )
            events += [
                {"type": "response.output_text.delta", **loc, "delta": d, "logprobs": []}
                for d in _chunks(text)
            ]
            events += [
                {"type": "response.output_text.done", **loc, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **loc, "part": item["content"][0]},
                {"type": "response.output_item.done", "output_index": 0, "item": item},
            ]
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}
        events.append(
            {"type": terminal.get(response["status"], "response.failed"), "response": response}
        )
        return events

    async def _stream(
        self,
        request: web.Request,
        response: Json,
        item: Json | None,
        hang_up: int | None,
        error: Action | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        llama = self.stream_style == "llama"
        for seq, event in enumerate(self._events(response, item)):
            if error is not None and seq >= error.after_events:
                event = {**(error.body or {}), "type": "error", "sequence_number": seq}
                await resp.write(b"event: error\ndata: " + orjson.dumps(event) + b"\n\n")
                await resp.write_eof()
                return resp
            if hang_up is not None and seq >= hang_up:
                return self._hang_up(request, resp)
            if seq:
                await self._pause()
            if llama:
                for key in _LLAMA_OMITS:
                    event.pop(key, None)
            else:
                event["sequence_number"] = seq
            await resp.write(
                b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
            )
        if hang_up is not None:
            return self._hang_up(request, resp)
        await resp.write_eof()
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        payload = await self._payload(request)
        if isinstance(payload, web.Response):
            return payload
        messages = payload.get("messages")
        messages = messages if isinstance(messages, list) else []
        last_user = next(
            (
                _content_text(m.get("content"), ("text", "input_text"))
                for m in reversed(messages)
                if isinstance(m, dict) and m.get("role") == "user"
            ),
            "",
        )
        text = f"echo#{len(messages)}: {last_user}"
        model = payload.get("model") or FAKE_MODEL
        cid = self._new_id("chatcmpl", await request.read())
        created = int(time.time())
        prompt_tokens = _tokens(len(orjson.dumps(messages)))
        completion_tokens = _tokens(len(text.encode()))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if not payload.get("stream"):
            await self._pause()
            return _json_response(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        deltas: list[tuple[Json, str | None]] = [({"role": "assistant", "content": ""}, None)]
        deltas += [({"content": c}, None) for c in _chunks(text)]
        deltas.append(({}, "stop"))
        for i, (delta, finish) in enumerate(deltas):
            if i:
                await self._pause()
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if finish is not None:
                chunk["usage"] = usage
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _serve(args: argparse.Namespace) -> None:
    backend = FakeBackend(stream_style=args.stream_style, delay=args.delay, name=args.name)
    url = await backend.start(args.host, args.port)
    print(url, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the fake stateless Responses backend.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stream-style", choices=("spec", "llama"), default="spec")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--name", default="fake")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
