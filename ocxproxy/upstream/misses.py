"""Why a continuation's prefix was not in the backend's cache (CONTRACT.md C12).

A finished turn leaves, beside the tokens of its input and output and its truncation's
drop point (continuation/window.py's `Fact`: the prefix its continuation should find
cached), the backend that served it, that backend's epoch then (it changes when the
backend restarts or was down) and what its prompt began with. The next turn compares the
cached tokens its backend reports with that prefix; a
shortfall is counted once, with the first reason that explains it (metrics.py's
`CACHE_MISS_REASONS`, in that order). No I/O, no parsing: the usage is read from the
response the turn records anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

from ocxproxy.continuation.window import BOOK_SLACK
from ocxproxy.model import forget_oldest

BOOK_SIZE: Final = 100_000  # turns remembered (the oldest leave first): ~100 bytes each
ALIKE: Final = 4096  # distinct `Served` values shared (forgotten all at once past this)
SLACK: Final = 32  # tokens a hit may fall short by (re-tokenized output, cache blocks)
SLACK_SHARE: Final = 0.1  # ... or this share of the prefix, when more
# The request fields rendered before the history: a change starts a new prompt.
_HEAD_FIELDS: Final = ("model", "instructions", "tool_choice")


@dataclass(frozen=True, slots=True)
class Served:
    """Where a finished turn left its prefix."""

    backend: str
    epoch: int  # the backend's (fleet.Backend.epoch) when it answered
    head: int  # head_of() its request
    scope: str = ""  # its caller's (re-warm looks its chain up there)
    turn: str = ""  # a conversation's (kept under its id): its latest turn's response id
    edited: bool = False  # a conversation's: an item was deleted since (its prompt changed)


@dataclass(frozen=True, slots=True)
class Miss:
    reason: str
    expected: int  # the prefix tokens the backend should have had
    cached: int  # what it reported


def head_of(body: dict[str, Any]) -> int:
    """A cheap signature of what the prompt says before the history: the model, the
    instructions, the tools by name and the reasoning effort (a few µs, never a
    serialization of the tools)."""
    tools = body.get("tools")
    names = (
        tuple(tool.get("name") or tool.get("type") for tool in tools if isinstance(tool, dict))
        if isinstance(tools, list)
        else None
    )
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    fields = tuple(_hashable(body.get(name)) for name in _HEAD_FIELDS)
    return hash((fields, names, effort))


def _hashable(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, int, float)) else repr(value)


class CacheBook:
    """The `Served` of recent turns by response id, and of conversations by their id, in
    memory, oldest first (after a proxy restart a chain's next turn is not compared).
    Turns served alike (one backend, epoch, prompt head and caller: most of them) share
    one `Served` object; a conversation's, which names its latest turn, is its own."""

    def __init__(self, size: int = BOOK_SIZE) -> None:
        self.size = size
        self.most = size + size // BOOK_SLACK  # past this, down to `size` at once
        self.served: dict[str, Served] = {}
        self._alike: dict[tuple[str, int, int, str], Served] = {}

    def get(self, response_id: str) -> Served | None:
        return self.served.get(response_id)

    def put(self, response_id: str, served: Served) -> None:
        if not served.turn:  # (a conversation's names its own latest turn)
            alike = self._alike
            key = (served.backend, served.epoch, served.head, served.scope)
            found = alike.get(key)
            if found is not None:
                served = found
            else:
                if len(alike) >= ALIKE:
                    alike.clear()
                alike[key] = served
        book = self.served
        book.pop(response_id, None)  # (a conversation's again: it is the newest now)
        book[response_id] = served
        if len(book) > self.most:
            forget_oldest(book, self.size)

    def edited(self, conversation_id: str) -> None:
        """An item was deleted from the conversation: its next turn's prompt is not the
        one its last turn left in the cache."""
        served = self.served.get(conversation_id)
        if served is not None:
            self.served[conversation_id] = replace(served, edited=True)


def miss_of(
    parent: Served,
    prefix: int,
    parent_dropped: int,
    *,
    backend: str,
    epoch: int,
    head: int,
    dropped: int,
    compacted: bool,
    note: str | None,
    input_tokens: int,
    cached: int,
) -> Miss | None:
    """The continuation of a turn that was `parent`, `prefix` tokens long (input and
    output) with `parent_dropped` items dropped, served by `backend` at `epoch`, reported
    `cached` of `input_tokens`: None when that covers the prefix, else the Miss. `note`
    is what the warm-resume step knew before sending (restore_failed,
    fingerprint_mismatch)."""
    expected = min(prefix, input_tokens)
    if cached + max(SLACK, int(expected * SLACK_SHARE)) >= expected:
        return None
    if note is not None:
        reason = note
    elif compacted:
        reason = "compacted"
    elif dropped != parent_dropped:
        reason = "truncated"
    elif backend != parent.backend:
        reason = "rerouted"
    elif epoch != parent.epoch:
        reason = "backend_restarted"
    elif head != parent.head or parent.edited:
        reason = "diverged"
    else:
        reason = "evicted"
    return Miss(reason, expected, cached)
