"""An `--upstream` that is not a backend's base URL is never taken for a healthy backend:
an endpoint pasted in its place (`http://gpu:8000/v1/responses`) stops `serve` with the
base URL to give instead, and a probe whose health path answers 404 counts the backend up
only when `GET /v1/models` answers 200 too (a server without a health path)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from ocxproxy.config import ConfigError, build_config
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.serve import Serve, ServeExited


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("http://gpu:8000/v1/responses", "http://gpu:8000/v1"),
        ("http://gpu:8000/v1/chat/completions/", "http://gpu:8000/v1"),
        ("https://gpu/vllm/v1/models", "https://gpu/vllm/v1"),
        ("http://gpu:8000/responses", "http://gpu:8000/v1"),
        ("http://gpu:11434/completions", "http://gpu:11434/v1"),
    ],
)
def test_an_endpoint_is_refused_with_its_base_url(given: str, base: str) -> None:
    with pytest.raises(ConfigError) as refused:
        build_config({"upstream": [given]})
    message = str(refused.value)
    assert message.startswith("--upstream: ") and "is an endpoint" in message
    assert f"the base URL is {base} " in message
    for fine in (base, "http://gpu:8000", "http://gpu/prefix"):  # bases, also under a prefix
        assert build_config({"upstream": [fine]}).upstream


async def test_serve_refuses_an_endpoint_at_start(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    serve = Serve(backend.url + "/v1/responses", tmp_path / "state")
    processes.append(serve)
    with pytest.raises(ServeExited) as exited:
        await serve.start()
    assert exited.value.code == 2
    lines = exited.value.output.splitlines()
    assert len(lines) == 1 and f"the base URL is {backend.url}/v1 " in lines[0], lines
    assert backend.seen == []


async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.get(url + "/readyz") as r:
        return r.status, await r.json()


async def test_a_url_that_answers_404_to_everything_is_down(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """A server, but not the backend's base: /health and /v1/models are both 404 there."""
    wrong = backend.url + "/not-the-base"
    proxy = await make_proxy(wrong, health_interval=0.05)
    # Two rounds of probes: the first one's verdict is in when the second one starts.
    await backend.wait_for(lambda: len(backend.seen) >= 4)
    status, body = await readyz(http, proxy.url)
    assert status == 503 and body["backends"] == {wrong: "down"}
    paths = {s.path for s in backend.seen}
    assert paths == {"/not-the-base/health", "/not-the-base/v1/models"}


async def test_a_backend_without_a_health_path_is_up_when_its_models_answer(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """Like Ollama: no /health (404 here: --health-path names a path it lacks), but
    GET /v1/models answers 200."""
    proxy = await make_proxy(backend.url, health_interval=0.05, health_path="/no-such-path")
    await backend.wait_for(lambda: [s.path for s in backend.seen].count("/v1/models") >= 2)
    status, body = await readyz(http, proxy.url)
    assert status == 200 and body["backends"] == {backend.url: "up"}
