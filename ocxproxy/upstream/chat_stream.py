"""Chat Completions answer → Responses answer (CONTRACT.md C6). Pure: bytes and dicts, no I/O.

`ChatStream` turns chat completion chunks into the full Responses SSE event sequence, with
`sequence_number`, `output_index` and `content_index`, and the proxy's own `resp_`/`msg_`/
`fc_`/`rs_` ids. A whole non-streaming completion goes through the same machine as one
chunk, so a JSON answer and an SSE answer to the same completion always agree.

Items close in a fixed way: reasoning and text close as soon as another kind of output
starts; tool calls (which may be streamed side by side) stay open until `finish_reason`.
The terminal event waits for `[DONE]` or the end of the body, since the usage chunk comes
after the finish chunk.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from ocxproxy.upstream.chat import ChatRequest
from ocxproxy.upstream.sse import EventSplitter, encode_event

IdFactory = Callable[[str], str]


def mint_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass(slots=True)
class _Item:
    index: int  # output_index
    data: dict[str, Any]  # the item as it appears in `output`
    chunks: list[str] = field(default_factory=list)  # text, reasoning or arguments so far
    open: bool = True


@dataclass(slots=True)
class _Call:
    call_id: str | None = None
    name: str | None = None
    pending: list[str] = field(default_factory=list)  # arguments before the name arrived
    item: _Item | None = None


class ChatStream:
    """Feed a chat backend's SSE bytes (or one whole completion); get Responses SSE bytes.
    `response` holds the final Response object once the stream has ended."""

    def __init__(
        self,
        request: ChatRequest,
        *,
        new_id: IdFactory = mint_id,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.request = request
        self.response_id = new_id("resp")
        self.response: dict[str, Any] | None = None
        self._new_id = new_id
        self._now = now
        self._splitter = EventSplitter()
        self._out: list[bytes] = []
        self._seq = 0
        self._started = False
        self._created_at = int(now())
        self._model: Any = request.model
        self._items: list[_Item] = []
        self._text: _Item | None = None
        self._reasoning: _Item | None = None
        self._calls: dict[int, _Call] = {}
        self._finish: str | None = None
        self._done = False  # [DONE] seen, or a whole completion fed
        self._usage: dict[str, Any] | None = None

    # -- input -------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """SSE bytes from the backend → SSE bytes for the client (maybe none yet)."""
        for event in self._splitter.feed(data):
            self._event(event.data)
        return self._take()

    def end(self) -> bytes:
        """The backend's body ended: the remaining events, always with the terminal one."""
        for event in self._splitter.flush():
            self._event(event.data)
        if self.response is None:
            self._start({})
            if self._done or self._finish is not None:
                self._complete()
            else:
                self._fail("The backend ended the stream before the response was finished.")
        return self._take()

    def feed_completion(self, completion: Any) -> bytes:
        """A whole `chat.completion` object, as if it had been streamed as one chunk."""
        self._done = True
        choices = completion.get("choices") if isinstance(completion, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(completion, dict) or (
            not isinstance(choice, dict) and "error" not in completion
        ):
            self._fail("The backend's answer is not a chat completion.")
            return self._take()
        chunk = {
            k: completion[k] for k in ("model", "created", "usage", "error") if k in completion
        }
        if isinstance(choice, dict):
            message = choice.get("message")
            delta = dict(message) if isinstance(message, dict) else {}
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                delta["tool_calls"] = [
                    {**call, "index": i} for i, call in enumerate(calls) if isinstance(call, dict)
                ]
            chunk["choices"] = [
                {"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}
            ]
        self._chunk(chunk)
        return self._take()

    def _event(self, data: bytes) -> None:
        if not data:
            return
        if data.strip() == b"[DONE]":
            self._done = True
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if isinstance(chunk, dict):
            self._chunk(chunk)

    def _chunk(self, chunk: dict[str, Any]) -> None:
        if self.response is not None:
            return
        self._start(chunk)
        error = chunk.get("error")
        if error is not None or chunk.get("object") == "error":
            detail = error if isinstance(error, dict) else chunk
            message = error if isinstance(error, str) else detail.get("message")
            self._fail(message if isinstance(message, str) else "The backend reported an error.")
            return
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta)
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self._finish = finish
                self._close_all()

    def _delta(self, delta: dict[str, Any]) -> None:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self._reasoning_delta(reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._text_delta(content)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                self._call_delta(call)

    # -- output items ------------------------------------------------------------------

    def _reasoning_delta(self, text: str) -> None:
        self._close_text()
        item = self._reasoning
        if item is None:
            data = {"id": self._new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            item = self._reasoning = self._open(data)
        item.chunks.append(text)
        self._emit(
            "response.reasoning_text.delta",
            item_id=item.data["id"], output_index=item.index, content_index=0, delta=text,
        )  # fmt: skip

    def _text_delta(self, text: str) -> None:
        self._close_reasoning()
        item = self._text
        if item is None:
            item = self._text = self._open_message()
        item.chunks.append(text)
        self._emit(
            "response.output_text.delta",
            item_id=item.data["id"], output_index=item.index, content_index=0, delta=text,
            logprobs=[],
        )  # fmt: skip

    def _call_delta(self, delta: dict[str, Any]) -> None:
        self._close_reasoning()
        self._close_text()
        position = delta.get("index", 0)
        call = self._calls.setdefault(position if isinstance(position, int) else 0, _Call())
        if call.call_id is None and isinstance(delta.get("id"), str) and delta["id"]:
            call.call_id = delta["id"]
        function = delta.get("function")
        function = function if isinstance(function, dict) else {}
        if call.name is None and isinstance(function.get("name"), str) and function["name"]:
            call.name = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # a few servers send the object itself
            arguments = orjson.dumps(arguments).decode()
        if isinstance(arguments, str) and arguments:
            call.pending.append(arguments)
        if call.item is None and call.name is not None:
            self._open_call(call)
        if call.item is not None and call.pending:
            self._arguments(call.item, "".join(call.pending))
            call.pending.clear()

    def _open_call(self, call: _Call) -> None:
        data = {
            "id": self._new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.call_id or self._new_id("call"),
            "name": call.name or "",
            "arguments": "",
        }
        call.item = self._open(data)

    def _arguments(self, item: _Item, text: str) -> None:
        item.chunks.append(text)
        self._emit(
            "response.function_call_arguments.delta",
            item_id=item.data["id"], output_index=item.index, delta=text,
        )  # fmt: skip

    def _open_message(self) -> _Item:
        data = {
            "id": self._new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        item = self._open(data)
        self._emit(
            "response.content_part.added",
            item_id=data["id"], output_index=item.index, content_index=0, part=_text_part(""),
        )  # fmt: skip
        return item

    def _open(self, data: dict[str, Any]) -> _Item:
        """A new output item; events are encoded as they are emitted, so later changes to
        `data` never alter what was announced."""
        item = _Item(len(self._items), data)
        self._items.append(item)
        self._emit("response.output_item.added", output_index=item.index, item=data)
        return item

    def _close_text(self) -> None:
        item, self._text = self._text, None
        if item is None or not item.open:
            return
        item.open = False
        text = "".join(item.chunks)
        part = _text_part(text)
        item.data["content"] = [part]
        item.data["status"] = self._item_status()
        loc = {"item_id": item.data["id"], "output_index": item.index, "content_index": 0}
        self._emit("response.output_text.done", **loc, text=text, logprobs=[])
        self._emit("response.content_part.done", **loc, part=part)
        self._emit("response.output_item.done", output_index=item.index, item=item.data)

    def _close_reasoning(self) -> None:
        item, self._reasoning = self._reasoning, None
        if item is None or not item.open:
            return
        item.open = False
        text = "".join(item.chunks)
        item.data["content"] = [{"type": "reasoning_text", "text": text}]
        self._emit(
            "response.reasoning_text.done",
            item_id=item.data["id"], output_index=item.index, content_index=0, text=text,
        )  # fmt: skip
        self._emit("response.output_item.done", output_index=item.index, item=item.data)

    def _close_calls(self) -> None:
        for call in self._calls.values():
            if call.item is None:  # never named: still an item, so the call is not lost
                call.name = call.name or ""
                self._open_call(call)
                assert call.item is not None
                if call.pending:
                    self._arguments(call.item, "".join(call.pending))
            item = call.item
            if not item.open:
                continue
            item.open = False
            arguments = "".join(item.chunks)
            item.data["arguments"] = arguments
            item.data["status"] = self._item_status()
            self._emit(
                "response.function_call_arguments.done",
                item_id=item.data["id"], output_index=item.index, name=item.data["name"],
                arguments=arguments,
            )  # fmt: skip
            self._emit("response.output_item.done", output_index=item.index, item=item.data)
        self._calls.clear()

    def _close_all(self) -> None:
        self._close_reasoning()
        if not self._items and self._text is None:
            self._text = self._open_message()  # an empty answer is still a message
        self._close_text()
        self._close_calls()

    def _item_status(self) -> str:
        return "incomplete" if self._finish in ("length", "content_filter") else "completed"

    # -- lifecycle ---------------------------------------------------------------------

    def _start(self, chunk: dict[str, Any]) -> None:
        if self._started:
            return
        self._started = True
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            self._model = chunk["model"]
        if isinstance(chunk.get("created"), int):
            self._created_at = chunk["created"]
        pending = self._response("in_progress")
        self._emit("response.created", response=pending)
        self._emit("response.in_progress", response=pending)

    def _complete(self) -> None:
        self._close_all()
        if self._finish == "length":
            response = self._response("incomplete", incomplete={"reason": "max_output_tokens"})
        elif self._finish == "content_filter":
            response = self._response("incomplete", incomplete={"reason": "content_filter"})
        else:
            response = self._response("completed")
        self.response = response
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        self._emit(kind, response=response)

    def _fail(self, message: str) -> None:
        self._start({})
        error = {"code": "server_error", "message": message}
        self.response = self._response("failed", error=error)
        self._emit("response.failed", response=self.response)

    def _response(
        self,
        status: str,
        *,
        incomplete: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        done = status not in ("in_progress", "failed")
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created_at,
            "status": status,
            "background": False,
            "completed_at": int(self._now()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete,
            "model": self._model,
            "output": [item.data for item in self._items if not item.open] if done else [],
            "previous_response_id": None,
            "usage": usage_of(self._usage) if done else None,
        }

    def _emit(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self._out.append(encode_event(kind, orjson.dumps(payload)))

    def _take(self) -> bytes:
        out, self._out = b"".join(self._out), []
        return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage → Responses usage; cached prompt tokens become `cached_tokens`."""
    if usage is None:
        return None
    prompt = _int(usage.get("prompt_tokens"))
    completion = _int(usage.get("completion_tokens"))
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = _int(prompt_details.get("cached_tokens")) if isinstance(prompt_details, dict) else 0
    reasoning = (
        _int(completion_details.get("reasoning_tokens"))
        if isinstance(completion_details, dict)
        else 0
    )
    total = _int(usage.get("total_tokens")) or prompt + completion
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": total,
    }


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
