"""Shared fixtures: a real proxy on loopback in front of real fake backends."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import openai
import pytest
from aiohttp import web
from hypothesis import settings

from ocxproxy.config import Config
from ocxproxy.http.context import PROXY, Proxy
from ocxproxy.server import Listener, build_app, listen
from tests.fakes.backend import FakeBackend
from tests.serve import SHARED_COMPACTION_KEY, Serve

# Imported here, at collection, on purpose: CPython 3.11.7 can fail to compile hypothesis
# ("AST constructor recursion depth mismatch") when it is first imported from a deep stack.
settings.register_profile("fast", max_examples=50, deadline=None)
settings.register_profile("deep", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))


def missing_tool(reason: str) -> NoReturn:
    """A tool a test needs is not installed: skip, but fail under CI (CI=true: .ci/run
    installs every one, so a broken install cannot pass as skipped tests)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}, and CI=true", pytrace=False)
    pytest.skip(reason)


def unavailable(reason: str) -> NoReturn:
    """The real llama.cpp backend is missing: skip, or fail where it must be there (.ci/run
    sets OCXPROXY_REQUIRE_LLAMA=1, so a broken install cannot pass as skipped tests)."""
    if os.environ.get("OCXPROXY_REQUIRE_LLAMA") == "1":
        pytest.fail(f"{reason} (OCXPROXY_REQUIRE_LLAMA=1)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@dataclass
class ProxyHandle:
    url: str  # server root, e.g. http://127.0.0.1:PORT
    app: web.Application
    server: Listener
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)  # closed at teardown

    @property
    def proxy(self) -> Proxy:
        return self.app[PROXY]

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the proxy's metrics (0 when it has none yet)."""
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, api_key: str = "sk-test-a", **kwargs: Any) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs
        )
        self.clients.append(client)
        return client


MakeProxy = Callable[..., Awaitable[ProxyHandle]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain HTTP client, for requests the SDK does not make."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def backend() -> AsyncIterator[FakeBackend]:
    async with FakeBackend() as fake:
        yield fake


@pytest.fixture
async def llama_backend() -> AsyncIterator[FakeBackend]:
    async with FakeBackend(stream_style="llama") as fake:
        yield fake


@pytest.fixture
async def make_proxy(tmp_path: Path) -> AsyncIterator[MakeProxy]:
    handles: list[ProxyHandle] = []

    def free_state_dir() -> Path:
        """tmp_path/state, unless a proxy of this test still holds it (a state dir takes
        one proxy at a time): then one of its own."""
        held = {h.app[PROXY].store.state_dir for h in handles if h.app[PROXY].store.durable}
        path, n = tmp_path / "state", 1
        while path in held:
            path, n = tmp_path / f"state{n}", n + 1
        return path

    async def make(*upstreams: str, **overrides: Any) -> ProxyHandle:
        if "state_dir" not in overrides:
            overrides["state_dir"] = free_state_dir()
        overrides.setdefault("snapshot_delay", 0.05)
        # No health probes unless a test asks: they would show up in FakeBackend.seen.
        overrides.setdefault("health_interval", 0)
        if overrides.get("shared_store"):  # replicas on one shared store share one key
            overrides.setdefault("compaction_key", SHARED_COMPACTION_KEY)
        config = Config(upstream=tuple(upstreams), port=0, **overrides)
        app = build_app(config)
        server = await listen(app, "127.0.0.1", 0)  # as `ocxproxy serve` does
        handle = ProxyHandle(server.url, app, server)
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        for client in handle.clients:
            await client.close()
        await handle.server.close()


@pytest.fixture
async def processes() -> AsyncIterator[list[Serve]]:
    """Every `ocxproxy serve` process (tests/serve.py) a test appends is killed at teardown
    if it still runs."""
    started: list[Serve] = []
    yield started
    for p in started:
        if p.running:
            await p.stop(signal.SIGKILL)


@pytest.fixture
async def proxy(make_proxy: MakeProxy, backend: FakeBackend) -> ProxyHandle:
    return await make_proxy(backend.url)
