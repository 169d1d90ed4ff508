"""A real `python -m ocxproxy serve` process for black-box store tests: started on a state
dir, killed (-9) or stopped, restarted; its output drained (and kept) while it runs."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from ocxproxy.aio import spawn

ROOT = Path(__file__).resolve().parents[2]
Json = dict[str, Any]


class Serve:
    """`ocxproxy serve` on the default (durable) configuration unless `extra` says."""

    def __init__(self, upstream: str, state_dir: Path, *extra: str) -> None:
        self.args = [
            sys.executable, "-m", "ocxproxy", "serve", "--upstream", upstream,
            "--state-dir", str(state_dir), "--port", "0", "--health-interval", "0", *extra,
        ]  # fmt: skip
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.output: deque[str] = deque(maxlen=2000)  # the last lines it printed
        self.lines = 0  # how many it printed in all
        self._drain: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start it and wait until it listens (the store is loaded by then)."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.args,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(30):
            while True:
                line = (await self.proc.stdout.readline()).decode()
                assert line, "the proxy exited before listening:\n" + "".join(self.output)
                self.output.append(line)
                found = re.search(r"listening on (http://\S+)/v1", line)
                if found:
                    self.url = found.group(1)
                    break
        self._drain = spawn(self._read(self.proc.stdout), name="serve-output")
        return self.url

    async def _read(self, stdout: asyncio.StreamReader) -> None:
        async for line in stdout:
            self.output.append(line.decode(errors="replace"))
            self.lines += 1

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS")

    async def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        assert await self.proc.wait() == -signal.SIGKILL
        if self._drain is not None:
            await self._drain

    async def stop(self) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await self.proc.wait()
        if self._drain is not None:
            await self._drain
        return code


@pytest.fixture
async def processes() -> AsyncIterator[list[Serve]]:
    """Every Serve a test appends is killed at teardown if it still runs."""
    started: list[Serve] = []
    yield started
    for p in started:
        if p.proc is not None and p.proc.returncode is None:
            p.proc.kill()
            await p.proc.wait()


async def create(
    http: aiohttp.ClientSession, url: str, body: Json
) -> tuple[int, Json | None, str | None]:
    """POST /v1/responses as JSON or SSE (body["stream"]): (status, the error object if
    one came, the response id if the turn was acknowledged: a 200 JSON response, or an SSE
    `response.completed` event received)."""
    async with http.post(url + "/v1/responses", json=body) as r:
        if not body.get("stream") or r.status != 200:
            data = await r.read()
            doc = orjson.loads(data) if data[:1] == b"{" else {}
            if r.status == 200:
                return 200, None, doc["id"]
            return r.status, doc.get("error", {"unshaped": data.decode()[:200]}), None
        error: Json | None = None
        data_lines: list[bytes] = []
        async for raw in r.content:
            line = raw.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data_lines.append(line[5:].strip())
                continue
            if line or not data_lines:
                continue
            event = orjson.loads(b"\n".join(data_lines))
            data_lines = []
            if event.get("type") == "response.completed":
                return 200, None, event["response"]["id"]
            if event.get("type") == "error":
                error = event
        return 200, error or {"no_terminal_event": True}, None


def mount_tmpfs(path: Path, size: str) -> None:
    """Mount a tmpfs of `size` at `path`; fail under CI=true, skip elsewhere, if we may not."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs (needs root and CAP_SYS_ADMIN): {done.stderr.strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " (CI=true)", pytrace=False)
        pytest.skip(reason)


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
