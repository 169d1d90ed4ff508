"""Every Response object the proxy emits is complete (CONTRACT.md C1.9).

A stateless backend answers with what it knows: llama.cpp leaves out two dozen members
the Responses schema requires (`tools`, `temperature`, `text`, `store`, …), and knows
nothing of `previous_response_id` or `conversation`. `Envelope` fills each member in, in
this order of preference: the backend's own value when it is a valid one; else the
request's (`tools`, `instructions`, `temperature`, …, and `previous_response_id` or
`conversation`, which the backend never saw); else OpenAI's documented default, but for
the embedded backend's sampling values (`ServedModels`: a Response says the `temperature`
and `top_p` it was sampled with). Output items get what the schema requires of them too
(a message's `status`, an output text's `annotations`).

It is applied where a Response leaves the proxy: a create's JSON answer and the Response
of each `response.*` lifecycle event (http/exchange.py), over WebSocket too; what the
store keeps is the completed Response, so GET and an idempotent replay give it again.
The forwarded input is never touched: the envelope is not input.

Cost: the completed dict is written back into the backend's bytes by inserting the
missing members after the object's opening brace (a JSON answer's before its closing
one) and the echoed ids in place of their nulls, so a long output is not encoded again;
only a member present with an invalid value, or an incomplete output item, re-encodes
the object. What a Response lacks is worked out once per shape of its members
(`_Plan`), the members filled in are built and encoded once for every request that gives
the same values for them (`_Fill`; a continuation's are known by the bytes its members
were forwarded as, so a coding agent's instructions and tools are not encoded again), a
pending event whose shape was seen is not decoded (`pending_event`; compiled, it is
matched and spliced in one call, with the members a request with the same fills got,
kept with the shape: `_Seen.memo`), a JSON answer of
the shape and values last seen valid is completed in one call (`answer`, a terminal
event's Response too: `terminal_event`), and its spliced bytes are what the store keeps.
With the compiled fast paths built (ocxproxy/_speedups.c), that usual answer and event
are one C call each, from what the Python keeps here (`_KEPT`, `_Plan.fast`), read there
at fixed offsets: Envelope's `answer`, `terminal_event` and `pending_event` are then
methods of its C base, without a Python frame; any other case declines to the Python
below (`_answer`, …), which stays the reference.
"""

from __future__ import annotations

import operator
import re
import time
from collections.abc import Callable
from itertools import chain
from typing import TYPE_CHECKING, Any

import orjson

from ocxproxy.speedups import SPEEDUPS
from ocxproxy.upstream.sse import (
    TERMINAL_EVENTS,
    Event,
    encode_event,
    loads_or_none,
    rewrite,
    with_data,
)

# The compiled fast paths, or None (the Python ones run). Tests set it to None with the
# Python methods in place of the compiled ones (tests/continuation/envelope_state.py).
_c = SPEEDUPS
_MISSING: Any = object()
_NONE = type(None)
_NUMBER = (int, float)  # type(value) in _NUMBER: a bool is not a number here

# Members taken from the request when the backend gave no valid value: the types the
# schema allows, and the default when the request gives none either.
_ECHOED: dict[str, tuple[tuple[type, ...], Any]] = {
    "instructions": ((str, list, _NONE), None),
    "tool_choice": ((str, dict), "auto"),
    "truncation": ((str,), "disabled"),
    "parallel_tool_calls": ((bool,), True),
    "top_p": (_NUMBER, 1.0),
    "presence_penalty": (_NUMBER, 0.0),
    "frequency_penalty": (_NUMBER, 0.0),
    "top_logprobs": ((int,), 0),
    "temperature": (_NUMBER, 1.0),
    "max_output_tokens": ((int, _NONE), None),
    "max_tool_calls": ((int, _NONE), None),
    "store": ((bool,), True),
    "background": ((bool,), False),
    "metadata": ((dict,), {}),
    "safety_identifier": ((str, _NONE), None),
    "prompt_cache_key": ((str, _NONE), None),
}
# Members that are neither the backend's nor the request's: the default when absent.
_FIXED: dict[str, Any] = {
    "object": "response",
    "output": [],
    "error": None,
    "incomplete_details": None,
    "usage": None,
    "service_tier": "default",
}
# Every member a Response requires (but `id` and `status`, which only the backend can
# give), in the schema's order, with the types its value may have.
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (str,),
    "created_at": (int,),
    "completed_at": (int, _NONE),
    "incomplete_details": (dict, _NONE),
    "model": (str,),
    "previous_response_id": (str, _NONE),
    "instructions": _ECHOED["instructions"][0],
    "output": (list,),
    "error": (dict, _NONE),
    "tools": (list,),
    "tool_choice": _ECHOED["tool_choice"][0],
    "truncation": _ECHOED["truncation"][0],
    "parallel_tool_calls": _ECHOED["parallel_tool_calls"][0],
    "text": (dict,),
    "top_p": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "top_logprobs": (int,),
    "temperature": _NUMBER,
    "reasoning": (dict, _NONE),
    "usage": (dict, _NONE),
    "max_output_tokens": _ECHOED["max_output_tokens"][0],
    "max_tool_calls": _ECHOED["max_tool_calls"][0],
    "store": (bool,),
    "background": (bool,),
    "service_tier": (str,),
    "metadata": (dict,),
    "safety_identifier": (str, _NONE),
    "prompt_cache_key": (str, _NONE),
}
_COMPLETED_AT = frozenset(("completed_at",))
_RULED = frozenset(("object", "completed_at", "model", "usage", "text", "reasoning", "tools"))
_STATIC_DEFAULTS = {**_FIXED, **{name: default for name, (_, default) in _ECHOED.items()}}
_NAMES = tuple(_TYPES)
_REQUIRED = frozenset(_NAMES)
_NO_MEMBERS: dict[str, Any] = {}
_PLANS_KEPT = 64
_REASONING = {"effort": None, "summary": None}
# The members echoed from the request that a stateless backend answers null for.
_NULLS = {
    name: re.compile(rb'"' + name.encode() + rb'"\s*:\s*null')
    for name in ("previous_response_id", "conversation")
}
_RESPONSE = re.compile(rb'"response"\s*:\s*\{')
_OBJECT = re.compile(rb"\s*\{")
_CLOSE = re.compile(rb"\s*\}")


class _Plan:
    """For a Response with these members: the required ones it lacks (completed_at
    apart: its value depends on the Response) and those it has."""

    __slots__ = (
        "completed_at",
        "fast",
        "given",
        "missing",
        "names",
        "places",
        "present",
        "ruled",
        "stamped",
        "usage",
        "valid",
    )

    def __init__(self, keys: tuple[str, ...]) -> None:
        missing = _REQUIRED.difference(keys)
        self.completed_at = "completed_at" in missing
        self.missing = missing - _COMPLETED_AT
        self.present = tuple(name for name in _NAMES if name not in missing)
        # Those whose values have rules their types do not say (Envelope._check_given)
        self.given = _RULED.intersection(self.present)
        # A JSON answer's values of those that do not change turn to turn (but usage's),
        # and the last ones seen valid: the same again are valid again.
        self.usage = "usage" in self.given
        # A completed_at the backend gives changes turn to turn: only a null one of a
        # completed Response is replaced (Envelope._check_given).
        self.stamped = "completed_at" in self.given
        same = sorted(self.given - {"usage", "completed_at"})
        self.names = tuple(same)
        self.ruled = operator.itemgetter(*same) if same else None
        self.valid: Any = _MISSING
        # What the compiled `answer` reads of it, once the values are known: (missing,
        # completed_at, then where in `keys` usage is (-1: not given), the ruled values,
        # their values seen valid, where the output and the status are); None: not yet.
        at = {name: index for index, name in enumerate(keys)}
        self.places = (
            at["usage"] if self.usage else -1,
            tuple(at[name] for name in same),
            at.get("output", -1),
            at.get("status", -1),
            at["completed_at"] if self.stamped else -1,
        )
        self.fast: tuple[Any, ...] | None = None
        if not same:
            self.fast = self._fast(())

    def _fast(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        usage, names, output, status, stamped = self.places
        return self.missing, self.completed_at, usage, names, values, output, status, stamped

    def seen_valid(self, response: dict[str, Any]) -> None:
        """The ruled values of `response`, a valid answer: those of the next answers that
        are the same are valid too."""
        assert self.ruled is not None
        self.valid = valid = self.ruled(response)
        self.fast = self._fast(valid if len(self.names) > 1 else (valid,))


_PLANS: dict[tuple[str, ...], _Plan] = {}


class _Kept:
    """What the Envelope's methods read, kept past a request: the last valid answer's
    shape and plan, the last request's fills, the pending shapes by name, and the
    constants they are read with. Compiled, it is `_speedups.kept`, a C struct the
    methods of EnvelopeState read at fixed offsets (a module's globals: a dict lookup
    each), and those methods are the Envelope's (without a Python frame)."""

    __slots__ = ("from_request", "last_answer", "last_fills", "lasts", "layouts", "patch")

    # The members and their types of the last JSON answer of a shape seen valid, its plan.
    last_answer: tuple[tuple[str, ...], tuple[type, ...], _Plan | None]
    # The last request's fills: their key, and the dict of them (`_shared_family`).
    last_fills: tuple[tuple[Any, ...], dict[frozenset[str], _Fill]]
    # The shape each event name was last seen in (`_remember_last`).
    lasts: dict[str | None, tuple[bytes, int, bytes, int, bytes, int, int, _Seen]]
    from_request: frozenset[str]  # _FROM_REQUEST
    patch: type[Patch]
    layouts: dict[str, tuple[bytes, int, bytes]]  # _TERMINAL_LAYOUTS


_KEPT: _Kept = _Kept() if SPEEDUPS is None else SPEEDUPS.kept
_KEPT.last_answer = ((), (), None)
# The plan of each shape seen valid (its members, in order, and their values' types): a
# backend answers in one shape turn after turn, so one lookup finds it.
_VALID: dict[tuple[tuple[str, ...], tuple[type, ...]], _Plan] = {}


class _Fill:
    """The members a Response lacking `missing` is filled with, for every request that
    gives the same values for them: `members` (shared by every such turn's Responses:
    never changed) and their bytes; `created_at` and `previous_response_id`, which
    differ from turn to turn, are each Envelope's own (`created_at`, `previous`: they
    are missing too)."""

    __slots__ = ("created_at", "encoded", "fast", "members", "pending", "previous")

    def __init__(self, envelope: Envelope, missing: frozenset[str]) -> None:
        defaults = envelope._request_defaults()
        shared = missing - _PER_TURN
        self.members = {name: defaults[name] for name in _NAMES if name in shared}
        self.encoded = orjson.dumps(self.members)[1:-1]
        self.created_at = "created_at" in missing
        self.previous = "previous_response_id" in missing
        self.fast = self.created_at, self.previous, self.encoded, self.members  # (_c.answer)
        # What a pending event of a seen shape gets of them (`Envelope._members_as_seen`):
        # whether it lacks completed_at too, and the bytes, built once for every such turn.
        self.pending: tuple[bool, bytes] | None = None


class ServedModels(tuple[str, ...]):
    """The names the proxy serves its models under (what `served_models` is), with the
    values its backend samples a request that sets none of them with, when they are not
    OpenAI's defaults (`sampling`: the embedded llama.cpp's `temperature` and `top_p`),
    which a Response then shows. Equal only to one with the same names and values: it is
    a part of the key of the fills they decide (`Envelope._shared_family`)."""

    sampling: dict[str, float]
    _hash: int

    def __new__(cls, names: tuple[str, ...], sampling: dict[str, float]) -> ServedModels:
        served = super().__new__(cls, names)
        served.sampling = dict(sampling)
        served._hash = hash((tuple(names), tuple(sorted(served.sampling.items()))))
        return served

    def __eq__(self, other: object) -> bool:
        return other is self or (
            type(other) is ServedModels
            and tuple.__eq__(self, other) is True
            and self.sampling == other.sampling
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return self._hash


_PREVIOUS = "previous_response_id"
_PER_TURN = frozenset(("created_at", _PREVIOUS))
# The request members a filled one can come from.
_FROM_REQUEST = frozenset((*_ECHOED, "tools", "text", "reasoning"))
# The _Fill of each set of missing members (a stream's pending events and its terminal
# one lack different sets), by what the request gives for them: one dict per such key.
_FILLS: dict[tuple[Any, ...], dict[frozenset[str], _Fill]] = {}
_KEPT.from_request = _FROM_REQUEST
_KEPT.last_fills = ((), {})
_FILLS_KEPT = 64
_INSTRUCTIONS = frozenset(("instructions",))


_STAMP = (0, b"")  # the last completed_at written into a JSON answer, and its bytes


def _stamp(now: int) -> bytes:
    global _STAMP
    _STAMP = now, b'"completed_at":%d' % now
    return _STAMP[1]


class _PatchState:
    """A Patch's members (compiled: _speedups.PatchState, a C struct with these defaults).
    They are the class's until set (a Patch is made for every Response: no __init__ to
    run); `inserted` and `ids` are replaced, never changed in place, as they are shared
    until then."""

    plan: _Plan | None = None
    filled: dict[str, Any] = _NO_MEMBERS
    encoded = b""
    inserted: dict[str, Any] = _NO_MEMBERS
    ids: tuple[str, ...] = ()
    rewrite = False
    items = False  # its output items need completing (`written`, after the turn is recorded)
    unmerged = False  # `filled` is not in the Response's dict yet (`merge`)
    # The bytes of the members filled from the request or the defaults, the very object
    # every turn with the same values for them shares (empty: none), where they are in
    # `encoded`, and where in the bytes the store keeps (-1: not known). The store keeps
    # them once for every such turn instead of in each turn's Response (Turn.fill).
    fill = b""
    fill_in = 0
    fill_at = -1
    # The Response's own members `answer` decided (created_at, previous_response_id,
    # completed_at) that its dict gets at `merge`, before `filled`: name, value, name, …
    # (one tuple, not one per member: made for every usual answer).
    own: tuple[Any, ...] = ()


class _EnvelopeState:
    """An Envelope's members (compiled: _speedups.EnvelopeState, a C struct made the same
    way without a Python __init__ to run)."""

    __slots__ = (
        "_body",
        "_created_at",
        "_defaults",
        "_echo",
        "_family",
        "_fills",
        "_inserts",
        "_members",
        "_pinned",
        "_served_models",
    )

    def __init__(
        self,
        body: dict[str, Any] | None = None,
        echo: tuple[str, Any] | None = None,
        served_models: tuple[str, ...] = (),
        members: bytes | None = None,
        *,
        created_at: int | None = None,
    ) -> None:
        # Built for each create request: only what it is given is kept here, the rest is
        # worked out when a Response needs it.
        self._body = body if body is not None else _NO_MEMBERS  # (never changed here)
        # The JSON object of `body`'s members but its input and the ids of what it
        # continues, as forwarded (expand.forwarded_members), when the proxy encoded it:
        # every member filled from the request is decided by it.
        self._members = members
        self._echo = echo  # ("previous_response_id", id) or ("conversation", {"id": …})
        self._served_models = served_models
        self._created_at = created_at  # (now, when first needed)
        self._pinned: dict[str, Any] | None = None  # members that win over the backend's
        self._defaults: dict[str, Any] | None = None  # built when a member is invalid
        # What each set of missing members is filled with (a backend leaves out the same
        # ones in each of a turn's Responses): its shared _Fill, the turn's bytes, and
        # those of its members that are the turn's own.
        self._fills: dict[frozenset[str], tuple[_Fill, bytes, dict[str, Any]]] | None = None
        # A pending event's members, by what decides them (_Seen.members).
        self._inserts: dict[tuple[Any, ...], tuple[bytes, ...]] | None = None
        # The _Fill of each set of missing members for what this request gives for them
        # (`_shared_fill`: found once per request).
        self._family: dict[frozenset[str], _Fill] | None = None


if TYPE_CHECKING or SPEEDUPS is None:
    _PatchBase = _PatchState
    _EnvelopeBase = _EnvelopeState
else:  # (their members in C: read there without a lookup)
    _PatchBase = SPEEDUPS.PatchState
    _EnvelopeBase = SPEEDUPS.EnvelopeState


class Patch(_PatchBase):
    """What `Envelope.complete` changed: members inserted (absent before: `filled`, the
    request's or default values shared by the turn's Responses, their bytes `encoded`
    once per turn, then a `completed_at` decided per Response; `inserted`, the few other
    members decided per Response), ids set where they were null, and whether anything
    else changed (then the object is re-encoded)."""

    __slots__ = ()

    def insert(self, name: str, value: Any) -> None:
        self.inserted = {**self.inserted, name: value}

    def merge(self, response: dict[str, Any]) -> None:
        """The filled members put into the dict of the Response `complete` was given
        with merge=False (a no-op after the first time)."""
        if self.unmerged:
            self.unmerged = False
            own = self.own
            if own:
                response.update(zip(own[::2], own[1::2], strict=True))
            response.update(self.filled)


class Envelope(_EnvelopeBase):
    """The members one create request's Responses are completed with (`_EnvelopeState`)."""

    __slots__ = ()

    @property
    def echo(self) -> tuple[str, Any] | None:
        return self._echo

    def pin(self, **members: Any) -> None:
        """Members every Response gets whatever the backend says: a background
        response's are the proxy's id and `background: true` (http/background.py)."""
        self._pinned = members
        self._inserts = None  # (what pending events got before: without them)

    def complete(self, response: dict[str, Any], *, final: bool, merge: bool = True) -> Patch:
        """Fill in the members of `response` (a Response object, changed in place), not
        its output items (`written` does those); `final`: it is the terminal one (its
        `completed_at` is now when the backend gave none). With `merge` False the
        members filled from the request or the defaults are only in the patch's bytes
        until `Patch.merge` (the ~20 of a stateless backend's answer: what a JSON answer
        whose dict is not read for them saves)."""
        patch = Patch()
        shape = tuple(response), tuple(map(type, response.values()))
        plan = patch.plan = _VALID.get(shape) or self._checked(response, shape, patch, final)
        encoded = b""
        if plan.missing:
            fill, encoded, per_turn = self._fill(plan.missing)
            patch.filled = fill.members
            if fill.encoded:  # (the last of the members: `_fill`)
                patch.fill = fill.encoded
                patch.fill_in = len(encoded) - len(fill.encoded)
            if merge or self._pinned is not None:
                response.update(fill.members)
            else:
                patch.unmerged = True
            if per_turn:
                response.update(per_turn)
        if plan.completed_at:  # (its bytes after the filled ones, as in a pending event)
            if final and response.get("status") == "completed":
                value = response["completed_at"] = int(time.time())
                stamp = b'"completed_at":%d' % value
            else:
                response["completed_at"] = None
                stamp = b'"completed_at":null'
            encoded = b"".join((encoded, b",", stamp)) if encoded else stamp
        patch.encoded = encoded
        if plan.given:
            self._check_given(response, patch, final, plan.given)
        if self._pinned is not None:
            for name, value in self._pinned.items():
                if response.get(name, _MISSING) != value:
                    self._replace(response, patch, name, value)
        if self._echo is not None:
            self._check_echo(response, patch)
        return patch

    def _answer(self, data: bytes, response: dict[str, Any]) -> tuple[bytes, Patch]:
        """A JSON answer's Response completed (`response`: `data` parsed): the bytes the
        store keeps, its output items as the backend gave them, and the patch (`items`:
        they need `written` once the turn is recorded). The members filled from the
        request or the defaults go into the dict only at `Patch.merge`, and so do its own
        (`Patch.own`) when nothing else is left to do with it. The usual answer,
        of the shape the last one was seen valid in, costs one comparison and one
        splice: its members go in before the closing brace, where no later search for
        its output passes over them (and, when nothing is left to do with them, the
        patch's `encoded` stays empty: they are copied once, into the answer's bytes)."""
        keys = tuple(response)
        types = tuple(map(type, response.values()))
        last = _KEPT.last_answer
        if keys == last[0] and types == last[1]:
            plan: _Plan | None = last[2]
        else:
            plan = _VALID.get((keys, types))
            if plan is not None:
                _KEPT.last_answer = keys, types, plan
        parts: list[bytes] | None = None  # the members' bytes, but from `complete`
        if plan is None or self._pinned is not None or not keys:
            patch = self.complete(response, final=True, merge=False)
        else:  # `complete`, for a shape seen valid
            patch = Patch()
            patch.plan = plan
            echo = self._echo
            parts = []
            own: list[tuple[str, Any]] = []  # (in the dict when more is done with it)
            if plan.missing:
                fill = self._shared_fill(plan.missing)
                if fill.created_at:
                    created_at = self._created()
                    own.append(("created_at", created_at))
                    parts.append(b'"created_at":%d' % created_at)
                if fill.previous:  # the echoed id, which the backend never saw
                    previous = echo[1] if echo is not None and echo[0] == _PREVIOUS else None
                    own.append((_PREVIOUS, previous))
                    parts.append(b'"previous_response_id":' + orjson.dumps(previous))
                    if previous is not None:
                        echo = None  # (echoed)
                if fill.encoded:
                    patch.fill = fill.encoded
                    patch.fill_in = sum(map(len, parts)) + len(parts)  # (after their commas)
                    parts.append(fill.encoded)
                    patch.filled = fill.members
                    patch.unmerged = True
            if plan.completed_at:
                if response.get("status") == "completed":
                    now = int(time.time())
                    own.append(("completed_at", now))
                    parts.append(_STAMP[1] if _STAMP[0] == now else _stamp(now))
                else:
                    own.append(("completed_at", None))
                    parts.append(b'"completed_at":null')
            if plan.given:
                ruled = plan.ruled  # the values seen valid last time are valid again
                if (
                    ruled is not None
                    and ruled(response) == plan.valid
                    and (
                        not self._served_models  # (else the model shown may be another)
                        or "model" not in plan.given
                        or response["model"] == self._shown_model()
                    )
                    and not (
                        plan.stamped
                        and response["completed_at"] is None
                        and response.get("status") == "completed"
                    )
                ):
                    if plan.usage and _usage_changed(response["usage"]):
                        patch.rewrite = True
                else:
                    self._check_given(response, patch, True, plan.given)
                    # (kept past the request: not a store:false one's tools or text; not
                    # a model of none, as the model shown for it is each request's)
                    if (
                        ruled is not None
                        and not (patch.rewrite or patch.inserted)
                        and self._body.get("store") is not False
                        and ("model" not in plan.given or response["model"])
                    ):
                        plan.seen_valid(response)
            if echo is not None:  # (checked in the dict, after them)
                response.update(own)
                own = []
                self._check_echo(response, patch)
        output = response.get("output")
        if output:
            patch.items = not all(map(_item_complete, output))
        if parts is not None:
            if patch.rewrite or patch.inserted or patch.ids or patch.items or data[-1:] != b"}":
                response.update(own)
                patch.encoded = b",".join(parts)  # (`spliced`, `written_event` read them)
            elif parts:  # the usual answer
                if own:
                    patch.own = tuple(chain.from_iterable(own))
                    patch.unmerged = True
                if patch.fill:
                    patch.fill_at = len(data) + patch.fill_in
                closing = parts.pop() + b"}"
                return b",".join((data[:-1], *parts, closing)), patch
            else:
                return data, patch
        if patch.rewrite or patch.inserted or patch.ids or data[-1:] != b"}" or not keys:
            return spliced(data, response, patch), patch
        if not patch.encoded:
            return data, patch
        if patch.fill:
            patch.fill_at = len(data) + patch.fill_in
        return b"".join((data[:-1], b",", patch.encoded, b"}")), patch

    def _terminal_event(
        self, event: Event, payload: dict[str, Any]
    ) -> tuple[Patch, tuple[bytes, bool] | None]:
        """A terminal event's Response completed as a JSON answer is (`answer`), in the
        event's bytes: its patch, and the Response's bytes the store keeps (its output
        items as the backend gave them) with whether the event is written with them
        (changed in place: its items need nothing more, else `written_event` completes
        them once the turn is recorded). None for the bytes when the Response is not found
        at once in the event's: then the patch is merged, and the store encodes the dict."""
        data = event.data
        response = payload["response"]
        span = _response_span(data, payload)
        if span is None:
            return self.complete(response, final=True), None
        start, end = span
        given = data[start:end]
        stored, patch = self.answer(given, response)
        if patch.items:
            return patch, (stored, False)
        if stored is not given:
            rewrite(event, b"".join((data[:start], stored, data[end:])))
        return patch, (stored, True)

    def _checked(
        self,
        response: dict[str, Any],
        shape: tuple[tuple[str, ...], tuple[type, ...]],
        patch: Patch,
        final: bool,
    ) -> _Plan:
        """The plan of a Response of a shape not seen valid before, its members of a
        type the schema does not allow replaced."""
        keys = shape[0]
        plan = _PLANS.get(keys)
        if plan is None:
            plan = _Plan(keys)
            if len(_PLANS) < _PLANS_KEPT:
                _PLANS[keys] = plan
        for name in plan.present:
            if type(response[name]) not in _TYPES[name]:
                response[name] = self._default(name, response, final)
                patch.rewrite = True
        if not patch.rewrite and len(_VALID) < _PLANS_KEPT:
            _VALID[shape] = plan
        return plan

    def _filled(self, missing: frozenset[str], patch: Patch) -> _Fill:
        """The members `missing` is filled with, set in `patch` with their bytes."""
        fill, patch.encoded, _ = self._fill(missing)
        patch.filled = fill.members
        return fill

    def _fill(self, missing: frozenset[str]) -> tuple[_Fill, bytes, dict[str, Any]]:
        """The members `missing` is filled with, the turn's bytes of them, and those of
        them that are the turn's own (`created_at`, `previous_response_id`)."""
        fills = self._fills
        done = fills.get(missing) if fills is not None else None
        if done is None:
            fill = self._shared_fill(missing)
            parts: list[bytes] = []
            per_turn: dict[str, Any] = _NO_MEMBERS
            if fill.created_at or fill.previous:
                per_turn = {}
                if fill.created_at:
                    per_turn["created_at"] = created_at = self._created()
                    parts.append(b'"created_at":%d' % created_at)
                if fill.previous:
                    per_turn["previous_response_id"] = previous = self._previous()
                    parts.append(b'"previous_response_id":' + orjson.dumps(previous))
            if fill.encoded:
                parts.append(fill.encoded)
            done = fill, b",".join(parts), per_turn
            if fills is None:
                self._fills = {missing: done}
            else:
                fills[missing] = done
        return done

    def _shared_fill(self, missing: frozenset[str]) -> _Fill:
        """The _Fill of `missing` for this request: one built for an earlier request with
        the same values for what it fills in, else a new one."""
        family = self._family
        if family is None:
            family = self._shared_family()
        fill = family.get(missing)
        if fill is None:
            if len(family) >= _FILLS_KEPT:
                family.clear()
            fill = family[missing] = _Fill(self, missing)
        return fill

    def _shared_family(self) -> dict[frozenset[str], _Fill]:
        """The request's fills (one per set of missing members), shared by every request
        with the same values for what they fill in: found once per request, by a key
        compared with the last request's before it is hashed; a store:false request's are
        its own, not kept past it."""
        body = self._body
        key: tuple[Any, ...] | None = None
        if _FROM_REQUEST.isdisjoint(body):
            model = body.get("model")  # (the model shown depends on it, and served_models)
            key = (self._served_models, model if type(model) is str else None)
        elif body.get("store") is False:  # (its instructions, tools: not kept past it)
            key = None
        elif self._members is not None:
            # A coding agent sends tens of KB of instructions and tools on every turn:
            # the bytes they were forwarded as are compared (a memcmp), not encoded
            # again. (The model is in them; a key of the request's values ends in an
            # array's bytes.)
            key = (self._served_models, None, None, self._members)
        else:
            # (a str `instructions` is compared as it is instead of encoded)
            model = body.get("model")
            instructions = body.get("instructions")
            names = _FROM_REQUEST.intersection(body)
            if type(instructions) is str:
                names = names - _INSTRUCTIONS
            else:
                instructions = None
            try:
                encoded = orjson.dumps([[name, body[name]] for name in sorted(names)])
            except orjson.JSONEncodeError:  # (not from JSON): its own
                key = None
            else:
                shown = model if type(model) is str else None
                key = (self._served_models, shown, instructions, encoded)
        family: dict[frozenset[str], _Fill] | None
        if key is None:
            family = {}
        elif key == _KEPT.last_fills[0]:
            family = _KEPT.last_fills[1]
        else:
            family = _FILLS.get(key)
            if family is None:
                if len(_FILLS) >= _FILLS_KEPT:
                    _FILLS.clear()
                family = _FILLS[key] = {}
            _KEPT.last_fills = key, family
        self._family = family
        return family

    def _previous(self) -> str | None:
        echo = self._echo
        return echo[1] if echo is not None and echo[0] == "previous_response_id" else None

    def _created(self) -> int:
        """The turn's `created_at`, for a Response that gives none."""
        created_at = self._created_at
        if created_at is None:
            created_at = self._created_at = int(time.time())
        return created_at

    def _shown_model(self, model: str | None = None) -> str:
        """The model a Response names, `model` the backend's (none: one filled in here):
        with --served-model-name, the one the request asked for when it is one of them,
        else the first (never the backend's, which may be a path); without, the
        backend's own, else the request's."""
        served = self._served_models
        if not served and model:
            return model
        requested = self._body.get("model")
        if served:
            return requested if requested in served else served[0]
        return requested if type(requested) is str else ""

    def _check_given(
        self, response: dict[str, Any], patch: Patch, final: bool, given: frozenset[str]
    ) -> None:
        """What a member's type does not say: the rest of the schema's rules, for the
        members the backend gave (`given`: one filled in keeps them already)."""
        if "object" in given and response["object"] != "response":
            self._replace(response, patch, "object", "response")
        if (
            final
            and "completed_at" in given
            and response["completed_at"] is None
            and response.get("status") == "completed"
        ):
            self._replace(response, patch, "completed_at", int(time.time()))
        if "model" in given:
            model = response["model"]
            if self._served_models or not model:  # (else the backend's is shown)
                shown = self._shown_model(model)
                if model != shown:
                    self._replace(response, patch, "model", shown)
        if "usage" in given and _usage_changed(response["usage"]):
            patch.rewrite = True
        if "text" in given and type(response["text"].get("format")) is not dict:
            self._replace(response, patch, "text", _text(self._body.get("text")))
        if "reasoning" in given:
            reasoning = response["reasoning"]
            if reasoning is not None and ("effort" not in reasoning or "summary" not in reasoning):
                self._replace(response, patch, "reasoning", {**_REASONING, **reasoning})
        if "tools" in given:
            tools = response["tools"]
            if tools and _incomplete_tools(tools):
                # A copy: the list may be the request's own (a Response the proxy builds).
                self._replace(response, patch, "tools", _tools(tools))

    def _check_echo(self, response: dict[str, Any], patch: Patch) -> None:
        """The echoed `previous_response_id` or `conversation`, which the backend never
        saw: inserted when absent, set when null."""
        assert self._echo is not None
        name, value = self._echo
        given = response.get(name, _MISSING)
        if given is _MISSING:
            patch.insert(name, value)
            response[name] = value
        elif given is None:
            patch.ids += (name,)
            response[name] = value

    @staticmethod
    def _replace(response: dict[str, Any], patch: Patch, name: str, value: Any) -> None:
        if name in patch.inserted:
            patch.insert(name, value)
        else:  # (a filled member's value is shared by the turn's Responses: not changed)
            patch.rewrite = True
        response[name] = value

    def _default(self, name: str, response: dict[str, Any], final: bool) -> Any:
        """The value of a member the backend gave none (valid) for."""
        if name == "completed_at":
            return int(time.time()) if final and response.get("status") == "completed" else None
        if self._defaults is None:
            self._defaults = self._request_defaults()
        return self._defaults[name]

    def _request_defaults(self) -> dict[str, Any]:
        """Every member's value from the request, else the backend's default where the
        proxy knows it (`ServedModels.sampling`), else OpenAI's documented one."""
        body = self._body
        served = self._served_models
        defaults = {
            **_STATIC_DEFAULTS,
            **(served.sampling if type(served) is ServedModels else _NO_MEMBERS),
            "output": [],
            "metadata": {},
            "created_at": self._created(),
            "model": self._shown_model(),
            "previous_response_id": self._previous(),
            "tools": _tools(body.get("tools")),
            "text": _text(body.get("text")),
            "reasoning": _reasoning(body.get("reasoning")),
        }
        for name in _ECHOED.keys() & body.keys():
            value = body[name]
            if type(value) in _ECHOED[name][0]:
                defaults[name] = value
        return defaults

    def json(self, data: bytes, response: dict[str, Any]) -> bytes:
        """A Response's JSON bytes completed: `response` is `data` parsed (and is
        completed in place)."""
        stored, patch = self.answer(data, response)
        return written(stored, response, merged=patch) if patch.items else stored

    def _pending_event(self, event: Event) -> Event:
        """A lifecycle event before the terminal one (`response.created`, …), completed
        without decoding it when one of the same shape was completed before: the same
        bytes but for the Response's `id` and `created_at` need the same members. The
        event is changed in place when its members are spliced into its bytes."""
        data = event.data
        seen: _Seen | None = None
        last = _KEPT.lasts.get(event.name)  # the shape its name came in last
        if last is not None:
            # Its shape, checked inline (a call costs as much as the check): the bytes
            # around the id's value and created_at's digits are those it came in last.
            # (The id ends at the first quote: were it an escaped one, the unescaped
            # quotes of `middle`, `"created_at"`'s at least, would leave it invalid JSON.)
            prefix, n, middle, digits, suffix, cut, at, last_seen = last
            end = data.find(b'"', n)
            digits += end
            if (
                data[:n] == prefix
                and data[end:digits] == middle
                and data[cut:] == suffix
                and data[digits:cut].isdigit()
            ):
                inserts = self._inserts
                members = inserts.get(last_seen.members) if inserts is not None else None
                if members is None:
                    members = self._members_as_seen(last_seen)
                if members and event.at >= 0:  # the usual event: its raw bytes end in data
                    own, shared, last_own = members
                    rewrite(event, b"".join((data[:at], own, shared, last_own, data[at:])))
                    return event
                seen = last_seen
        key: bytes | None = None
        if seen is None:
            key = _shape_key(data)
            seen = _PENDING.get(key) if key is not None else None
            if seen is not None:
                _remember_last(data, event.name, seen)
        if seen is not None and self._pinned is None:
            done = self._as_seen(event, seen)
            if done is not None:
                return done
        payload = loads_or_none(event.data)
        response = payload.get("response") if type(payload) is dict else None
        if type(response) is not dict:
            return event
        model = response.get("model")
        nulls = frozenset(name for name in _NULLS if response.get(name, _MISSING) is None)
        absent = "conversation" not in response
        patch = self.complete(response, final=False)
        done = written_event(event, payload, patch)
        # A shape is kept past the request (its key is the event's bytes): not a store:false
        # one's, whose event may echo its instructions, tools or metadata.
        if key is not None and not patch.rewrite and self._body.get("store") is not False:
            if len(_PENDING) >= _PENDING_KEPT:
                _PENDING.clear()
            model = model if type(model) is str else None
            seen = _Seen(patch.plan, model, nulls, absent, _insertion(event.data))
            _PENDING[key] = seen
            _remember_last(event.data, event.name, seen)
        return done

    def _as_seen(self, event: Event, seen: _Seen) -> Event | None:
        """A pending event of a seen shape completed from what the first one took (None:
        it must be decoded)."""
        if seen.plan is None or self._rewrites_model(seen):
            return None
        members = self._members_as_seen(seen)
        if members:
            data = event.data
            at = seen.at
            return with_data(event, b"".join((data[:at], *members, data[at:])))
        return self._as_seen_patched(event, seen)

    def _rewrites_model(self, seen: _Seen) -> bool:
        """Whether the model a seen pending event named is not the one shown."""
        model = seen.model
        return bool(self._served_models or model == "") and self._shown_model(model) != model

    def _members_as_seen(self, seen: _Seen) -> tuple[bytes, ...]:
        """The bytes of the members a pending event of a seen shape gets, each followed by
        a comma, in three parts: the turn's own (`created_at`, `previous_response_id`),
        those every turn of the same fill shares (built once for them all: a coding
        agent's instructions are not copied once more per turn), and the echoed
        `conversation`. Worked out once per turn (empty: they are not all inserted at one
        place: an echoed member is null in it, the model shown is not its own, or the
        Envelope pins members)."""
        if self._inserts is None:
            self._inserts = {}
        members: tuple[bytes, ...] = ()
        echo = self._echo
        plan = seen.plan
        if (
            seen.at
            and plan is not None
            and self._pinned is None
            and (echo is None or echo[0] not in seen.nulls)
            and not ((self._served_models or seen.model == "") and self._rewrites_model(seen))
        ):
            own = shared = last = b""  # (as _fill orders them, without its bookkeeping)
            created = previous = False
            if plan.missing:
                fill = self._shared_fill(plan.missing)
                created, previous = fill.created_at, fill.previous
                if created:
                    own = b'"created_at":%d,' % self._created()
                if previous:
                    given = echo[1] if echo is not None and echo[0] == _PREVIOUS else None
                    own += b'"previous_response_id":%s,' % orjson.dumps(given)
                done = fill.pending
                if done is not None and done[0] is plan.completed_at:
                    shared = done[1]
                else:
                    shared = fill.encoded + b"," if fill.encoded else b""
                    if plan.completed_at:
                        shared += b'"completed_at":null,'
                    fill.pending = plan.completed_at, shared
            elif plan.completed_at:
                shared = b'"completed_at":null,'
            if echo is not None and echo[0] == "conversation" and seen.no_conversation:
                last = b'"conversation":%s,' % orjson.dumps(echo[1])
            if own or shared or last:
                members = own, shared, last
                # What decides them but the turn's own values, kept for the next request
                # with the same (`_c.pending_event` reads it): the request's fills, the
                # very family every request with the same values for them shares (a kept
                # one: not a store:false request's, not kept past it).
                family = self._family
                if family is not None and family is _KEPT.last_fills[1]:
                    name = echo[0] if echo is not None else None
                    conversation = bool(last)
                    seen.memo = (family, name, created, previous, shared, conversation)
        self._inserts[seen.members] = members
        return members

    def _as_seen_patched(self, event: Event, seen: _Seen) -> Event | None:
        plan = seen.plan
        assert plan is not None
        patch = Patch()
        if plan.completed_at:
            patch.insert("completed_at", None)
        if plan.missing:
            self._filled(plan.missing, patch)
        values: dict[str, Any] = {}
        if self._echo is not None:
            name, value = self._echo
            values[name] = value
            if name in seen.nulls:
                patch.ids += (name,)
            elif name == "conversation" and seen.no_conversation:
                patch.insert(name, value)
        data = _apply(event.data, values, patch, _response_start, None)
        return with_data(event, data) if data else None

    def event(self, event: Event, payload: dict[str, Any], *, final: bool) -> Event:
        """A lifecycle event (`response.created`, …, `response.completed`) with its
        Response completed: `payload` is its data parsed (and is completed in place)."""
        response = payload.get("response")
        if type(response) is not dict:
            return event
        return written_event(event, payload, self.complete(response, final=final))

    if TYPE_CHECKING or SPEEDUPS is None:  # (else EnvelopeState's, which fall back to these)
        answer = _answer
        terminal_event = _terminal_event
        pending_event = _pending_event


_KEPT.patch = Patch
if SPEEDUPS is not None:  # (a create request's Envelope, made without an argument tuple)
    SPEEDUPS.vectorcall(Envelope)


class _Seen:
    """What completing a pending event of one shape took: its plan, the backend's model
    (None: it gave none), the echoed members it gave as null, whether it had no
    `conversation` member (then one is inserted), and where in its bytes members are
    inserted (0: not at one place for every event of the shape). `members`: what decides
    the members such an event gets (`created` and `in_progress` ones share them)."""

    __slots__ = ("at", "members", "memo", "model", "no_conversation", "nulls", "plan")

    def __init__(
        self,
        plan: _Plan | None,
        model: str | None,
        nulls: frozenset[str],
        no_conversation: bool,
        at: int,
    ) -> None:
        self.plan = plan
        self.model = model
        self.nulls = nulls
        self.no_conversation = no_conversation
        self.at = at
        self.members = (plan, nulls, no_conversation, model)
        # The members the last request with these fills (`Envelope._family`) gave such an
        # event (`Envelope._members_as_seen`): every such request gives the same.
        self.memo: tuple[Any, ...] | None = None


def _insertion(data: bytes) -> int:
    """Where members go into a pending event's Response: after its opening brace, when
    the id and created_at, which differ from one event of the shape to the next, come
    after that (else 0)."""
    match = _RESPONSE.search(data)
    if match is None or _CLOSE.match(data, match.end()) is not None:
        return 0
    at = match.end()
    created_at = data.find(_CREATED_AT)
    return at if at <= data.find(_ID) and (created_at < 0 or at <= created_at) else 0


_PENDING: dict[bytes, _Seen] = {}
_PENDING_KEPT = 64
_ID = b'"id":"'
_CREATED_AT = b'"created_at":'
_DIGITS = re.compile(rb"\d+")


def _shape_key(data: bytes) -> bytes | None:
    """`data` without the values of its first `id` and `created_at` members (a plain
    string, an integer), or None when it has no such id."""
    start = data.find(_ID) + len(_ID)
    if start < len(_ID):
        return None
    end = data.find(b'"', start)
    if end < 0 or data.find(b"\\", start, end) >= 0:
        return None
    key = data[:start] + data[end:]
    at = key.find(_CREATED_AT) + len(_CREATED_AT)
    if at >= len(_CREATED_AT):
        digits = _DIGITS.match(key, at)
        if digits is not None:
            key = key[:at] + key[digits.end() :]
    return key


# The shape each event name was last seen in: the bytes before the id's value (and their
# length), those between it and created_at's digits (and their length), those after the
# digits (and where they start, from the end), where members go in, and its _Seen. An
# event is matched against it without building its shape key.
_KEPT.lasts = {}


def _remember_last(data: bytes, name: str | None, seen: _Seen) -> None:
    start = data.find(_ID) + len(_ID)
    end = data.find(b'"', start) if start >= len(_ID) else -1
    if end < 0 or data.find(b"\\", start, end) >= 0:
        return
    at = data.find(_CREATED_AT, end) + len(_CREATED_AT)
    digits = _DIGITS.match(data, at) if at >= len(_CREATED_AT) else None
    if digits is not None and digits.end() < len(data):
        lasts = _KEPT.lasts
        if len(lasts) >= _PENDING_KEPT:
            lasts.clear()
        suffix = data[digits.end() :]
        lasts[name] = (
            data[:start],
            start,
            data[end:at],
            at - end,
            suffix,
            -len(suffix),
            seen.at,
            seen,
        )


def spliced(data: bytes, response: dict[str, Any], patch: Patch) -> bytes:
    """The JSON bytes of a Response that `complete` patched, its output items as the
    backend gave them: what the store keeps (the next turn's input is the bytes the
    backend itself produced); `written` after that gives the client's."""
    if not (patch.rewrite or patch.inserted or patch.ids) and data[:1] == b"{":
        members = patch.encoded  # the usual case: the members go in after the brace
        if not members:
            return data
        if data[1:2] != b"}":
            if patch.fill:
                patch.fill_at = 1 + patch.fill_in
            return b"".join((b"{", members, b",", data[1:]))
    return _apply(data, response, patch, _object_start, response)


def written(
    data: bytes,
    response: dict[str, Any],
    patch: Patch | None = None,
    *,
    merged: Patch | None = None,
) -> bytes:
    """The JSON bytes of a Response that `complete` patched (None: `data` are those
    `spliced` gave, `merged` its patch), its output items completed too. The turn is
    recorded in between, so the store keeps the items as the backend gave them: the
    next turn's input is the bytes the backend itself produced."""
    output = response.get("output")
    if output and complete_items(output):
        for unmerged in (patch, merged):
            if unmerged is not None:
                unmerged.merge(response)
        return orjson.dumps(response)
    return data if patch is None else _apply(data, response, patch, _object_start, response)


def _response_span(data: bytes, payload: dict[str, Any]) -> tuple[int, int] | None:
    """Where the Response of an event's data begins and ends, when the event has only
    `type`, `response` and `sequence_number`, in one of the two orders backends write
    them in, without spaces around the Response (None: it is not found at once)."""
    kind = payload.get("type")
    layout = _TERMINAL_LAYOUTS.get(kind) if type(kind) is str else None
    seq = payload.get("sequence_number")
    if layout is None or type(seq) is not int or len(payload) != 3:
        return None
    head, start, sdk_tail = layout
    if data[:start] == head:
        tail = b',"sequence_number":%d}' % seq
    elif data[:12] == b'{"response":':  # (the SDK's models' order)
        start = 12
        tail = sdk_tail % seq
    else:
        return None
    end = len(data) - len(tail)
    if end - start < 3 or data[end:] != tail or data[start] != 0x7B or data[end - 1] != 0x7D:
        return None  # ({} has no member to put one after: left to the general path)
    return start, end


# By terminal event type: the bytes its data begins with up to its Response (type first),
# their length, and the end of its data after the Response in the SDK's order.
_TERMINAL_LAYOUTS = {
    kind: (
        b'{"type":"%s","response":' % kind.encode(),
        len(b'{"type":"%s","response":' % kind.encode()),
        b',"sequence_number":%%d,"type":"%s"}' % kind.encode(),
    )
    for kind in TERMINAL_EVENTS
}
_KEPT.layouts = _TERMINAL_LAYOUTS


def written_event(event: Event, payload: dict[str, Any], patch: Patch) -> Event:
    """`written` for an event that carries the Response under `response`."""
    response = payload["response"]
    if complete_items(response.get("output") or []):
        patch.rewrite = True
    data = _apply(event.data, response, patch, _response_start, payload)
    if data is event.data:  # (nothing to write)
        return event
    if not event.name:
        kind = payload.get("type")
        return Event(encode_event(kind if isinstance(kind, str) else None, data), None, data)
    return with_data(event, data)


def complete_response(response: dict[str, Any], request: dict[str, Any] | None = None) -> None:
    """A Response object the proxy builds itself, completed in place from the request
    it answers (None: the documented defaults)."""
    Envelope(request).complete(response, final=response.get("status") != "in_progress")
    complete_items(response.get("output") or [])


def complete_stored(data: bytes) -> bytes:
    """A stored Response's bytes, complete (one stored before its envelope was)."""
    try:
        response = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if type(response) is not dict:
        return data
    return Envelope().json(data, response)


def complete_items(items: list[Any]) -> bool:
    """Output items as the schema wants them (in place); whether any changed."""
    changed = False
    for item in items:
        if type(item) is dict and not _item_complete(item) and complete_item(item):
            changed = True
    return changed


def _item_complete(item: Any) -> bool:
    """The usual output item, checked at once: a message with its status whose parts are
    output texts with their annotations, or another item with its status."""
    try:  # (subscripts: cheaper than get; what lacks one is checked the long way)
        if "status" not in item or type(item) is not dict:
            return False
        kind: str = item["type"]
        if kind != "message":
            return kind != "reasoning"
        content = item["content"]
        if type(content) is not list:
            return False
        for part in content:
            if part["type"] != "output_text" or type(part["annotations"]) is not list:
                return False
        return True
    except (KeyError, TypeError):
        return False


def complete_item(item: dict[str, Any], status: str = "completed") -> bool:
    kind = item.get("type")
    changed = False
    if kind == "message":
        if "status" not in item:
            item["status"] = status
            changed = True
        content = item.get("content")
        if type(content) is list:
            for part in content:
                if type(part) is dict and complete_part(part):
                    changed = True
    elif kind in ("function_call", "function_call_output", "custom_tool_call"):
        if "status" not in item:
            item["status"] = status
            changed = True
    elif kind == "reasoning" and type(item.get("summary")) is not list:
        item["summary"] = []
        changed = True
    return changed


def complete_part(part: dict[str, Any]) -> bool:
    """An output text part with its `annotations` (in place). Its `logprobs` are left
    as the backend gave them: optional, and what a client sends back as input."""
    if part.get("type") != "output_text" or type(part.get("annotations")) is list:
        return False
    part["annotations"] = []
    return True


def _usage_changed(usage: Any) -> bool:
    """Whether `usage` was completed (in place): the usual one, checked at once, has
    every member the schema requires."""
    try:
        if usage is None or (
            type(usage["input_tokens"]) is int
            and type(usage["output_tokens"]) is int
            and type(usage["total_tokens"]) is int
            and type(usage["input_tokens_details"]["cached_tokens"]) is int
            and type(usage["output_tokens_details"]["reasoning_tokens"]) is int
        ):
            return False
    except (KeyError, TypeError):
        pass
    return _complete_usage(usage)


def _complete_usage(usage: Any) -> bool:
    if type(usage) is not dict:
        return False
    changed = False
    for name in ("input_tokens", "output_tokens"):
        if type(usage.get(name)) is not int:
            usage[name] = 0
            changed = True
    if type(usage.get("total_tokens")) is not int:
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        changed = True
    for name, inner in (
        ("input_tokens_details", "cached_tokens"),
        ("output_tokens_details", "reasoning_tokens"),
    ):
        details = usage.get(name)
        if type(details) is not dict:
            usage[name] = {inner: 0}
            changed = True
        elif type(details.get(inner)) is not int:
            details[inner] = 0
            changed = True
    return changed


_FUNCTION_MEMBERS = ("description", "parameters", "strict")


def _tools(given: Any) -> list[Any]:
    """A copy of the request's tools, function tools with the members a Response's
    `tools` requires (null when unsaid); the request's own are left as they are."""
    if type(given) is not list:
        return []
    return [_complete_tool(tool) if _incomplete_tool(tool) else tool for tool in given]


def _complete_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {**tool, **{name: None for name in _FUNCTION_MEMBERS if name not in tool}}


def _incomplete_tools(tools: list[Any]) -> bool:
    return any(map(_incomplete_tool, tools))


def _incomplete_tool(tool: Any) -> bool:
    return (
        type(tool) is dict
        and tool.get("type") == "function"
        and any(name not in tool for name in _FUNCTION_MEMBERS)
    )


def _text(given: Any) -> dict[str, Any]:
    if type(given) is dict and type(given.get("format")) is dict:
        return given
    if type(given) is dict:
        return {**given, "format": {"type": "text"}}
    return {"format": {"type": "text"}}


def _reasoning(given: Any) -> dict[str, Any]:
    if type(given) is dict:
        return {**_REASONING, **given}
    return dict(_REASONING)


def _apply(
    data: bytes,
    response: dict[str, Any],
    patch: Patch,
    start: Callable[[bytes], int],
    whole: Any,
) -> bytes:
    """`data` with the patch written into the bytes of the object that begins at
    `start(data)`; else `whole` encoded (None: b"")."""
    patch.merge(response)  # (it may be encoded whole)
    if patch.rewrite:
        return b"" if whole is None else orjson.dumps(whole)
    members = patch.encoded
    if patch.inserted:
        more = orjson.dumps(patch.inserted)[1:-1]
        members = members + b"," + more if members else more
    if not (members or patch.ids):
        return data
    for name in patch.ids:  # a JSON string cannot hold the key's unescaped quotes
        data, count = _NULLS[name].subn(_member(name, response[name]), data, count=1)
        if not count:
            return b"" if whole is None else orjson.dumps(whole)
    if members:
        at = start(data)
        if at < 0:
            return b"" if whole is None else orjson.dumps(whole)
        after = data[at : at + 1]
        if after == b"}" or (after != b'"' and _CLOSE.match(data, at) is not None):
            return b"".join((data[:at], members, data[at:]))
        return b"".join((data[:at], members, b",", data[at:]))
    return data


def _object_start(data: bytes) -> int:
    """Where the members of the JSON object `data` holds begin (-1: it holds none)."""
    if data[:1] == b"{":
        return 1
    match = _OBJECT.match(data)
    return -1 if match is None else match.end()


def _response_start(data: bytes) -> int:
    """Where the members of an event's `response` object begin (-1: it has none)."""
    at = data.find(b'"response":{')
    if at >= 0 and data.find(b'"response"', 0, at) < 0:  # (the first, with no spaces)
        return at + 12
    match = _RESPONSE.search(data)
    return -1 if match is None else match.end()


def _member(name: str, value: Any) -> Callable[[re.Match[bytes]], bytes]:
    member = b'"' + name.encode() + b'":' + orjson.dumps(value)
    return lambda _: member  # a function: no template escapes in the id
