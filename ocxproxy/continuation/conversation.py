"""Conversations (OpenAI's Conversations API), the pure parts: ids, the conversation
object, its items as the SDKs parse them, list pages, and the bytes the store keeps.

A conversation is kept like a response's chain: its items are segments (each item's JSON
exactly as forwarded), spliced in front of a request's input as a previous_response_id
chain is, so a conversation that is only appended to keeps the backend's prefix cache
hot. Beside the chain the store keeps `Meta` (created_at, metadata, and the item ids per
segment: ids are never written into the items, which reach the backend unchanged).
Item order is the order of appends.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ocxproxy.continuation.expand import _TOKEN
from ocxproxy.errors import InvalidRequest

PREFIX = "conv_"
MAX_ITEMS_PER_WRITE = 20
MAX_METADATA_KEYS = 16
_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
}


def new_conversation_id() -> str:
    return PREFIX + secrets.token_hex(24)


def is_conversation_id(value: str) -> bool:
    return value.startswith(PREFIX)


@dataclass(slots=True)
class Meta:
    """What the store keeps beside a conversation's chain."""

    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    ids: list[list[str]] = field(default_factory=list)  # one list per chain segment

    def encode(self) -> bytes:
        """The head the store keeps as the record's response segment: the same bytes from
        turn to turn. The ids are kept beside it (`Record.ids`), so a turn journals only its
        own segment's ids, not its whole history's again."""
        return orjson.dumps({"created_at": self.created_at, "metadata": self.metadata})

    @classmethod
    def decode(cls, data: bytes, ids: list[list[str]] | None) -> Meta:
        """From the head and the record's ids; None: a conversation written by an earlier
        release, whose head holds its ids."""
        doc = orjson.loads(data)
        return cls(doc["created_at"], doc["metadata"], doc["ids"] if ids is None else ids)

    def all_ids(self) -> set[str]:
        return set(itertools.chain.from_iterable(self.ids))

    def find(self, item_id: str) -> tuple[int, int] | None:
        """(segment index, index in the segment) of an item, or None."""
        for seg_index, ids in enumerate(self.ids):
            if item_id in ids:
                return seg_index, ids.index(item_id)
        return None


def conversation_object(conversation_id: str, meta: Meta) -> dict[str, Any]:
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": meta.created_at,
        "metadata": meta.metadata,
    }


def deleted_object(conversation_id: str) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def check_metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: at most 16 string pairs, keys ≤ 64 and values ≤ 512 characters."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("Invalid type for 'metadata': expected an object.", param="metadata")
    if len(value) > MAX_METADATA_KEYS:
        raise InvalidRequest(
            f"Invalid 'metadata': too many keys ({len(value)} > {MAX_METADATA_KEYS}).",
            param="metadata",
        )
    for key, val in value.items():
        if not isinstance(val, str) or len(key) > 64 or len(val) > 512:
            raise InvalidRequest(
                f"Invalid 'metadata.{key[:64]}': keys are strings of at most 64 characters, "
                "values strings of at most 512.",
                param="metadata",
            )
    return dict(value)


def check_items(value: Any, *, required: bool) -> list[dict[str, Any]]:
    """Items to add: a list of at most 20 objects (input items as the SDK sends them)."""
    if value is None and not required:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("Invalid type for 'items': expected an array.", param="items")
    if len(value) > MAX_ITEMS_PER_WRITE:
        raise InvalidRequest(
            f"Invalid 'items': array too long. Expected an array with maximum length "
            f"{MAX_ITEMS_PER_WRITE}, but got an array with length {len(value)} instead.",
            param="items",
        )
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"Invalid 'items[{index}]': expected an object.", param="items")
    return value


def conversation_id_of(body: Mapping[str, Any]) -> str | None:
    """The `conversation` of a create request: a string id or `{"id": …}`."""
    value = body.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise InvalidRequest(
            "Invalid type for 'conversation': expected a conversation id or an object with "
            "an 'id'.",
            param="conversation",
            code="invalid_type",
        )
    return value


def not_found_message(conversation_id: str) -> str:
    return f"Conversation with id '{conversation_id}' not found."


def assign_ids(items: Iterable[Any], taken: set[str]) -> list[str]:
    """An id per item: its own when it has one not taken yet, else a new one. `taken`
    grows with the ids handed out."""
    ids = []
    for item in items:
        own = item.get("id") if isinstance(item, dict) else None
        if not isinstance(own, str) or not own or own in taken:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind is None and isinstance(item, dict) and "role" in item:
                kind = "message"
            own = f"{_ID_PREFIX.get(str(kind), 'item')}_{secrets.token_hex(24)}"
        taken.add(own)
        ids.append(own)
    return ids


def split_items(data: bytes) -> list[bytes]:
    """A segment's comma-joined JSON values, each exactly as stored."""
    if not data:
        return []
    spans: list[bytes] = []
    depth, start = 0, 0
    for match in _TOKEN.finditer(data):
        token = match.group()
        if token in (b"{", b"["):
            depth += 1
        elif token in (b"}", b"]"):
            depth -= 1
        elif token == b"," and depth == 0:
            spans.append(data[start : match.start()].strip())
            start = match.end()
    spans.append(data[start:].strip())
    return spans
