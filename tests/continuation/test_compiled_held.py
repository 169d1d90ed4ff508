"""The compiled fast paths (ocxproxy/_speedups.c) hold what they read while Python code
runs: a comparison, or a method of the Envelope, can change the very dicts a value was
read from, and free it. Each case runs in an interpreter of its own with the debug
allocator (freed memory overwritten), where a value used after it was freed crashes, or
shows in whatever reused its memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ocxproxy.continuation import envelope as envelope_module

pytestmark = pytest.mark.skipif(envelope_module._c is None, reason="not built here")

ROOT = Path(envelope_module.__file__).parents[2]
PRELUDE = """
import orjson
from ocxproxy.continuation import envelope as E
from ocxproxy.continuation.envelope import Envelope, Patch, _Plan
from ocxproxy.upstream.sse import encode_event, framed, parse_event

class Clears:
    '''Equal to anything; comparing it empties `target` first.'''
    def __init__(self, target):
        self.target = target
    def __eq__(self, other):
        self.target.clear()
        return True
    def __hash__(self):
        return 0

class Collides:
    '''A key of a name's hash: a lookup of the name compares it, which runs `then`.'''
    def __init__(self, name, then):
        self.name, self.then = name, then
    def __hash__(self):
        return hash(self.name)
    def __eq__(self, other):
        self.then()
        return False

def plan(keys, missing=(), names=(), values=(), usage=None, output=None):
    made = _Plan(tuple(keys))
    places = tuple(list(keys).index(name) for name in names)
    usage_at, output_at = (-1 if n is None else list(keys).index(n) for n in (usage, output))
    made.fast = (frozenset(missing), False, usage_at, places, values, output_at, -1, -1)
    return made

def answer(response):
    last = (tuple(response), tuple(map(type, response.values())), plan(response, **ROLES))
    done = E._c.answer(Envelope(), b'{"a":1}', response, last, ((), {}), E._FROM_REQUEST, Patch)
    print(done if done is None else done[0].decode())

def pending(rid):
    '''A response.created event whose Response is `rid`, in the usual bytes.'''
    response = {"id": rid, "object": "response", "created_at": 1700000000, "output": []}
    data = orjson.dumps({"type": "response.created", "response": response})
    return parse_event(encode_event("response.created", data))

def seen_pending(body):
    '''A response.created shape seen (twice, so it is the usual one) for a request `body`.'''
    seen_by = Envelope(body)
    for n in range(2):
        seen_by._pending_event(pending(f"resp_{n}"))

ROLES = {"usage": "usage", "output": "output"}
MANY = {f"x{i}": i for i in range(10)}  # (a dict this large is freed to the allocator)
"""
CASES = {
    # A value the last valid answer's is compared with, freed by that comparison.
    "a ruled value": (
        """
response = {}
response["tools"] = [Clears(response), *("x" * 50)]
last = (("tools",), (list,), plan(["tools"], names=("tools",), values=([0, *("x" * 50)],)))
done = E._c.answer(Envelope(), b'{"tools":[]}', response, last, ((), {}), E._FROM_REQUEST, Patch)
print(done[0].decode())
""",
        '{"tools":[]}',
    ),
    # The request's model, freed by the comparison of the served models before it.
    "the request's model": (
        """
body = {"model": "".join(["mo", "del"])}
envelope = Envelope(body, None, (Clears(body),))
last = (("id",), (str,), plan(["id"], missing=["tools"]))
fills = ((("served",), "model"), {})
done = E._c.answer(envelope, b'{"id":"r"}', {"id": "r"}, last, fills, E._FROM_REQUEST, Patch)
print(done[0].decode())
""",
        '{"id":"r","tools":[]}',
    ),
    # The request's body, read for the model shown with served model names, freed by
    # the comparison a lookup of its model makes.
    "the request's body, for the model shown": (
        """
replace = lambda: setattr(envelope, "_body", {})
envelope = Envelope({Collides("model", replace): 1, **MANY}, None, ("bench",))
last = (("model",), (str,), plan(["model"], names=("model",), values=("bench",)))
done = E._c.answer(envelope, b'{"model":"bench"}', {"model": "bench"}, last, ((), {}),
                   E._FROM_REQUEST, Patch)
print(done[0].decode(), envelope._body)
""",
        '{"model":"bench"} {}',
    ),
    # A key of the request's body that takes itself out of it when hashed: the Python
    # path (`_FROM_REQUEST.isdisjoint`) sees the dict change size.
    "a key of the request": (
        """
body = {}
class Key:
    def __hash__(self):
        body.clear()
        return hash("tools")
    def __eq__(self, other):
        return False
body[Key()] = 1
last = (("id",), (str,), plan(["id"], missing=["tools"]))
try:
    E._c.answer(Envelope(body), b'{"id":"r"}', {"id": "r"}, last, (((), None), {}),
                E._FROM_REQUEST, Patch)
except RuntimeError as error:
    print(type(error).__name__)
""",
        "RuntimeError",
    ),
    # A terminal event's Response, taken out of its payload by the Envelope's method.
    "a terminal event's Response": (
        """
payload = {}
class Taking(Envelope):
    __slots__ = ()
    def _shared_fill(self, missing):
        payload.clear()
        return super()._shared_fill(missing)
members = {"id": "r1", "status": "in_progress", **{f"m{i}": i for i in range(10)}}
data = orjson.dumps({"type": "response.completed", "response": members, "sequence_number": 1})
event = parse_event(encode_event("response.completed", data))
payload.update(orjson.loads(data))
last = (tuple(members), tuple(map(type, members.values())), plan(members, ["created_at"]))
done = E._c.terminal_event(Taking({}, created_at=5), event, payload, last, ((), {}),
                           E._FROM_REQUEST, Patch, E._TERMINAL_LAYOUTS)
print(done[1][0].decode()[-16:])
print(*sorted({type(key).__name__ for family in E._FILLS.values() for key in family}))
""",
        ',"created_at":5} frozenset',
    ),
    # A terminal event's layout (its bytes around the Response), freed by a read of the
    # event's attributes (an Event whose `at` is a property: its bytes are still slots).
    "a terminal event's layout": (
        """
from ocxproxy.upstream.sse import Event
layouts = {kind: tuple(bytes(bytearray(part)) if type(part) is bytes else part for part in layout)
           for kind, layout in E._TERMINAL_LAYOUTS.items()}  # (only these dicts hold them)
class Clearing(Event):
    __slots__ = ("_at",)
    @property
    def at(self):
        layouts.clear()
        return self._at
    @at.setter
    def at(self, value):
        self._at = value
members = {"id": "r1", "status": "in_progress", **{f"m{i}": i for i in range(10)}}
data = orjson.dumps({"type": "response.completed", "response": members, "sequence_number": 1})
plain = parse_event(encode_event("response.completed", data))
event = Clearing(plain.raw, plain.name, plain.data, plain.at)
last = (tuple(members), tuple(map(type, members.values())), plan(members, ["created_at"]))
done = E._c.terminal_event(Envelope({}, created_at=5), event, orjson.loads(data), last,
                           ((), {}), E._FROM_REQUEST, Patch, layouts)
print(done[1][0].decode()[-16:])
""",
        ',"created_at":5}',
    ),
    # A terminal event's Response, type and number, freed by the comparison a lookup of
    # its layout makes (layouts with another key of the type's hash).
    "a terminal event's payload": (
        """
members = {"id": "r1", "status": "in_progress", **{f"m{i}": i for i in range(10)}}
data = orjson.dumps({"type": "response.completed", "response": members, "sequence_number": 1})
event = parse_event(encode_event("response.completed", data))
payload = orjson.loads(data)
armed = []  # (not while the dict is built: its keys are compared then)
clear = lambda: armed and payload.clear()
layouts = {Collides("response.completed", clear): None, **E._TERMINAL_LAYOUTS}
armed.append(True)
last = (tuple(members), tuple(map(type, members.values())), plan(members, ["created_at"]))
done = E._c.terminal_event(Envelope({}, created_at=5), event, payload, last,
                           ((), {}), E._FROM_REQUEST, Patch, layouts)
print(done[1][0].decode()[-16:], payload)
""",
        ',"created_at":5} {}',
    ),
    # A pending event's shape and bytes, forgotten and replaced by the Envelope's method
    # that finds the request's fills.
    "a pending event's shape": (
        """
body = {"model": "m", "instructions": "Be brief."}
seen_pending(body)
event = pending("resp_2")
class Forgets(Envelope):
    __slots__ = ()
    def _shared_family(self):
        E._KEPT.lasts["response.created"][7].memo = None
        E._KEPT.lasts.clear()
        event.raw = event.data = b"x" * 300
        return super()._shared_family()
done = E._c.pending_event(Forgets(body), event, E._KEPT.lasts, E._KEPT.last_fills, E._FROM_REQUEST)
response = orjson.loads(event.data)["response"]
print(done is event, parse_event(framed(event)) == event, response["instructions"])
""",
        "True True Be brief.",
    ),
    # The Envelope's members, deleted by its method that finds the request's fills: the
    # compiled path declines (read as they were, they would be NULL).
    "an Envelope's members deleted": (
        """
body = {"model": "m", "instructions": "Be brief."}
seen_pending(body)
for name in ("_echo", "_created_at"):
    class Deletes(Envelope):
        __slots__ = ()
        def _shared_family(self):
            delattr(self, name)
            return super()._shared_family()
    event = pending("resp_2")
    kept = E._KEPT
    print(E._c.pending_event(Deletes(body), event, kept.lasts, kept.last_fills, E._FROM_REQUEST))
""",
        "None None",
    ),
    # An output item, a message's part, usage's details: a lookup in them compares a key
    # whose __eq__ takes them out of what holds them.
    "an output item": (
        """
output = []
output.append({Collides("status", output.clear): 1, "status": "completed", "type": "message",
               "content": [], **MANY})
answer({"usage": None, "output": output})
""",
        '{"a":1}',
    ),
    "a message's part": (
        """
content = []
content.append({Collides("type", content.clear): 1, "type": "output_text", "annotations": [],
                **MANY})
answer({"usage": None, "output": [{"status": "completed", "type": "message", "content": content}]})
""",
        '{"a":1}',
    ),
    "usage's details": (
        """
usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}
kept = []
def other():  # (the dict made next takes the memory of the details freed)
    usage.clear()
    kept.append({"cached_tokens": "x"})
    usage.update(input_tokens=1, output_tokens=1, total_tokens=2)
    usage["output_tokens_details"] = {"reasoning_tokens": 0}
usage["input_tokens_details"] = {Collides("cached_tokens", other): 1, "cached_tokens": 0, **MANY}
usage["output_tokens_details"] = {"reasoning_tokens": 0}
answer({"usage": usage, "output": []})
""",
        '{"a":1}',
    ),
    # Usage known by its keys (learnt from an earlier one): its details are read at their
    # places, and a lookup in the first compares a key whose __eq__ empties the usage,
    # which held the second.
    "usage's details, known by their keys": (
        """
def usual():
    return {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}
answer({"usage": usual(), "output": []})  # (its keys learnt)
usage = usual()
kept = []
def other():  # (the dict made next takes the memory of the details freed)
    if kept:  # (not while the details are built)
        usage.clear()
        kept.append({"reasoning_tokens": "x"})
usage["input_tokens_details"] = {Collides("cached_tokens", other): 1, "cached_tokens": 0, **MANY}
kept.append(None)
answer({"usage": usage, "output": []})
""",
        '{"a":1} {"a":1}',
    ),
    # What the module keeps, which an Envelope's compiled methods read in place of
    # arguments (envelope._KEPT): the last valid answer's shape and plan and the last
    # request's fills, set anew (the old ones freed) by the comparison of the served
    # models with the last request's.
    "the kept last answer and fills": (
        """
class Forgets:
    def __eq__(self, other):
        E._KEPT.last_answer = ((), (), None)
        E._KEPT.last_fills = ((), {})
        return True
    def __hash__(self):
        return 0
envelope = Envelope({"model": "model"}, None, (Forgets(),))
E._KEPT.last_answer = (("id",), (str,), plan(["id"], missing=["tools"]))
E._KEPT.last_fills = ((("served",), "".join(["mo", "del"])), {**MANY})
print(envelope.answer(b'{"id":"r"}', {"id": "r"})[0].decode(), E._KEPT.last_answer[2])
""",
        '{"id":"r","tools":[]} None',
    ),
    "the kept pending shapes and fills": (
        """
body = {"model": "m", "instructions": "Be brief."}
seen_pending(body)
class Forgets:
    def __eq__(self, other):
        E._KEPT.lasts = {}
        E._KEPT.last_fills = ((), {})
        return True
    def __hash__(self):
        return 0
members = b'{"model":"m","instructions":"Be brief."}'
E._KEPT.lasts = {**E._KEPT.lasts, **MANY}  # (only _KEPT holds them)
E._KEPT.last_fills = (((), Forgets(), None, bytes(bytearray(members))), E._KEPT.last_fills[1])
event = Envelope(body, None, (), members).pending_event(pending("resp_2"))
print(orjson.loads(event.data)["response"]["instructions"], E._KEPT.lasts)
""",
        "Be brief. {}",
    ),
}


# Bytes are read and written within their objects whatever the bounds given say.
BOUNDS = {
    # Where a pending event's members go, from a shape remembered wrong (not one
    # envelope._remember_last keeps): past the event's bytes.
    "an insertion point past the bytes": (
        """
seen_by = Envelope({"model": "m"}, None, (), b'{"model":"m"}')
for n in range(2):
    seen_by._pending_event(pending(f"resp_{n}"))
last = E._KEPT.lasts["response.created"]
lasts = {"response.created": (*last[:6], 1000, last[7])}
event = pending("resp_2")
envelope = Envelope({"model": "m"}, None, (), b'{"model":"m"}')
print(E._c.pending_event(envelope, event, lasts, E._KEPT.last_fills, E._FROM_REQUEST))
""",
        "None",
    ),
}


def run(source: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OCXPROXY_")}
    environ |= {"PYTHONPATH": str(ROOT), "PYTHONMALLOC": "debug", "OCXPROXY_REQUIRE_SPEEDUPS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + source],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.parametrize("case", list(CASES))
def test_what_python_code_may_free_is_held_meanwhile(case: str) -> None:
    source, expected = CASES[case]
    assert run(source) == expected.split()


@pytest.mark.parametrize("case", list(BOUNDS))
def test_bytes_are_not_read_or_written_past_their_bounds(case: str) -> None:
    source, expected = BOUNDS[case]
    assert run(source) == expected.split()
