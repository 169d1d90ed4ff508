"""Background mode (CONTRACT.md C11) through openai-node, the `openai` npm package
(OPENAI_NODE_VERSION; .ci/run installs it and names its node_modules in
OCXPROXY_OPENAI_NODE): create and poll, a stream dropped after three events and resumed
with `starting_after` (raw and through the SDK's `responses.stream` helper), a cancel
twice, store:false refused. tests/http/node/background.cjs drives it and prints what it
saw; this test checks it."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import orjson
import pytest

from tests.conftest import MakeProxy, missing_tool
from tests.fakes.backend import FakeBackend

pytestmark = pytest.mark.asyncio

OPENAI_NODE_VERSION = "6.49.0"
SCRIPT = Path(__file__).with_name("node") / "background.cjs"
LOCAL = Path(__file__).resolve().parents[2] / ".openai-node-ci" / "node_modules"


def openai_node() -> tuple[str, str]:
    """node, and the node_modules that holds `openai`."""
    modules = os.environ.get("OCXPROXY_OPENAI_NODE") or (str(LOCAL) if LOCAL.is_dir() else "")
    node = shutil.which("node")
    if node and modules and (Path(modules) / "openai").is_dir():
        return node, modules
    reason = (
        f"openai-node not installed (npm i --prefix .openai-node-ci openai@{OPENAI_NODE_VERSION};"
        " OCXPROXY_OPENAI_NODE)"
    )
    missing_tool(reason)


async def test_openai_node_creates_polls_resumes_and_cancels(make_proxy: MakeProxy) -> None:
    node, modules = openai_node()
    async with FakeBackend(delay=0.1) as backend:
        proxy = await make_proxy(backend.url)
        env = {
            **os.environ,
            "NODE_PATH": modules,
            "OCXPROXY_BASE_URL": proxy.base_url,
            "OPENAI_API_KEY": "sk-test-a",
        }
        child = await asyncio.create_subprocess_exec(
            node, str(SCRIPT), env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(child.communicate(), 120)
        assert child.returncode == 0, err.decode()
    seen = orjson.loads(out)

    poll = seen["poll"]
    assert poll["created"]["status"] in ("queued", "in_progress")
    assert poll["created"]["background"] is True
    assert poll["done"] == {"id": poll["created"]["id"], "status": "completed",
                            "text": "echo#1: poll me"}  # fmt: skip

    resume = seen["resume"]
    assert resume["first"] == [[0, "response.created"], [1, "response.in_progress"],
                               [2, "response.output_item.added"]]  # fmt: skip
    numbers = [n for n, _ in resume["first"] + resume["rest"]]
    assert numbers == list(range(len(numbers)))  # gap-free, no duplicates
    assert resume["rest"][-1][1] == "response.completed"
    assert resume["same"] is True  # the parts joined are the whole log
    assert resume["helped"] == numbers[6:]
    assert resume["final"] == "echo#1: stream me"

    assert seen["cancel"] == {"status": "cancelled", "same": True, "polled": "cancelled"}
    assert seen["storeFalse"] == {"refused": True, "status": 400, "param": "background"}
