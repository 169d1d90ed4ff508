"""The envelope's module-level memory (the shapes, plans and fills it keeps past a
request), forgotten for a test: each starts from none; and its Python paths put in
place of the compiled ones."""

from __future__ import annotations

import pytest

from ocxproxy.continuation import envelope as envelope_module
from ocxproxy.continuation.envelope import Envelope


def forget_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_PLANS", "_VALID", "_FILLS", "_PENDING"):
        monkeypatch.setattr(envelope_module, name, {})
    kept = envelope_module._KEPT
    monkeypatch.setattr(kept, "lasts", {})
    monkeypatch.setattr(kept, "last_answer", ((), (), None))
    monkeypatch.setattr(kept, "last_fills", ((), {}))


def python_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python paths run, not the compiled ones (the Envelope's methods too, which
    are its C base's when they are built)."""
    monkeypatch.setattr(envelope_module, "_c", None)
    for name in ("answer", "terminal_event", "pending_event"):
        monkeypatch.setattr(Envelope, name, getattr(Envelope, "_" + name))
