"""Responses request → Chat Completions request, for backends that speak only chat (CONTRACT.md C6).
Pure: dicts in, dicts out; no asyncio, no aiohttp.

The translation is deterministic: the same items always give the same chat messages, so a
continuation's `messages` extend the previous turn's as a list and the backend's prefix
cache hits. Reasoning items are kept in the store but not sent (chat has no slot for
them); anything a chat backend cannot do is an InvalidRequest naming the `param`, raised
before anything is forwarded, never a silent drop. The way back lives in chat_stream.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ocxproxy.errors import InvalidRequest, backend_error

CHAT_PATH = "/v1/chat/completions"

# Request fields a chat backend cannot honour, with the values that are still fine.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "context_management": (None, []),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
}
# Fields the Response object repeats from the request, with their defaults.
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A Responses create body shaped for a chat backend."""

    body: dict[str, Any]  # the chat completions request
    stream: bool  # the client asked for SSE
    model: Any  # the requested model, for a backend that names none

    def encode(self) -> bytes:
        return orjson.dumps(self.body)


def to_chat(body: dict[str, Any]) -> ChatRequest:
    """A Responses create body (expanded: no previous_response_id) → the chat request."""
    if body.get("previous_response_id") is not None:  # only with --forward-unknown-ids
        raise _unsupported(
            "previous_response_id",
            "A Chat Completions backend keeps no state: an unknown 'previous_response_id' "
            "cannot be forwarded to it.",
        )
    for name, fine in _UNSUPPORTED.items():
        if body.get(name) not in fine:
            raise _unsupported(name, f"'{name}' is not supported by a Chat Completions backend.")
    stream = body.get("stream") is True
    chat: dict[str, Any] = {}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    chat["messages"] = chat_messages(body.get("input"), body.get("instructions"))
    tools = body.get("tools")
    if tools:
        chat["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for name in ("parallel_tool_calls", "temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    return ChatRequest(chat, stream, body.get("model"))


def chat_messages(items: Any, instructions: Any = None) -> list[dict[str, Any]]:
    """Instructions and input items → chat messages; consecutive function calls (and the
    assistant text right before them) become one assistant message with `tool_calls`."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _unsupported("instructions", "'instructions' must be a string.")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif items is None:
        items = []
    elif not isinstance(items, list):
        raise _unsupported("input", "'input' must be a string or an array of items.")
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _unsupported(where, f"{where} is not an object.")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _tool_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _unsupported(where, f"{where} has no 'call_id'.")
            content = _content(item.get("output"), f"{where}.output", images=False)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # kept in the store, but a chat backend has no place for it
        else:
            raise _unsupported(
                where, f"Input items of type '{kind}' are not supported by a Chat Completions "
                "backend."
            )  # fmt: skip
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise _unsupported(f"{where}.role", f"Unsupported message role {role!r} in {where}.")
    content = item.get("content")
    if role == "assistant":
        return {"role": "assistant", "content": _assistant_text(content, where)}
    return {"role": _ROLES[role], "content": _content(content, f"{where}.content", images=True)}


def _assistant_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _unsupported(f"{where}.content", f"{where} has no content.")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise _unsupported(
                f"{where}.content[{index}]", f"Unsupported assistant content part {kind!r}."
            )
    return "".join(texts)


def _content(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A string stays a string, and so does a lone text part; other parts become chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _unsupported(where, f"{where} must be a string or an array of content parts.")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and images and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            what = "file_id images" if kind == "input_image" and images else repr(kind)
            raise _unsupported(
                f"{where}[{index}]", f"Content parts of type {what} are not supported by a "
                "Chat Completions backend."
            )  # fmt: skip
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise _unsupported(where, f"{where} needs a 'call_id', a 'name' and string 'arguments'.")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _unsupported("tools", "'tools' must be an array.")
    result = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise _unsupported(
                f"tools[{index}].type",
                f"Tools of type {kind!r} are not supported by a Chat Completions backend: "
                "only function tools are.",
            )
        function = {
            k: tool[k]
            for k in ("name", "description", "parameters", "strict")
            if tool.get(k) is not None
        }
        result.append({"type": "function", "function": function})
    return result


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _unsupported(
        "tool_choice", "Only 'auto', 'none', 'required' and function tool choices are supported "
        "by a Chat Completions backend."
    )  # fmt: skip


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, dict):
        schema = {
            k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None
        }
        return {"type": "json_schema", "json_schema": schema}
    raise _unsupported(
        "text.format.type", f"Text format {kind!r} is not supported by a Chat Completions backend."
    )


def _unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="unsupported_parameter")


def chat_error(status: int, body: bytes) -> bytes:
    """A chat backend's error answer → an OpenAI-shaped error body (status kept by the caller)."""
    return orjson.dumps({"error": backend_error(status, body)})
