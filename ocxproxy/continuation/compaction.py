"""Compaction served by the proxy (CONTRACT.md C10): the summary request, the sealed
`compaction` item, and the bytes a backend sees in its place.

A compaction item's `encrypted_content` is `ocxc1.` + base64url(nonce ‖ AES-256-GCM
ciphertext) of a small JSON document: the format version, the prompt version, the caller's
scope (a hash of its bearer token), the model and the summary. Only a proxy holding the
key can read it, and only for the credential that made it. Wherever an input carries one,
the backend gets `summary_message(summary)` instead: a plain user message whose bytes
depend on the summary alone, so every turn after a compaction forwards the same prefix.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson

from ocxproxy.continuation.expand import expand
from ocxproxy.errors import InvalidRequest

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

FORMAT = 1  # of the sealed document
PROMPT_VERSION = 1  # of COMPACTION_PROMPT; sealed with each item
TOKEN_PREFIX = "ocxc1."
TRIGGER = "compaction_trigger"
COMPACTION = "compaction"
KEY_BYTES = 32
RETAINED_USER_BYTES = 32 * 1024  # the newest user messages a compacted window keeps verbatim
_AAD = b"ocxproxy compaction item"
_NONCE_BYTES = 12
_OPENED_CACHE = 1024  # opened items kept by their encrypted_content

COMPACTION_PROMPT = (
    "Stop here: do not continue the task and do not call any tool. Write a summary of the "
    "conversation so far that will replace it: whoever reads it must be able to carry on "
    "the work without the earlier messages. Include the user's goals and constraints, "
    "what has been done and decided, the files, commands, identifiers and values that "
    "matter, the results of tool calls that are still relevant, open questions, and the "
    "next steps. Be concise and factual; write only the summary."
)
SUMMARY_PREFIX = "Summary of the conversation so far (earlier turns were compacted into it):\n\n"
_PROMPT_ITEM = orjson.dumps({"type": "message", "role": "user", "content": COMPACTION_PROMPT})
# Fields of a create that do not apply to the proxy's own summary request.
# A summary's output cap when the request sets none: a small model that never writes its
# end-of-text would otherwise hold the backend until the context is full.
SUMMARY_MAX_OUTPUT_TOKENS = 2048
_NOT_FOR_SUMMARY = ("context_management", "background", "stream_options", "prompt_cache_options")


class SealError(Exception):
    """An item this proxy cannot open for this caller; the message says why."""


class Sealer:
    """Seals and opens compaction items under one key (AES-256-GCM).

    `cryptography` is imported at the first seal or open, not with the proxy: its
    bindings are ~8 MiB of every process's memory, and most never compact."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a compaction key is {KEY_BYTES} bytes")
        self._key = key
        self._cipher: AESGCM | None = None
        self.fingerprint = key_fingerprint(key)
        self._opened: dict[str, tuple[str, bytes]] = {}  # token → (scope, summary message)

    def _aead(self) -> AESGCM:
        if self._cipher is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._cipher = AESGCM(self._key)
        return self._cipher

    @classmethod
    def ephemeral(cls) -> Sealer:
        return cls(os.urandom(KEY_BYTES))

    def seal(self, summary: str, *, scope: str, model: Any) -> str:
        document = {
            "v": FORMAT,
            "prompt": PROMPT_VERSION,
            "scope": scope,
            "model": model if isinstance(model, str) else None,
            "summary": summary,
        }
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead().encrypt(nonce, orjson.dumps(document), _AAD)
        return TOKEN_PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode().rstrip("=")

    def open(self, token: str, scope: str) -> bytes:
        """The summary message a sealed item stands for; SealError when the item was not
        made by this key, was altered, or belongs to another credential."""
        found = self._opened.get(token)
        if found is None:
            found = self._open(token)
            if len(self._opened) >= _OPENED_CACHE:
                del self._opened[next(iter(self._opened))]
            self._opened[token] = found
        owner, message = found
        if owner != scope:
            raise SealError("it was made for another API key")
        return message

    def _open(self, token: str) -> tuple[str, bytes]:
        if not token.startswith(TOKEN_PREFIX):
            raise SealError("it was not made by this proxy")
        body = token[len(TOKEN_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError:
            raise SealError("it is not valid base64url") from None
        if len(raw) <= _NONCE_BYTES:
            raise SealError("it is truncated")
        from cryptography.exceptions import InvalidTag

        try:
            plain = self._aead().decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _AAD)
        except InvalidTag:
            raise SealError("it was altered, or sealed under another key") from None
        document = orjson.loads(plain)
        if document.get("v") != FORMAT:
            raise SealError(f"its format {document.get('v')!r} is not supported")
        return str(document["scope"]), summary_message(str(document["summary"]))


def key_fingerprint(key: bytes) -> str:
    """What replicas compare to know they share a key; it does not reveal the key."""
    return hashlib.sha256(b"ocxproxy compaction key fingerprint\0" + key).hexdigest()[:32]


def summary_message(summary: str) -> bytes:
    """The bytes every backend gets in place of a compaction item: a user message that
    depends on the summary alone (the prefix cache sees the same bytes every turn)."""
    return orjson.dumps({"type": "message", "role": "user", "content": SUMMARY_PREFIX + summary})


_SUMMARY_MARK = summary_message("")[:-2]  # a summary message's bytes up to its summary
_PRUNED_CACHE = 1024  # conversations' retained items kept, by where their summary is
_pruned: dict[tuple[str, int, int], list[bytes]] = {}


def compacted_history(conversation_id: str, history: list[bytes]) -> list[bytes]:
    """A conversation's history as forwarded: from its latest summary message on, after
    the user messages it retains from before and any call made before it that no output
    there answers (a later one may); unchanged when it holds no summary. The conversation
    keeps every item; the backend gets the compacted window, the same bytes every turn."""
    for index in range(len(history) - 1, -1, -1):
        at = history[index].rfind(_SUMMARY_MARK)
        if at >= 0:
            break
    else:
        return history
    segment = history[index]
    if at > 0 and segment[at - 1 : at] != b",":
        return history  # not an item's start: text that quotes the summary's bytes
    key = (conversation_id, sum(map(len, history[:index])) + at, hash(segment[at:]))
    kept = _pruned.get(key)
    if kept is None:
        earlier = [*history[:index], segment[: max(0, at - 1)]]
        items = orjson.loads(b"[" + b",".join(part for part in earlier if part) + b"]")
        kept = [*map(orjson.dumps, retained_user_messages(items)), *_open_calls(items)]
        if len(_pruned) >= _PRUNED_CACHE:
            del _pruned[next(iter(_pruned))]
        _pruned[key] = kept
    return [*kept, segment[at:], *history[index + 1 :]]


def _open_calls(items: list[Any]) -> list[bytes]:
    """The tool calls in `items` that no output in them answers."""
    answered = {
        item.get("call_id")
        for item in items
        if type(item) is dict and str(item.get("type", "")).endswith("_output")
    }
    return [
        orjson.dumps(item)
        for item in items
        if type(item) is dict
        and str(item.get("type", "")).endswith("_call")
        and item.get("call_id") not in answered
    ]


def open_items(
    sealer: Sealer, scope: str, items: list[Any], indices: Iterable[int]
) -> dict[int, bytes]:
    """The summary message each compaction item at `indices` stands for; 400
    `invalid_encrypted_content` naming the first item that does not open."""
    opened: dict[int, bytes] = {}
    for index in indices:
        item = items[index]
        token = item.get("encrypted_content")
        name = f"input[{index}]" + (f" ({item['id']})" if isinstance(item.get("id"), str) else "")
        try:
            if not isinstance(token, str):
                raise SealError("it has no encrypted_content string")
            opened[index] = sealer.open(token, scope)
        except SealError as exc:
            raise InvalidRequest(
                f"The encrypted content of the compaction item {name} could not be "
                f"verified: {exc}.",
                param="input",
                code="invalid_encrypted_content",
            ) from None
    return opened


def with_summaries(items: list[Any], opened: dict[int, bytes]) -> list[Any]:
    """`items` with the opened compaction items replaced by their summary messages."""
    items = list(items)
    for index, message in opened.items():
        items[index] = orjson.loads(message)
    return items


def replace_in_body(raw: bytes, items: list[Any], opened: dict[int, bytes]) -> bytes | None:
    """The client's body with each opened compaction item's bytes replaced by its summary
    message and nothing else touched: a byte search from the end (the item sits near the
    end of a history sent by value) and one join, where re-serializing a long history
    would cost far more. None when an item's bytes cannot be told apart: the caller then
    builds the body item by item."""
    view = memoryview(raw)
    parts: list[bytes | memoryview] = []
    end = len(raw)
    for index in sorted(opened, reverse=True):
        item = items[index]
        token = item["encrypted_content"].encode()  # base64url: never escaped in JSON
        found = raw.rfind(token, 0, end)
        if found < 0:
            return None
        start = raw.rfind(b"{", 0, found)
        close = raw.find(b"}", found + len(token), end)
        if start < 0 or close < 0:
            return None
        try:
            if orjson.loads(view[start : close + 1]) != item:
                return None
        except orjson.JSONDecodeError:
            return None
        parts += (view[close + 1 : end], opened[index])
        end = start
    parts.append(view[:end])
    parts.reverse()
    return b"".join(parts)


def summary_request(body: dict[str, Any], history: list[bytes], tail: list[bytes]) -> bytes:
    """What the backend is asked for a summary: the turn's own context (instructions,
    tools, history and input: the prefix its cache holds) and then our prompt; one JSON
    answer, nothing stored."""
    fields = {k: v for k, v in body.items() if k not in _NOT_FOR_SUMMARY}
    fields["stream"] = False
    fields["store"] = False
    fields.setdefault("max_output_tokens", SUMMARY_MAX_OUTPUT_TOKENS)
    if fields.get("tools"):  # kept: they are part of the prefix the backend has cached
        fields["tool_choice"] = "none"
    return expand(fields, history, [*tail, _PROMPT_ITEM])


def without_tools(summary_body: bytes) -> bytes:
    """A summary request asked again of a model that called a tool: with no tools."""
    fields = orjson.loads(summary_body)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        fields.pop(name, None)
    return orjson.dumps(fields)


def called_tool(response: Any) -> bool:
    """Whether a backend's Response calls a tool."""
    output = response.get("output") if isinstance(response, dict) else None
    return any(
        isinstance(item, dict) and str(item.get("type", "")).endswith("_call")
        for item in (output if isinstance(output, list) else ())
    )


def summarized_items(summary_body: bytes) -> list[Any]:
    """The items a summary request summarized (its input without our prompt)."""
    items = orjson.loads(summary_body).get("input") or []
    return list(items[:-1])


def summary_text(response: Any) -> str:
    """The text of the message items of a backend's Response (empty when there is none)."""
    texts: list[str] = []
    output = response.get("output") if isinstance(response, dict) else None
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            continue
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict) or part.get("type") not in ("output_text", "text"):
                continue
            if isinstance(part.get("text"), str):
                texts.append(part["text"])
    return "".join(texts).strip()


def is_summary(item: Any) -> bool:
    content = item.get("content") if type(item) is dict else None
    return isinstance(content, str) and content.startswith(SUMMARY_PREFIX)


def retained_user_messages(items: Iterable[Any]) -> list[Any]:
    """The user messages a compacted window keeps verbatim: the newest ones, up to
    RETAINED_USER_BYTES, in their order (earlier summaries are not kept: the new one
    covers them)."""
    kept: list[Any] = []
    budget = RETAINED_USER_BYTES
    for item in reversed(list(items)):
        if type(item) is not dict or item.get("role") != "user" or is_summary(item):
            continue
        if item.get("type", "message") != "message":
            continue
        size = len(orjson.dumps(item))
        if size > budget:
            break
        budget -= size
        kept.append(item)
    kept.reverse()
    return kept


def new_item(token: str) -> dict[str, Any]:
    return {"id": "cmp_" + secrets.token_hex(24), "type": COMPACTION, "encrypted_content": token}


def usage_of(response: Any) -> dict[str, Any]:
    """The summary request's usage, in the Responses shape."""
    usage = response.get("usage") if isinstance(response, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    input_tokens = _count(usage.get("input_tokens"))
    output_tokens = _count(usage.get("output_tokens"))
    details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    out_details = usage.get("output_tokens_details")
    reasoning = _count(out_details.get("reasoning_tokens")) if isinstance(out_details, dict) else 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input_tokens + output_tokens,
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def add_usage(usage: dict[str, Any], extra: dict[str, Any], sign: int = 1) -> dict[str, Any]:
    """`usage` (a backend's, in the Responses shape) with `extra` (`usage_of`'s) added,
    or taken out with `sign` -1: its other members kept."""
    summed = dict(usage)
    for name in ("input_tokens", "output_tokens", "total_tokens"):
        summed[name] = max(0, _count(usage.get(name)) + sign * extra[name])
    for details, name in (
        ("input_tokens_details", "cached_tokens"),
        ("output_tokens_details", "reasoning_tokens"),
    ):
        own = usage.get(details)
        own = dict(own) if isinstance(own, dict) else {}
        own[name] = max(0, _count(own.get(name)) + sign * extra[details][name])
        summed[details] = own
    return summed


def compaction_response(
    body: dict[str, Any],
    response_id: str,
    created_at: int,
    output: list[Any],
    usage: dict[str, Any],
) -> dict[str, Any]:
    """The Response of a create whose input ended in a compaction trigger."""
    response: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "completed",
        "completed_at": created_at,
        "error": None,
        "incomplete_details": None,
        "model": body.get("model"),
        "output": output,
        "usage": usage,
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "metadata": body.get("metadata") or {},
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True),
        "background": False,
        "truncation": body.get("truncation", "disabled"),
    }
    for name in ("reasoning", "text", "max_output_tokens", "prompt_cache_key"):
        if name in body:
            response[name] = body[name]
    return response


def response_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A compaction Response as its stream of events, `sequence_number` from 0."""
    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    pending["completed_at"] = None
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
    ]
    for index, item in enumerate(response["output"]):
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": response})
    for seq, event in enumerate(events):
        event["sequence_number"] = seq
    return events


def sse(events: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(
        b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
        for event in events
    )


def window_message(message: dict[str, Any]) -> dict[str, Any]:
    """A retained user message as an item of the compacted window `/compact` answers: a
    complete message item (id, status, content as parts), as OpenAI's window carries them.
    The id is derived from the message, so the same window gets the same ids."""
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    message_id = message.get("id")
    if not isinstance(message_id, str) or not message_id:
        message_id = "msg_" + hashlib.sha256(orjson.dumps(message)).hexdigest()[:48]
    return {
        **message,
        "type": "message",
        "id": message_id,
        "status": "completed",
        "role": "user",
        "content": content,
    }


def compacted(
    response_id: str, created_at: int, output: list[Any], usage: dict[str, Any]
) -> dict[str, Any]:
    """The answer of `POST /v1/responses/compact` (the SDK's CompactedResponse)."""
    return {
        "id": response_id,
        "object": "response.compaction",
        "created_at": created_at,
        "output": output,
        "usage": usage,
    }


# -- context_management: compaction inside a create --------------------------------------

_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_BEFORE_ITEMS = ("response.created", "response.in_progress", "response.queued", "error")


def compact_threshold(body: dict[str, Any]) -> int | None:
    """`context_management: [{"type":"compaction","compact_threshold":N}]`: N, or None
    (absent, or no threshold given); a malformed one is a 400."""
    entries = body.get("context_management")
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise InvalidRequest(
            "Invalid type for 'context_management': expected an array.",
            param="context_management",
            code="invalid_type",
        )
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("type") != COMPACTION:
            raise InvalidRequest(
                f"Invalid 'context_management[{index}]': the only entry type is "
                "{'type': 'compaction', 'compact_threshold': N}.",
                param=f"context_management[{index}]",
            )
        threshold = entry.get("compact_threshold")
        if threshold is None:
            continue
        if type(threshold) is not int or threshold < 1000:
            raise InvalidRequest(
                f"Invalid 'context_management[{index}].compact_threshold': expected an "
                "integer of at least 1000, or null.",
                param=f"context_management[{index}].compact_threshold",
            )
        return threshold
    return None


def binding_calls(history: list[Any], items: list[Any]) -> list[Any]:
    """The tool calls of `history` that `items`' tool outputs answer: a compacted window
    keeps them, so no output reaches a backend without its call."""
    wanted = {
        item.get("call_id")
        for item in items
        if type(item) is dict and str(item.get("type", "")).endswith("_call_output")
    }
    wanted.discard(None)
    if not wanted:
        return []
    return [
        item
        for item in history
        if type(item) is dict
        and item.get("call_id") in wanted
        and not str(item.get("type", "")).endswith("_output")
    ]


class Injection:
    """Puts a compaction item first in a streamed Response made by the backend: its
    `output_item.added`/`done` go before the first event that is about the output, later
    `sequence_number`s and `output_index`es move up, and each terminal Response carries
    the item first, and in its usage the summary request's (`usage`: both are billed in
    this one response). Works on parsed payloads, changed in place."""

    def __init__(self, item: dict[str, Any], usage: dict[str, Any]) -> None:
        self.item = item
        self.usage = usage
        self.placed = False
        self.billed: dict[str, Any] | None = None  # the usage `into` wrote

    def before(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that go before this one (the item's, once)."""
        if self.placed or payload.get("type") in _BEFORE_ITEMS:
            return []
        self.placed = True
        events = [
            {"type": "response.output_item.added", "output_index": 0, "item": self.item},
            {"type": "response.output_item.done", "output_index": 0, "item": self.item},
        ]
        seq = payload.get("sequence_number")
        if type(seq) is int:
            for offset, event in enumerate(events):
                event["sequence_number"] = seq + offset
        return events

    def shift(self, payload: dict[str, Any]) -> None:
        if self.placed:
            seq, index = payload.get("sequence_number"), payload.get("output_index")
            if type(seq) is int:
                payload["sequence_number"] = seq + 2
            if type(index) is int:
                payload["output_index"] = index + 1
        response = payload.get("response")
        if payload.get("type") in _TERMINAL and type(response) is dict:
            self.into(response)

    def into(self, response: dict[str, Any]) -> None:
        output = response.get("output")
        if isinstance(output, list) and (not output or output[0] is not self.item):
            output.insert(0, self.item)
        usage = response.get("usage")
        if isinstance(usage, dict) and usage is not self.billed:
            self.billed = response["usage"] = add_usage(usage, self.usage)

    def own(self, response: dict[str, Any]) -> dict[str, Any]:
        """`response` with the turn's own usage, as its backend reported it."""
        usage = response.get("usage")
        if not isinstance(usage, dict) or usage is not self.billed:
            return response
        return {**response, "usage": add_usage(usage, self.usage, sign=-1)}
