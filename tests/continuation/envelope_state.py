"""The envelope's module-level memory (the shapes, plans and fills it keeps past a
request), forgotten for a test: each starts from none."""

from __future__ import annotations

import pytest

from ocxproxy.continuation import envelope as envelope_module


def forget_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_PLANS", "_VALID", "_FILLS", "_PENDING", "_LAST"):
        monkeypatch.setattr(envelope_module, name, {})
    monkeypatch.setattr(envelope_module, "_LAST_ANSWER", ((), (), None))
    monkeypatch.setattr(envelope_module, "_LAST_FILLS", ((), {}))
