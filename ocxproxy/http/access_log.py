"""The access log (`--access-log text|json`): one line per request, one per WebSocket turn.

Lines go straight to stdout, flushed each (the other logs go to stderr): the logging module
would cost ~25 µs a line, most of a turn's budget. The field names are stable;
docs/BEHAVIOR.md lists them. A line never carries content: no prompt or output text, no
header, no key; the caller appears as a prefix of its scope hash (CONTRACT.md C5), and a
client's X-Request-Id only if it is a plain token (http/headers.py's request_id). Probe
routes (/healthz, /readyz, /metrics) are not logged.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson

from ocxproxy.errors import OcxError, PreviousResponseNotFound
from ocxproxy.metrics import Timing

FIELDS = (
    "time",
    "request_id",
    "method",
    "route",
    "status",
    "outcome",
    "duration_ms",
    "overhead_ms",
    "backend_ms",
    "backend",
    "expansion",
    "history_bytes",
    "input_tokens",
    "cached_tokens",
    "scope",
)
SCOPE_CHARS = 12  # of the scope's hex hash: enough to tell callers apart, nothing more
_BARE = re.compile(r"[A-Za-z0-9._:/+-]+")  # logfmt values that need no quotes


class AccessLog:
    def __init__(self, style: str) -> None:
        if style not in ("text", "json"):
            raise ValueError(f"unknown access log style {style!r}")
        self.json = style == "json"

    def write(
        self,
        *,
        request_id: str,
        method: str,
        route: str,
        status: int | None,
        outcome: str,
        elapsed: float,
        timing: Timing,
        scope: str,
        error: OcxError | None = None,
    ) -> None:
        """One line: `elapsed` is the request's (or turn's) wall time in seconds."""
        exchange = timing.exchange
        expansion = exchange.expansion if exchange is not None else None
        if isinstance(error, PreviousResponseNotFound):
            expansion = str(error.reason)
        entry: dict[str, Any] = {
            "time": _now(),
            "request_id": request_id,
            "method": method,
            "route": route,
            "status": status,
            "outcome": outcome,
            "duration_ms": round(elapsed * 1000, 3),
            "overhead_ms": round(max(elapsed - timing.upstream, 0.0) * 1000, 3),
            "backend_ms": round(timing.upstream * 1000, 3),
            "backend": timing.backend,
            "expansion": expansion,
            "history_bytes": exchange.history_bytes if exchange is not None else 0,
            "input_tokens": exchange.input_tokens if exchange is not None else None,
            "cached_tokens": exchange.cached_tokens if exchange is not None else None,
            "scope": scope[:SCOPE_CHARS],
        }
        out = sys.stdout  # looked up each time: tests capture it
        out.write((orjson.dumps(entry).decode() if self.json else _logfmt(entry)) + "\n")
        out.flush()


def _now() -> str:
    """UTC, to the millisecond: 2026-12-01T12:30:41.123Z."""
    stamp = datetime.fromtimestamp(time.time(), UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _logfmt(entry: dict[str, Any]) -> str:
    """key=value pairs; `-` for none, JSON-quoted where a value has spaces or quotes."""
    parts = []
    for key, value in entry.items():
        if value is None:
            text = "-"
        elif isinstance(value, str):
            text = value if _BARE.fullmatch(value) else orjson.dumps(value).decode()
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)
