"""A real `python -m ocxproxy serve` process for black-box tests: started on a state dir,
killed (-9) or stopped, restarted; its output drained (and kept) while it runs. The
`processes` fixture (tests/conftest.py) kills whatever a test left running."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson

from ocxproxy.aio import spawn

ROOT = Path(__file__).resolve().parents[1]
Json = dict[str, Any]


class ServeExited(AssertionError):
    """The process ended before it listened (a refusal at start, or a crash)."""

    def __init__(self, code: int | None, output: str) -> None:
        super().__init__(f"the proxy exited ({code}) before listening:\n{output}")
        self.code = code
        self.output = output


SHARED_COMPACTION_KEY = "the test replicas' shared compaction key"


class Serve:
    """`ocxproxy serve` on the default (durable) configuration unless `extra` says; `env`
    adds environment variables (e.g. OCXPROXY_SHARED_STORE); `preexec_fn` runs in the child
    before it starts (e.g. to lower its resource limits)."""

    def __init__(
        self,
        upstream: str,
        state_dir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.args = [
            sys.executable, "-m", "ocxproxy", "serve", "--upstream", upstream,
            "--state-dir", str(state_dir), "--port", "0", "--health-interval", "0", *extra,
        ]  # fmt: skip
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if "--shared-store" in extra or "OCXPROXY_SHARED_STORE" in self.env:
            # Replicas on one shared store must seal compaction items with one key.
            self.env.setdefault("OCXPROXY_COMPACTION_KEY", SHARED_COMPACTION_KEY)
        self.preexec_fn = preexec_fn
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.output: deque[str] = deque(maxlen=2000)  # the last lines it printed
        self.lines = 0  # how many it printed in all
        self._drain: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start it and wait until it listens (the store is loaded by then); ServeExited
        if it ends first."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.args,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            preexec_fn=self.preexec_fn,
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(30):
            while True:
                line = (await self.proc.stdout.readline()).decode(errors="replace")
                if not line:
                    raise ServeExited(await self.proc.wait(), "".join(self.output))
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

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def client(self, api_key: str = "sk-x", **kwargs: Any) -> openai.AsyncOpenAI:
        """An SDK client on it (the caller closes it)."""
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs
        )

    def cpu_seconds(self) -> float:
        """User and system CPU time the process has used."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS")

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send `sig` (if it still runs), wait for the exit; its exit code."""
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        async with asyncio.timeout(30):
            code = await self.proc.wait()
        if self._drain is not None:
            await self._drain
        return code

    async def kill9(self) -> None:
        assert await self.stop(signal.SIGKILL) == -signal.SIGKILL


async def respond(
    http: aiohttp.ClientSession, url: str, body: Json, headers: dict[str, str] | None = None
) -> tuple[int, Json | None, Json | None]:
    """POST /v1/responses as JSON or SSE (body["stream"]): (status, the error object if
    one came, the response object if the turn was acknowledged: a 200 JSON response, or an
    SSE `response.completed` event received)."""
    async with http.post(url + "/v1/responses", json=body, headers=headers) as r:
        if not body.get("stream") or r.status != 200:
            data = await r.read()
            doc = orjson.loads(data) if data[:1] == b"{" else {}
            if r.status == 200:
                return 200, None, doc
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
                return 200, None, event["response"]
            if event.get("type") == "error":
                error = event
        return 200, error or {"no_terminal_event": True}, None


async def create(
    http: aiohttp.ClientSession, url: str, body: Json, headers: dict[str, str] | None = None
) -> tuple[int, Json | None, str | None]:
    """respond(), with the acknowledged response's id instead of the whole object."""
    status, error, response = await respond(http, url, body, headers)
    return status, error, None if response is None else response["id"]


def output_text(response: Json) -> str:
    return "".join(
        part.get("text", "") for item in response["output"] for part in item.get("content", [])
    )
