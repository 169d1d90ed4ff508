"""The official Open Responses compliance suite (the unmodified copy in
tests/vendor/openresponses, run by scripts/openresponses with Bun and zod from npm) against
`ocxproxy serve` in front of the fake stateless backend, with both stream styles: every
test passes but the ones that need a model to choose a tool, and those fail for that
reason, so the list of exceptions is exact."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import missing_tool

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "openresponses"
VENDORED = ROOT / "tests" / "vendor" / "openresponses"
# Every test of the vendored suite, by id.
SUITE = (
    "basic-response", "assistant-phase", "response-output-phase-schema",
    "streaming-response", "websocket-response", "websocket-sequential-responses",
    "websocket-continuation", "websocket-reconnect-store-false-recovery",
    "websocket-previous-response-not-found", "websocket-failed-continuation-evicts-cache",
    "websocket-compact-new-chain", "system-prompt", "tool-calling", "image-input",
    "multi-turn", "compact-response", "compact-missing-model",
)  # fmt: skip
NO_TOOL_CALL = 'Expected output item of type "function_call" but none found'
# What the fake backend cannot pass, and why: it answers every request in text.
NEEDS_A_MODEL = {"tool-calling": NO_TOOL_CALL}


def run_suite(mode: str, *suite_args: str, timeout: float = 240) -> dict[str, dict[str, Any]]:
    """Run the suite through scripts/openresponses in `mode` (--spec, --llama-style,
    --embedded), the proxy on this interpreter; each test's result by id."""
    missing = [tool for tool in ("npm", "curl", "bash") if shutil.which(tool) is None]
    if missing:
        reason = f"the compliance suite needs {', '.join(missing)} (Bun and zod come from npm)"
        missing_tool(reason)
    argv = ["bash", str(SCRIPT), "--python", sys.executable, mode, "--json", *suite_args]
    # Its own process group: a timeout ends the servers it started too.
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
    try:
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    try:
        report = orjson.loads(out)
    except orjson.JSONDecodeError:
        pytest.fail(f"the suite did not report (exit {child.returncode}):\n"
                    f"{out.decode()[-3000:]}\n{err.decode()[-3000:]}")  # fmt: skip
    assert child.returncode == (1 if report["summary"]["failed"] else 0)
    return {result["id"]: result for result in report["results"]}


def outcome(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each test's status, and for a failure its errors."""
    return {
        name: result["status"] if result["status"] == "passed" else result.get("errors")
        for name, result in sorted(results.items())
    }


@pytest.mark.parametrize("mode", ["--spec", "--llama-style"])
def test_the_suite_passes_but_for_choosing_a_tool(mode: str) -> None:
    results = run_suite(mode)
    expected = {name: "passed" for name in SUITE}
    expected.update({name: [error] for name, error in NEEDS_A_MODEL.items()})
    assert outcome(results) == dict(sorted(expected.items()))


def test_the_vendored_suite_is_the_upstream_files_unmodified() -> None:
    """Each file is the blob its README lists (git's id: sha1 of "blob LEN\\0" + bytes),
    and nothing else is there."""
    readme = (VENDORED / "README.md").read_text()
    listed = {path: blob for blob, path in re.findall(r"^([0-9a-f]{40})  (\S+)$", readme, re.M)}
    assert "bin/compliance-test.ts" in listed and "LICENSE" in listed
    present = {
        path.relative_to(VENDORED).as_posix(): path.read_bytes()
        for path in VENDORED.rglob("*")
        if path.is_file() and path.name != "README.md"
    }
    assert sorted(present) == sorted(listed)
    changed = [
        path for path, data in present.items()
        if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != listed[path]
    ]  # fmt: skip
    assert changed == []
