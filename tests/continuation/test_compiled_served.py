"""The compiled answer and terminal event with served model names (`--served-model-name`,
and the embedded backend's `ServedModels`, which it always has): a Response that names
the model shown (the request's when it is one of the names, else the first) is the usual
one, compiled; one that names another is declined, and the Python replaces its model.
Each turn's bytes are the Python paths'. (And without served names, the model shown for
a backend's empty one is each request's.)"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ocxproxy.continuation import envelope as envelope_module
from ocxproxy.continuation.envelope import Envelope, ServedModels
from ocxproxy.continuation.expand import forwarded_members
from ocxproxy.upstream.sse import encode_event, parse_event
from tests.continuation.envelope_state import forget_shapes, python_paths
from tests.continuation.test_envelope_compiled import ITEM, USAGE, _same_second

pytestmark = pytest.mark.skipif(envelope_module._c is None, reason="not built here")

SAMPLED = ServedModels(("bench", "other"), {"temperature": 0.8, "top_p": 0.95})
SERVED = {"sampled": SAMPLED, "names": ("bench", "other")}
PREVIOUS = ("previous_response_id", "resp_p")

# Turns: (the request's model, the backend's, the model shown, compiled). The first two
# are the Python's (the shape is new, then its values are learnt); a model not the one
# shown is replaced by the Python (its values, though those seen valid, are not usual).
TURNS = {
    "the request's model is a served one": [
        *[("bench", "bench", "bench", False)] * 2,
        *[("bench", "bench", "bench", True)] * 3,
    ],
    "the request's model is not a served one": [
        *[("gpt-x", "bench", "bench", False)] * 2,
        *[("gpt-x", "bench", "bench", True)] * 3,
    ],
    "the backend names another model": [
        *[("bench", "bench", "bench", False)] * 2,
        ("bench", "bench", "bench", True),
        ("other", "bench", "other", False),  # (the model seen valid, not the one shown)
        ("bench", "bench", "bench", True),
        ("gpt-x", "/models/m.gguf", "bench", False),
        ("bench", "bench", "bench", True),
        ("other", "other", "other", False),  # (valid, not the values seen valid)
        ("other", "other", "other", True),
        ("bench", "other", "bench", False),
    ],
}


def _response(model: str) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "model": model,
        "output": [ITEM],
        "tools": [],
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": None, "summary": None},
        "usage": USAGE,
    }


def _envelope(model: str, served: tuple[str, ...]) -> Envelope:
    body = {"model": model, "instructions": "Be brief."}
    return Envelope(body, PREVIOUS, served, forwarded_members(body), created_at=5)


def _declined(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The calls of the Python methods a compiled one declines to, and of the checks of
    the values a usual answer is not checked for again, as they come."""
    calls: list[str] = []
    for name in ("_answer", "_terminal_event", "_check_given"):
        method = getattr(Envelope, name)

        def counted(self: Envelope, *args: Any, _method: Any = method, _name: str = name) -> Any:
            calls.append(_name)
            return _method(self, *args)

        monkeypatch.setattr(Envelope, name, counted)
    return calls


def _turn(envelope: Envelope, backend: str, sse: bool) -> bytes:
    """A turn's Response completed: its JSON answer's dict once merged and its stored
    bytes, or its terminal event's raw bytes and the stored ones."""
    data = orjson.dumps(_response(backend))
    if not sse:
        response = orjson.loads(data)
        stored, patch = envelope.answer(data, response)
        patch.merge(response)
        return orjson.dumps(response) + b"|" + stored
    kind = "response.completed"
    event = parse_event(
        encode_event(
            kind, orjson.dumps({"type": kind, "response": orjson.loads(data), "sequence_number": 7})
        )
    )
    _, stored = envelope.terminal_event(event, orjson.loads(event.data))
    assert stored is not None and stored[1]
    return event.raw + b"|" + stored[0]


def _turns(
    turns: list[tuple[str, str, str, bool]],
    served: tuple[str, ...],
    sse: bool,
    monkeypatch: pytest.MonkeyPatch,
    python: bool,
) -> list[tuple[bytes, bool]]:
    """Each turn's bytes and whether it was the usual one (compiled, or `python`: the
    Python's quick branch), from no shape seen."""
    done = []
    with monkeypatch.context() as patched:
        forget_shapes(patched)
        if python:
            python_paths(patched)
        calls = _declined(patched)
        for model, backend, _, _ in turns:
            before = len(calls)
            done.append((_turn(_envelope(model, served), backend, sse), len(calls) == before))
    return done


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("served", list(SERVED))
@pytest.mark.parametrize("case", list(TURNS))
def test_a_turn_with_served_models_is_compiled_when_it_names_the_model_shown(
    case: str, served: str, sse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = TURNS[case]

    def both() -> tuple[Any, Any]:
        compiled = _turns(turns, SERVED[served], sse, monkeypatch, python=False)
        return compiled, _turns(turns, SERVED[served], sse, monkeypatch, python=True)

    compiled, python = _same_second(both)
    assert [was for _, was in compiled] == [turn[3] for turn in turns]
    assert [was for _, was in python] == [turn[3] for turn in turns]
    assert [data for data, _ in compiled] == [data for data, _ in python]
    for (data, _), (_, _, shown, _) in zip(compiled, turns, strict=True):
        stored = orjson.loads(data.rsplit(b"|", 1)[-1])
        assert stored["model"] == shown
        assert stored["temperature"] == (0.8 if served == "sampled" else 1.0)


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
def test_served_models_with_other_sampling_values_get_their_own_fill(
    sse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same names sampled with other values (another backend's): the compiled turn
    shows those values, not the fill the names got before (a fill's key holds the served
    models, equal only with the same values)."""
    other = ServedModels(SAMPLED, {"temperature": 0.5, "top_p": 0.9})
    forget_shapes(monkeypatch)
    calls = _declined(monkeypatch)
    compiled = []
    for served in (SAMPLED, SAMPLED, SAMPLED, other, SAMPLED, other):
        before = len(calls)
        data = _turn(_envelope("bench", served), "bench", sse)
        compiled.append(len(calls) == before)
        stored = orjson.loads(data.rsplit(b"|", 1)[-1])
        assert (stored["temperature"], stored["top_p"]) == (
            served.sampling["temperature"],
            served.sampling["top_p"],
        )
    assert compiled == [False, False, True, True, True, True]


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("python", [False, True], ids=["compiled", "python"])
def test_a_response_naming_no_model_shows_each_requests(
    python: bool, sse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without served names, a backend that names no model (an empty one) shows the
    request's: the same answer is not a usual one for the next request, which names
    another."""
    turns = [("", "", "", False)] * 3 + [("m", "", "m", False)] * 2
    done = _turns(turns, (), sse, monkeypatch, python=python)
    shown = [orjson.loads(data.rsplit(b"|", 1)[-1])["model"] for data, _ in done]
    assert shown == [turn[2] for turn in turns]
