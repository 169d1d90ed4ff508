"""The Open Responses schema's rules for what a server emits, as plain checks: every
member a Response object requires and its type, what output items and content parts
require, and the lifecycle and item events of a stream (the official compliance suite
validates each Response and event against these, with zod).

`response_problems(response)` and `event_problems(event)` list what is wrong ([] when
valid); tests assert on them for everything the proxy emits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Check = Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _is(*types: type) -> Check:
    return lambda value: type(value) in types


def _or_null(check: Check) -> Check:
    return lambda value: value is None or check(value)


def _text_field(value: Any) -> bool:
    return type(value) is dict and type(value.get("format")) is dict


def _reasoning(value: Any) -> bool:
    return value is None or (type(value) is dict and "effort" in value and "summary" in value)


def _usage(value: Any) -> bool:
    if value is None:
        return True
    if type(value) is not dict:
        return False
    if not all(_is_int(value.get(k)) for k in ("input_tokens", "output_tokens", "total_tokens")):
        return False
    inputs, outputs = value.get("input_tokens_details"), value.get("output_tokens_details")
    return (
        type(inputs) is dict
        and _is_int(inputs.get("cached_tokens"))
        and type(outputs) is dict
        and _is_int(outputs.get("reasoning_tokens"))
    )


def _tools(value: Any) -> bool:
    if type(value) is not list:
        return False
    return all(
        type(tool) is dict
        and all(k in tool for k in ("name", "description", "parameters", "strict"))
        for tool in value
        if type(tool) is dict and tool.get("type") == "function"
    )


def _error(value: Any) -> bool:
    return value is None or (
        type(value) is dict and type(value.get("code")) is str and type(value.get("message")) is str
    )


# Every member of ResponseResource, with what its value may be.
RESPONSE: dict[str, Check] = {
    "id": _is(str),
    "object": lambda v: v == "response",
    "created_at": _is_int,
    "completed_at": _or_null(_is_int),
    "status": _is(str),
    "incomplete_details": lambda v: v is None or (type(v) is dict and type(v.get("reason")) is str),
    "model": _is(str),
    "previous_response_id": _or_null(_is(str)),
    "instructions": _or_null(_is(str, list)),
    "output": _is(list),
    "error": _error,
    "tools": _tools,
    "tool_choice": _is(str, dict),
    "truncation": _is(str),
    "parallel_tool_calls": _is(bool),
    "text": _text_field,
    "top_p": _is_number,
    "presence_penalty": _is_number,
    "frequency_penalty": _is_number,
    "top_logprobs": _is_int,
    "temperature": _is_number,
    "reasoning": _reasoning,
    "usage": _usage,
    "max_output_tokens": _or_null(_is_int),
    "max_tool_calls": _or_null(_is_int),
    "store": _is(bool),
    "background": _is(bool),
    "service_tier": _is(str),
    "metadata": lambda v: v is not None,
    "safety_identifier": _or_null(_is(str)),
    "prompt_cache_key": _or_null(_is(str)),
}
_STATUSES = ("in_progress", "completed", "incomplete")


def part_problems(part: Any, where: str) -> list[str]:
    if type(part) is not dict or type(part.get("type")) is not str:
        return [f"{where}: not a content part"]
    if part["type"] == "output_text":
        problems = [] if type(part.get("text")) is str else [f"{where}.text"]
        if type(part.get("annotations")) is not list:
            problems.append(f"{where}.annotations")
        if "logprobs" in part and type(part["logprobs"]) is not list:
            problems.append(f"{where}.logprobs")
        return problems
    return []


def item_problems(item: Any, where: str) -> list[str]:
    if type(item) is not dict:
        return [f"{where}: not an object"]
    kind = item.get("type")
    required: tuple[str, ...] = ()
    if kind == "message":
        required = ("id", "status", "role", "content")
    elif kind == "function_call":
        required = ("id", "call_id", "name", "arguments", "status")
    elif kind == "reasoning":
        required = ("id", "summary")
    problems = [f"{where}.{name}" for name in required if name not in item]
    if "status" in required and item.get("status") not in _STATUSES:
        problems.append(f"{where}.status={item.get('status')!r}")
    if kind == "message" and type(item.get("content")) is list:
        for index, part in enumerate(item["content"]):
            problems += part_problems(part, f"{where}.content[{index}]")
    return problems


def response_problems(response: Any, where: str = "response") -> list[str]:
    """What makes `response` an invalid ResponseResource ([] when it is valid)."""
    if type(response) is not dict:
        return [f"{where}: not an object"]
    problems = [
        f"{where}.{name}={response.get(name, '<absent>')!r}"
        for name, check in RESPONSE.items()
        if name not in response or not check(response[name])
    ]
    for index, item in enumerate(response.get("output") or []):
        problems += item_problems(item, f"{where}.output[{index}]")
    return problems


_LIFECYCLE = (
    "response.created",
    "response.queued",
    "response.in_progress",
    "response.completed",
    "response.failed",
    "response.incomplete",
)
_ADDRESSED = {  # event → members it requires besides type and sequence_number
    "response.output_item.added": ("output_index", "item"),
    "response.output_item.done": ("output_index", "item"),
    "response.content_part.added": ("item_id", "output_index", "content_index", "part"),
    "response.content_part.done": ("item_id", "output_index", "content_index", "part"),
    "response.output_text.delta": ("item_id", "output_index", "content_index", "delta"),
    "response.output_text.done": ("item_id", "output_index", "content_index", "text"),
    "response.function_call_arguments.delta": ("item_id", "output_index", "delta"),
    "response.function_call_arguments.done": ("item_id", "output_index", "arguments"),
}


def event_problems(event: Any) -> list[str]:
    """What makes a streamed event (SSE data, or a WebSocket frame) invalid."""
    if type(event) is not dict or type(event.get("type")) is not str:
        return ["event: not an object with a type"]
    kind = event["type"]
    where = kind
    if kind == "error":
        error = event.get("error")
        if "status" in event:  # the WebSocket error event
            ok = _is_int(event["status"]) and type(error) is dict
            return [] if ok and type(error.get("code")) is str else [f"{where}: {event!r}"]
        if not _is_int(event.get("sequence_number")) or type(error) is not dict:
            return [f"{where}: {event!r}"]
        return [f"{where}.error.{k}" for k in ("type", "message") if type(error.get(k)) is not str]
    problems = [] if _is_int(event.get("sequence_number")) else [f"{where}.sequence_number"]
    if kind in _LIFECYCLE:
        return problems + response_problems(event.get("response"), f"{where}.response")
    for name in _ADDRESSED.get(kind, ()):
        if name not in event:
            problems.append(f"{where}.{name}")
    if "item" in event and event["item"] is not None:
        problems += item_problems(event["item"], f"{where}.item")
    if "part" in event:
        problems += part_problems(event["part"], f"{where}.part")
    return problems
