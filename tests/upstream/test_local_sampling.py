"""The embedded backend's sampling values (what it samples a request that sets none with),
read from its `GET /props` at start-up so that its Responses show them: without llama.cpp,
a stand-in backend answering /props."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from ocxproxy.continuation.envelope import ServedModels
from ocxproxy.upstream import local
from ocxproxy.upstream.local import LocalBackend, LocalBackendError, sampling_of
from tests.conftest import MakeProxy

# What llama.cpp's server reports (float32 values) with its defaults.
PROPS = {
    "default_generation_settings": {
        "n_ctx": 8192,
        "params": {"temperature": 0.800000011920929, "top_p": 0.949999988079071, "top_k": 40},
    },
    "build_info": "b1",
}


def test_sampling_values_are_read_as_the_decimals_they_were_set_as() -> None:
    assert sampling_of(PROPS) == {"temperature": 0.8, "top_p": 0.95}
    greedy = {"default_generation_settings": {"params": {"temperature": 0.0}}}
    assert sampling_of(greedy) == {"temperature": 0.0}
    # An older server's settings, not under `params`.
    flat = {"default_generation_settings": {"temperature": 0.30000001192092896, "top_p": 1}}
    assert sampling_of(flat) == {"temperature": 0.3, "top_p": 1.0}


@pytest.mark.parametrize(
    "props",
    [
        None,
        [],
        {"default_generation_settings": {"n_ctx": 8192}},  # (no sampling values)
        {"default_generation_settings": {"params": {"temperature": "0.8", "top_p": True}}},
        {"default_generation_settings": {"params": {"temperature": -1.0, "top_p": 1.5}}},
    ],
)
def test_props_without_valid_sampling_values_are_an_error(props: Any) -> None:
    with pytest.raises(LocalBackendError, match="no sampling values"):
        sampling_of(props)


class _StandIn(LocalBackend):
    """The embedded backend as the proxy drives it, its child a server of `/props` only."""

    props: Any = PROPS
    _runner: web.AppRunner

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/props", self._props)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]
        assert self.url is not None
        return self.url

    async def _props(self, request: web.Request) -> web.Response:
        return web.json_response(self.props)

    async def watch(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        await self._runner.cleanup()


@pytest.mark.parametrize("props", [PROPS, {"default_generation_settings": {"n_ctx": 8192}}])
async def test_the_proxy_shows_the_sampling_values_the_embedded_backend_reports(
    props: Any,
    make_proxy: MakeProxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its served models carry them (what the envelope fills a Response with); a backend
    that reports none leaves OpenAI's, with a warning."""
    monkeypatch.setattr(local, "is_available", lambda: True)
    monkeypatch.setattr(local, "LocalBackend", _StandIn)
    monkeypatch.setattr(_StandIn, "props", props)
    model = tmp_path / "tiny.gguf"
    with caplog.at_level(logging.WARNING, logger="ocxproxy"):
        handle = await make_proxy(local_model=model, kv_save="off")
    served = handle.proxy.served_models
    warnings = [r.getMessage() for r in caplog.records if "sampling values" in r.getMessage()]
    if props is PROPS:
        assert served == ServedModels(("tiny",), {"temperature": 0.8, "top_p": 0.95})
        assert warnings == []
    else:
        assert type(served) is tuple
        (warning,) = warnings
        assert "OpenAI's defaults" in warning and "no sampling values" in warning
