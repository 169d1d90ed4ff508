"""A finished exchange → the Turn to remember, or the reason it is not remembered
(CONTRACT.md C1.6)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from ocxproxy.continuation.expand import call_ids_of, serialize_items
from ocxproxy.model import NO_ITEMS, ItemIds, Turn

if TYPE_CHECKING:
    from ocxproxy.continuation.envelope import Patch


def not_recordable_reason(response: Any) -> str | None:
    """None when the response is one to remember, else a short reason (a metric label)."""
    if not isinstance(response, dict):
        return "malformed"
    if not isinstance(response.get("id"), str) or not isinstance(response.get("output"), list):
        return "malformed"
    status = response.get("status", "completed")
    if status == "completed":
        return None
    if status == "incomplete":
        details = response.get("incomplete_details") or {}
        if isinstance(details, dict) and details.get("reason") == "max_output_tokens":
            return None
        return "incomplete"
    return str(status) if isinstance(status, str) else "malformed"


def input_tokens_of(response: Any) -> tuple[int, int | None] | None:
    """The input tokens the backend reported, and how many of them its cache held."""
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("input_tokens")
    details = usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(total, int) or total <= 0:
        return None
    return total, cached if isinstance(cached, int) and cached >= 0 else None


def build_turn(
    *,
    response: dict[str, Any],
    scope: str,
    durable: bool,
    tail: list[bytes],
    tail_items: list[Any],
    backend: str | None = None,
    affinity_key: str | None = None,
    stored: bool = True,
    output_parts: list[bytes] | None = None,
    encoded: bytes | None = None,
    patch: Patch | None = None,
) -> Turn:
    """The new segment is the tail exactly as forwarded (one serialized item each, parsed
    in `tail_items`), then the output items (or `output_parts`, what later turns forward
    in their place: a compaction item's summary message). `encoded`: the response's
    bytes, kept when they hold the output encoded as the items are; else `response` is
    encoded, after `Patch.merge` put in it the members `encoded` has and the dict lacks
    (a backend that writes its items otherwise than orjson, e.g. escaping non-ASCII text
    or `<`, leaves the store the dict to encode). When `encoded` is kept, the patch's
    `fill` is the members the envelope filled in, at its `fill_at` (Turn.fill)."""
    output = response["output"]
    output_bytes = serialize_items(output) if output_parts is None else output_parts
    parts = [*tail, *output_bytes]
    fill, fill_at = b"", -1
    output_at = None
    if (
        encoded is None
        or output_parts is not None
        or (output_at := _output_at(encoded, output_bytes)) is None
    ):
        # Encoded like the items, so the store finds the output in them and keeps it once.
        if patch is not None:
            patch.merge(response)
        encoded = orjson.dumps(response)
        output_at = _output_at(encoded, output_bytes)  # (not with other `output_parts`)
    elif patch is not None:
        fill, fill_at = patch.fill, patch.fill_at
    return Turn(
        response_id=response["id"],
        scope=scope,
        durable=durable,
        items=b",".join(parts),
        n_items=len(parts),
        call_ids=call_ids_of(tail_items) | call_ids_of(output),
        response=encoded,
        item_ids=item_ids_of(parts, [*tail_items, *output]),
        backend=backend,
        affinity_key=affinity_key,
        stored=stored,
        fill=fill,
        fill_at=fill_at,
        output_at=output_at if output_at is not None and output_at[1] else None,
    )


def _output_at(response: bytes, output: list[bytes]) -> tuple[int, int] | None:
    """Where the first `"output":` array of a response's bytes holds `output`, its items
    (start, length), or None when that array is not `output` (store/output.py looks for
    it there)."""
    at = response.find(b'"output":[')
    joined = b",".join(output)
    if at < 0 or not response.startswith(b"[" + joined + b"]", at + 9):
        return None
    return at + 10, len(joined)


def item_ids_of(parts: list[bytes], items: list[Any]) -> ItemIds:
    """The ids of the items that carry one, with each item's span in the comma-joined
    `parts` (`items` parsed): what a later `item_reference` to it resolves to."""
    entries = []
    at = 0
    for part, item in zip(parts, items, strict=True):
        if type(item) is dict:
            item_id = item.get("id")
            if type(item_id) is str and item_id:
                entries.append((item_id, at, at + len(part)))
        at += len(part) + 1
    return ItemIds(entries) if entries else NO_ITEMS
