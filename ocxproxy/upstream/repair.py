"""Make an incomplete Responses SSE stream spec-complete (CONTRACT.md C1.7). Pure, no I/O.

llama.cpp's events carry no `sequence_number`, `output_index` or `content_index`, and its
`response.created` holds a stub response; the official SDK's `responses.stream()` helper
indexes its snapshot by those fields and fails without them. Streams that already carry
`sequence_number` are never given to this class.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from ocxproxy.upstream.sse import TERMINAL_EVENTS, Event, encode_event

# Events addressed to one content part of one output item.
_CONTENT_EVENTS = frozenset(
    (
        "response.content_part.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_text.annotation.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    )
)
_TEXT_EVENTS = frozenset(("response.output_text.delta", "response.output_text.done"))
_STUB_EVENTS = frozenset(("response.created", "response.in_progress", "response.queued"))


class StreamRepair:
    __slots__ = ("_created_at", "_item_index", "_next_output", "_parts", "_seq")

    def __init__(self) -> None:
        self._seq = 0
        self._next_output = 0
        self._item_index: dict[str, int] = {}  # item id → output_index
        self._parts: dict[int, int] = {}  # output_index → content parts added
        self._created_at = int(time.time())

    def fix(self, event: Event) -> tuple[Event, Any]:
        """The event with the missing fields filled in, and its parsed payload."""
        try:
            payload = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            return event, None
        if not isinstance(payload, dict):
            return event, payload
        payload["sequence_number"] = self._seq
        self._seq += 1
        kind = payload.get("type")
        if kind in _STUB_EVENTS:
            self._complete_stub(payload.get("response"))
        elif isinstance(kind, str) and kind.startswith("response.") and kind not in TERMINAL_EVENTS:
            self._index(kind, payload)
        data = orjson.dumps(payload)
        return Event(encode_event(event.name or kind, data), event.name or kind, data), payload

    def _index(self, kind: str, payload: dict[str, Any]) -> None:
        item = payload.get("item")
        item_id = payload.get("item_id")
        if item_id is None and isinstance(item, dict):
            item_id = item.get("id")
        if kind == "response.output_item.added":
            index = payload.setdefault("output_index", self._next_output)
            self._next_output = max(self._next_output, index + 1)
            if isinstance(item_id, str):
                self._item_index[item_id] = index
            return
        if "output_index" not in payload:
            payload["output_index"] = self._item_index.get(
                item_id if isinstance(item_id, str) else "", max(self._next_output - 1, 0)
            )
        output_index = payload["output_index"]
        if kind == "response.content_part.added":
            payload.setdefault("content_index", self._parts.get(output_index, 0))
            self._parts[output_index] = payload["content_index"] + 1
        elif kind in _CONTENT_EVENTS:
            payload.setdefault("content_index", max(self._parts.get(output_index, 1) - 1, 0))
        if kind in _TEXT_EVENTS:
            payload.setdefault("logprobs", [])

    def _complete_stub(self, response: Any) -> None:
        if not isinstance(response, dict):
            return
        response.setdefault("object", "response")
        response.setdefault("created_at", self._created_at)
        response.setdefault("output", [])
        for key, value in (
            ("error", None),
            ("incomplete_details", None),
            ("instructions", None),
            ("metadata", {}),
            ("model", ""),
            ("parallel_tool_calls", True),
            ("tool_choice", "auto"),
            ("tools", []),
            ("temperature", None),
            ("top_p", None),
        ):
            response.setdefault(key, value)
