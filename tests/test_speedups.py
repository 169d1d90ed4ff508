"""The compiled fast paths' loader (ocxproxy/speedups.py): built here and loaded, or
refused when older than its source, and never needed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ocxproxy
from ocxproxy.speedups import SPEEDUPS

PACKAGE = Path(ocxproxy.__file__).parent
PROBE = "from ocxproxy.speedups import SPEEDUPS; print(SPEEDUPS is not None)"


def run(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OCXPROXY_")}
    environ |= env | {"PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=root,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def built() -> bool:
    return any(PACKAGE.glob("_speedups.*.so"))


@pytest.mark.skipif(
    not built() and not os.environ.get("OCXPROXY_REQUIRE_SPEEDUPS"),
    reason="not built here (no C compiler)",
)
def test_the_build_is_loaded_and_is_the_sources() -> None:
    assert SPEEDUPS is not None
    digest = hashlib.sha256((PACKAGE / "_speedups.c").read_bytes()).hexdigest()
    assert digest == SPEEDUPS.SOURCE_DIGEST


def test_no_speedups_takes_the_python_paths() -> None:
    done = run(PACKAGE.parent, OCXPROXY_NO_SPEEDUPS="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.skipif(not built(), reason="not built here (no C compiler)")
def test_a_build_older_than_its_source_is_refused(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "ocxproxy", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "ocxproxy" / "_speedups.c", "a") as source:
        source.write("/* changed since the build */\n")
    fallback = run(tmp_path)
    assert fallback.returncode == 0, fallback.stderr
    assert fallback.stdout.strip() == "False"
    assert "rebuild it" in fallback.stderr
    required = run(tmp_path, OCXPROXY_REQUIRE_SPEEDUPS="1")
    assert required.returncode != 0
    assert "rebuild it" in required.stderr
    current = run(PACKAGE.parent, OCXPROXY_REQUIRE_SPEEDUPS="1")
    assert current.stdout.strip() == "True", current.stderr
