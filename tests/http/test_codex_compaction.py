"""Codex CLI's remote compaction through the proxy (CONTRACT.md C10), over HTTP and
WebSocket: Codex (`@openai/codex` from npm; .ci/run installs it and names it in
OCXPROXY_CODEX) with its provider named "OpenAI" and a low auto-compact limit, in front of
the fake backend, whose answer is a tool call, so Codex compacts in the middle of its turn.
The turn completes, and the backend never sees a compaction_trigger or compaction item."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from ocxproxy.continuation.compaction import COMPACTION_PROMPT, SUMMARY_PREFIX
from tests.conftest import ProxyHandle, missing_tool
from tests.fakes.backend import FakeBackend
from tests.http.test_compaction import assert_never_forwarded

pytestmark = pytest.mark.timeout(300)

CODEX_VERSION = "0.169.0"


def codex_binary() -> str:
    found = os.environ.get("OCXPROXY_CODEX") or shutil.which("codex")
    if found:
        return found
    reason = f"Codex CLI not installed (npm i @openai/codex@{CODEX_VERSION}; OCXPROXY_CODEX)"
    missing_tool(reason)


@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_codex_compacts_through_the_proxy(
    proxy: ProxyHandle, backend: FakeBackend, tmp_path: Path, transport: str
) -> None:
    codex = codex_binary()
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f"""model = "fake-model"
model_provider = "gw"
model_auto_compact_token_limit = 2000
approval_policy = "never"
sandbox_mode = "read-only"

[model_providers.gw]
name = "OpenAI"
base_url = "{proxy.base_url}"
wire_api = "responses"
env_key = "OCXPROXY_TEST_KEY"
supports_websockets = {"true" if transport == "websocket" else "false"}
request_max_retries = 0
stream_max_retries = 0
"""
    )
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "CODEX_HOME": str(home), "OCXPROXY_TEST_KEY": "sk-codex"}
    env.pop("OPENAI_API_KEY", None)
    proc = await asyncio.create_subprocess_exec(
        codex, "exec", "--skip-git-repo-check", "Please CALL:shell now",
        cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    async with asyncio.timeout(240):
        out = (await proc.communicate())[0].decode(errors="replace")
    assert proc.returncode == 0, out
    assert "context compacted" in out, out
    assert proxy.metric("ocxproxy_compactions_total", route="trigger", outcome="completed") >= 1
    bodies = [seen.json for seen in backend.responses_seen]
    summaries = [
        i for i, b in enumerate(bodies) if b["input"][-1].get("content") == COMPACTION_PROMPT
    ]
    assert summaries, bodies
    # The turn after the compaction carries the summary where Codex sent the item.
    after = bodies[summaries[0] + 1 :]
    assert after and any(
        isinstance(item.get("content"), str) and item["content"].startswith(SUMMARY_PREFIX)
        for item in after[0]["input"]
    )
    assert_never_forwarded(backend)
    if transport == "websocket":
        assert proxy.metric("ocxproxy_websocket_turns_total", outcome="completed") >= 1
