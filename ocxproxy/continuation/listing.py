"""Lists of items as OpenAI returns them, for a response's input items and a
conversation's items alike: each item's view (its id, messages typed with content parts
and a status, fields `include` did not ask for left out), the list query and the page.
Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from multidict import MultiMapping

from ocxproxy.errors import InvalidRequest

# The `include` values OpenAI accepts on the items endpoints.
INCLUDABLE = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)


def item_view(item: Any, item_id: str, include: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An item as OpenAI lists it: with its id; messages typed, with a status and content
    parts; fields `include` asks for kept, the others left out."""
    view: dict[str, Any] = {"id": item_id, **(item if isinstance(item, dict) else {})}
    view["id"] = item_id
    if "role" in view:
        view.setdefault("type", "message")
    kind = view.get("type")
    if kind == "message":
        view.setdefault("status", "completed")
        content = view.get("content")
        if isinstance(content, str):
            part = "output_text" if view.get("role") == "assistant" else "input_text"
            view["content"] = [{"type": part, "text": content}]
        elif isinstance(content, list) and "message.output_text.logprobs" not in include:
            view["content"] = [
                {k: v for k, v in p.items() if k != "logprobs"} if isinstance(p, dict) else p
                for p in content
            ]
    elif kind == "reasoning" and "reasoning.encrypted_content" not in include:
        view.pop("encrypted_content", None)
    elif kind in ("function_call", "function_call_output"):
        view.setdefault("status", "completed")
    return view


@dataclass(frozen=True, slots=True)
class ListQuery:
    after: str | None
    limit: int
    order: str
    include: frozenset[str]


def parse_list_query(query: Mapping[str, str], includes: Iterable[str]) -> ListQuery:
    """`after`, `limit` (1 to 100, default 20), `order` (default desc) and `include[]`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("Invalid 'order': expected 'asc' or 'desc'.", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest("Invalid 'limit': expected an integer from 1 to 100.", param="limit")
    return ListQuery(query.get("after"), limit, order, check_include(includes))


def includes_of(query: MultiMapping[str]) -> frozenset[str]:
    """The `include[]` (or `include`) values of a query string, checked."""
    return check_include([*query.getall("include[]", []), *query.getall("include", [])])


def check_include(values: Iterable[str]) -> frozenset[str]:
    found = frozenset(values)
    unknown = sorted(found - INCLUDABLE)
    if unknown:
        raise InvalidRequest(f"Invalid 'include': unknown value '{unknown[0]}'.", param="include")
    return found


def page(items: list[dict[str, Any]], query: ListQuery) -> dict[str, Any]:
    """One page of a list, `items` oldest first (each with an `id`)."""
    ordered = items if query.order == "asc" else items[::-1]
    if query.after is not None:
        ids = [item["id"] for item in ordered]
        if query.after not in ids:
            raise InvalidRequest(f"No item with id '{query.after}' in this list.", param="after")
        ordered = ordered[ids.index(query.after) + 1 :]
    data = ordered[: query.limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > query.limit,
    }


def input_item_views(
    response_id: str, history: list[bytes], n_output: int, include: frozenset[str]
) -> list[dict[str, Any]]:
    """The model-visible input of a stored response (its chain's items, without its own
    output), each viewed as listed: with its own id, or one minted stable per response
    and position."""
    items: list[Any] = orjson.loads(b"[" + b",".join(history) + b"]")
    if n_output:
        items = items[:-n_output]
    minted = "msg_" + response_id.removeprefix("resp_") + "_"
    return [
        item_view(item, _own_id(item) or f"{minted}{index}", include)
        for index, item in enumerate(items)
        if isinstance(item, dict)
    ]


def _own_id(item: dict[str, Any]) -> str | None:
    own = item.get("id")
    return own if isinstance(own, str) and own else None
