"""`item_reference` input items: which items are references, and the input with each
replaced by the stored item it names (CONTRACT.md C1.1).

The stored item is spliced in as the bytes it was first forwarded or produced as, never
re-encoded, so a history resent by reference reaches the backend byte-identical to the
history sent in full, and its prefix cache hits.
"""

from __future__ import annotations

from typing import Any

import orjson

from ocxproxy.errors import InvalidRequest


def references(items: list[Any]) -> dict[int, str]:
    """The references among `items` (`{"type": "item_reference", "id": …}`, the type may be
    left out: `{"id": …}`): index → the id it names. One pass, no call per item (≈ 0.13 µs
    an item; a byte search of the body for a hint costs more)."""
    found: dict[int, str] = {}
    for index, item in enumerate(items):
        if type(item) is not dict:
            continue
        kind = item.get("type")
        if kind == "item_reference" or (kind is None and "id" in item and "role" not in item):
            item_id = item.get("id")
            if not isinstance(item_id, str) or not item_id:
                raise InvalidRequest(
                    f"Missing or invalid 'id' in input[{index}]: an item_reference names "
                    "a stored item by its id.",
                    param="input",
                )
            found[index] = item_id
    return found


def not_found(item_id: str) -> InvalidRequest:
    return InvalidRequest(
        f"Item with id '{item_id}' not found. Items are not persisted when `store` is set "
        "to false, and are gone once their response is deleted or expires.",
        param="input",
    )


def not_storable(item_id: str) -> InvalidRequest:
    return InvalidRequest(
        f"Item with id '{item_id}' comes from a store:false response of this connection: "
        "it cannot be added to a conversation, which is stored. Send the turn with "
        "store=false, or the item itself.",
        param="input",
    )


def splice(
    parts: list[bytes], items: list[Any], resolved: dict[int, bytes]
) -> tuple[list[bytes], list[Any]]:
    """The input with the references at the indices of `resolved` replaced by those stored
    bytes: one serialized item each, and the items parsed (a resolved item is decoded for
    the proxy's own reading, e.g. the call ids a tool output binds to; its bytes are the
    stored ones)."""
    parts, items = list(parts), list(items)
    for index, data in resolved.items():
        parts[index] = data
        items[index] = orjson.loads(data)
    return parts, items
