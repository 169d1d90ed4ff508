"""One error family for everything the proxy answers with an OpenAI-shaped error.

    OcxError                      status + OpenAI type/code/param; to_openai_error()
    ├── InvalidRequest            400 invalid_request_error (bad JSON, bad field, conflicts)
    ├── PreviousResponseNotFound  400 previous_response_not_found (CONTRACT.md C1.2), + reason
    ├── ConversationLocked        400 conversation_locked (another turn holds it)
    ├── NotFound                  404 (unknown stored response or conversation)
    ├── Conflict                  409 (an Idempotency-Key whose first request is in flight)
    ├── Unprocessable             422 (an Idempotency-Key reused with another body)
    ├── StoreFull                 507 (taking a write would make a cap drop conversation items)
    ├── PayloadTooLarge           413
    ├── Unauthorized              401
    ├── RateLimited               429 rate_limit_exceeded
    ├── StorageUnavailable        503 storage_unavailable (a turn could not be made durable,
    │                             or the shared store cannot be reached)
    ├── ShuttingDown              503 server_shutting_down (cut at the end of a graceful stop)
    └── UpstreamError             502/504 backend unreachable, timed out or broke off

Store failures (store/) are typed as StoreFailure with a FailureReason; the HTTP layer
turns them into PreviousResponseNotFound, counting the reason, and a turn's failed commit
into the error its reason calls for (`not_stored`).
"""

from __future__ import annotations

import enum
from typing import Any

import orjson


class OcxError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_openai_error(self) -> dict[str, Any]:
        code = self.code or code_for_status(self.status)
        return to_openai_error(self.message, self.type, code, self.param)

    def body(self) -> bytes:
        return orjson.dumps(self.to_openai_error())

    def headers(self) -> dict[str, str]:
        """The answer's headers: JSON, and when to try again for a 429 or 503."""
        headers = {"Content-Type": "application/json"}
        if self.status in (429, 503):
            headers["Retry-After"] = "1"
        return headers


def to_openai_error(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def code_for_status(status: int) -> str:
    """The code of an error that has none of its own (raised without one, a backend's
    numeric or null one): the one its status stands for, as OpenAI's errors carry, since
    clients and the Open Responses suite match on `error.code`."""
    if status >= 500:
        return "server_error"
    return "rate_limit_exceeded" if status == 429 else "invalid_request_error"


def complete_error_event(payload: dict[str, Any]) -> bool:
    """A backend's SSE `error` event's payload (changed in place) as the proxy's own are
    (upstream/sse.py's error_event): the error object nested, its code a string, and the
    flat members OpenAI's events carry beside it kept; whether it changed."""
    status = payload.get("status")
    error = payload.get("error")
    changed = False
    if type(error) is not dict:  # OpenAI's flat form only
        message, param = payload.get("message"), payload.get("param")
        error = payload["error"] = {
            "type": "server_error",
            "code": payload.get("code"),
            "message": message if type(message) is str else "The backend reported an error.",
            "param": param if type(param) is str else None,
        }
        changed = True
    if not _is_code(error.get("code")):
        error = payload["error"] = {
            **error,
            "code": code_for_status(status if type(status) is int else 500),
        }
        changed = True
    if "code" in payload and not _is_code(payload["code"]):
        payload["code"] = error["code"]
        changed = True
    return changed


def _is_code(code: Any) -> bool:
    return type(code) is str and code != ""


class InvalidRequest(OcxError):
    status = 400
    type = "invalid_request_error"


class PreviousResponseNotFound(InvalidRequest):
    code = "previous_response_not_found"

    def __init__(self, response_id: str, reason: FailureReason) -> None:
        super().__init__(
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
        )
        self.response_id = response_id
        self.reason = reason


class NotFound(OcxError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ConversationLocked(InvalidRequest):
    """Another response or items write is in progress on the conversation (OpenAI's exact
    error: HTTP 400, not 409, so the SDK does not retry it by itself)."""

    code = "conversation_locked"

    def __init__(self) -> None:
        super().__init__(
            "Another process is currently operating on this conversation. "
            "Please retry in a few seconds.",
            param="conversation",
        )


class Conflict(OcxError):
    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_in_use"


class Unprocessable(OcxError):
    status = 422
    type = "invalid_request_error"
    code = "idempotency_key_reused"


class StoreFull(OcxError):
    """A write the store's caps could only take by dropping conversation items."""

    status = 507
    type = "server_error"
    code = "store_full"


class PayloadTooLarge(OcxError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Unauthorized(OcxError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class RateLimited(OcxError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class ShuttingDown(OcxError):
    """A request still running when the graceful stop's --shutdown-timeout ran out."""

    status = 503
    type = "server_error"
    code = "server_shutting_down"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "The server is shutting down and stopped this request before it finished; "
            "nothing of it was stored. Retry it (another replica, or this one once it "
            "restarts, will serve it)."
        )


class UpstreamError(OcxError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class StorageUnavailable(OcxError):
    """A turn that could not be made durable (disk full, I/O error): not acknowledged."""

    status = 503
    type = "server_error"
    code = "storage_unavailable"


class FailureReason(enum.StrEnum):
    """Why a previous_response_id could not be resolved; a metric label."""

    UNKNOWN = "unknown"  # never stored here, or another credential's
    EXPIRED = "expired"  # past its TTL
    EVICTED = "evicted"  # pushed out by a count or byte bound
    MISSING = "missing"  # a spill file it needs is gone
    CORRUPT = "corrupt"  # a spill file failed its digest or did not decompress
    TOO_LARGE = "too_large"  # the stored data exceeds a read limit
    WRITE_FAILED = "write_failed"  # its data could not be written to the disk tier
    READ_FAILED = "read_failed"  # an I/O error reading the disk tier
    FULL = "full"  # taking it would make a cap drop conversation items


class StoreFailure(Exception):
    """A typed failure of the continuation store."""

    def __init__(self, reason: FailureReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail


_NOT_SAVED = " Nothing was saved; retry later, or send store=false."
# What happened to the history a turn continues (found when the turn began) by the time
# its commit was refused. UNKNOWN is a lookup's answer for an id the store does not hold
# and keeps no reason for: deleted (a DELETE leaves none), gone for a reason the store
# forgot (it keeps the last 10,000, none across a restart), a shared server's key gone
# (deleted, expired, lost); all it says is that the store no longer holds it. (No store's
# commit refuses a turn with it; one that did would be answered truly.)
_GONE = {
    FailureReason.EVICTED: "was evicted while it ran",
    FailureReason.EXPIRED: "expired while it ran",
    FailureReason.UNKNOWN: "went while it ran (the store no longer holds it)",
    FailureReason.MISSING: "was lost while it ran",
}


def not_stored(failure: StoreFailure) -> OcxError:
    """The answer to a turn whose commit `failure` refused (the turn is not acknowledged):
    what its reason is to a client. Its message names the cause alone, never content."""
    reason, lead = failure.reason, "The response could not be stored: "
    if reason == FailureReason.FULL:
        return StoreFull(
            lead + "the proxy's store is full (its byte or entry cap is reached and what it "
            "holds may not be evicted)." + _NOT_SAVED
        )
    if reason in _GONE:  # what it continues went while it ran: as a retry would find it
        return InvalidRequest(
            lead + f"the stored history it continues {_GONE[reason]}. "
            "Nothing was saved; send the whole conversation as input instead.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if reason == FailureReason.WRITE_FAILED:
        return StorageUnavailable(
            lead + "the proxy's storage could not write it (a full disk or an I/O error, "
            "or a shared store that did not answer or whose replicas did not acknowledge "
            "the write)." + _NOT_SAVED
        )
    return StorageUnavailable(  # CORRUPT, READ_FAILED, TOO_LARGE: stored data it needed
        lead + f"the proxy's storage could not read what it builds on ({reason})." + _NOT_SAVED
    )


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# How backends say an input is past their context window: llama.cpp's error type and
# message, vLLM's (and OpenAI's older) message.
_OVERFLOW_MESSAGES = ("exceeds the available context size", "maximum context length")


def _is_context_overflow(kind: Any, code: Any, message: str) -> bool:
    return (
        code == CONTEXT_LENGTH_EXCEEDED
        or kind == "exceed_context_size_error"
        or any(text in message for text in _OVERFLOW_MESSAGES)
    )


def error_answer(status: int, body: bytes) -> bytes | None:
    """A backend's error answer as the client gets it: None when it is OpenAI-shaped
    with a string code (relayed as it is), else as `backend_error` shapes it (a code
    never null, an input past the context window `context_length_exceeded`)."""
    shaped = backend_error(status, body)
    if shaped["code"] != CONTEXT_LENGTH_EXCEEDED:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        error = doc.get("error") if type(doc) is dict else None
        if type(error) is dict and _is_code(error.get("code")):
            return None
    return orjson.dumps({"error": shaped})


def backend_error(status: int, body: bytes) -> dict[str, Any]:
    """A backend's error answer as the inner OpenAI error object (the status is the
    caller's). Backends disagree on the shape: OpenAI/llama.cpp nest it under `error`
    (llama.cpp with a numeric `code`), older vLLM is flat, TGI puts a string in `error`,
    some answer plain text. An input past the backend's context window is OpenAI's
    `context_length_exceeded` whatever the backend calls it."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    inner: dict[str, Any] = {}
    message: Any = None
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict):
            inner = error
        else:
            inner, message = doc, error
    message = inner.get("message") or inner.get("detail") or message
    if not isinstance(message, str) or not message:
        text = body.decode("utf-8", "replace").strip()
        message = text[:500] if text and doc is None else f"The backend answered {status}."
    kind, code, param = inner.get("type"), inner.get("code"), inner.get("param")
    if status == 400 and _is_context_overflow(kind, code, message):
        error = to_openai_error(message, "invalid_request_error", CONTEXT_LENGTH_EXCEEDED, "input")
        return dict(error["error"])
    fallback = "server_error" if status >= 500 else "invalid_request_error"
    shaped: dict[str, Any] = to_openai_error(
        message,
        kind if isinstance(kind, str) and kind else fallback,
        code if _is_code(code) else code_for_status(status),
        param if isinstance(param, str) else None,
    )["error"]
    return shaped
