"""The compiled fast paths (ocxproxy/_speedups.c, built by `pip install`), or None.

Every caller has the same path in Python and takes it when this is None: a machine
without a C compiler runs the pure-Python code. `OCXPROXY_NO_SPEEDUPS=1` takes the
Python paths anyway (the tests run both); `OCXPROXY_REQUIRE_SPEEDUPS=1` (CI) makes a
missing or stale build an error instead of a fallback. Which one runs is a label of
`ocxproxy_build_info` (metrics.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
    if os.environ.get("OCXPROXY_NO_SPEEDUPS"):
        return None
    required = bool(os.environ.get("OCXPROXY_REQUIRE_SPEEDUPS"))
    try:
        from ocxproxy import _speedups
    except ImportError:
        if required:
            raise
        return None
    source = Path(__file__).with_name("_speedups.c")
    # In a checkout, a build older than the source would run old code: refused.
    if (
        source.exists()
        and hashlib.sha256(source.read_bytes()).hexdigest() != _speedups.SOURCE_DIGEST
    ):
        message = f"{_speedups.__file__} was built from another {source.name}: rebuild it"
        if required:
            raise ImportError(message)
        log.warning("%s (pip install -e .); the pure-Python paths run meanwhile", message)
        return None
    return _speedups


SPEEDUPS = _load()
