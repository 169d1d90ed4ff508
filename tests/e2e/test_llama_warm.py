"""Warm resume on the real embedded backend (CONTRACT.md C12): a chain's KV state is saved
after its turn, and after the backend is killed (-9) and restarted by the watchdog, the
next continuation is restored instead of computed again."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ocxproxy.upstream import local
from tests.conftest import MakeProxy, ProxyHandle, unavailable
from tests.e2e.conftest import HAVE_LLAMA, MIN_CACHED_RATIO, MISSING, MODEL, cached_ratio
from tests.e2e.text import QUESTIONS, long_message

pytestmark = [pytest.mark.llama, pytest.mark.timeout(1200)]

if not HAVE_LLAMA:
    unavailable(MISSING)


def llama_child() -> int:
    """The pid of this process's embedded llama.cpp child."""
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = (entry / "stat").read_text().rpartition(")")[2].split()[1]
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == me and b"ocxproxy.upstream.llama_server" in cmdline:
            return int(entry.name)
    raise AssertionError("no embedded llama.cpp child")


async def saved(proxy: ProxyHandle) -> None:
    saves = proxy.proxy.kv_saves
    assert saves is not None
    while saves.tasks:
        await asyncio.wait(list(saves.tasks))


async def restarted(proxy: ProxyHandle, times: int) -> None:
    (backend,) = proxy.proxy.pool.fleet.backends
    for _ in range(600):
        if backend.restarts >= times:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the watchdog did not restart the backend")


async def test_a_chain_survives_a_backend_kill(make_proxy: MakeProxy, tmp_path: Path) -> None:
    state = tmp_path / "state"
    proxy = await make_proxy(state_dir=state)  # no upstream: the embedded backend
    client = proxy.client()
    started = time.monotonic()
    first = await client.responses.create(
        model="local", input=long_message(3000, seed=11), max_output_tokens=8
    )
    cold = time.monotonic() - started
    assert first.usage is not None and first.usage.input_tokens > 2500
    await saved(proxy)
    files = [p for p in (state / "kv").iterdir() if p.name.endswith(".kv")]
    assert len(files) == 1
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "kv").stat().st_mode) == 0o700
    assert first.id not in files[0].name  # named by the chain's digest

    os.kill(llama_child(), signal.SIGKILL)
    await restarted(proxy, 1)
    started = time.monotonic()
    second = await client.responses.create(
        model="local", input=QUESTIONS[0], previous_response_id=first.id, max_output_tokens=8
    )
    warm = time.monotonic() - started
    restores = {
        outcome: proxy.metric("ocxproxy_kv_restores_total", outcome=outcome)
        for outcome in ("ok", "failed", "error", "fingerprint_mismatch")
    }
    assert cached_ratio(second.usage) >= MIN_CACHED_RATIO, (second.usage, restores)
    assert warm < cold / 2, (warm, cold)
    assert proxy.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
    assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0

    # Without a save, the same kill is a miss, counted as such.
    third = await client.responses.create(
        model="local", input=QUESTIONS[1], previous_response_id=second.id, max_output_tokens=8
    )
    await saved(proxy)
    os.kill(llama_child(), signal.SIGKILL)
    await restarted(proxy, 2)
    saves = proxy.proxy.kv_saves
    assert saves is not None
    for save in list(saves.by_name.values()):
        saves.drop(save)
    await saved(proxy)
    await client.responses.create(
        model="local", input=QUESTIONS[2], previous_response_id=third.id, max_output_tokens=8
    )
    assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 1


async def test_store_false_turns_are_never_saved(make_proxy: MakeProxy, tmp_path: Path) -> None:
    state = tmp_path / "state"
    proxy = await make_proxy(state_dir=state, kv_save_every=64)
    client = proxy.client()
    secret = "the user's private note " + long_message(400, seed=5)
    first = await client.responses.create(
        model="local", input=secret, store=False, max_output_tokens=4
    )
    assert first.usage is not None and first.usage.input_tokens > 300
    await saved(proxy)
    assert [p.name for p in (state / "kv").iterdir() if not p.name.endswith(".json")] == []
    assert proxy.metric("ocxproxy_kv_saves_total", outcome="saved") == 0


async def test_a_chain_survives_a_graceful_restart_of_the_proxy(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    before = await make_proxy(state_dir=state)
    started = time.monotonic()
    first = await before.client().responses.create(
        model="local", input=long_message(3000, seed=13), max_output_tokens=8
    )
    cold = time.monotonic() - started
    await saved(before)
    await before.server.close()  # the embedded backend stops with it

    after = await make_proxy(state_dir=state)  # a new backend process, the same state dir
    started = time.monotonic()
    second = await after.client().responses.create(
        model="local", input=QUESTIONS[0], previous_response_id=first.id, max_output_tokens=8
    )
    warm = time.monotonic() - started
    assert cached_ratio(second.usage) >= MIN_CACHED_RATIO, second.usage
    assert warm < cold / 2, (warm, cold)
    assert after.metric("ocxproxy_kv_restores_total", outcome="ok") == 1


@pytest.mark.parametrize("probe_sees_it", [True, False])
async def test_an_external_llama_server_restarted_by_its_operator(
    make_proxy: MakeProxy, tmp_path: Path, probe_sees_it: bool
) -> None:
    """A second llama.cpp server process, started here with --slot-save-path, is the
    proxy's --upstream; the proxy is told where it saves (--kv-save-dir). Killed and
    started again by its operator, it gets the chain's KV state back from its own save:
    whether the health probe saw it down, or it came back before the probe looked (the
    slot's task ids, read before the continuation, began anew)."""
    assert MODEL is not None
    slots = tmp_path / "slots"
    slots.mkdir(mode=0o700)
    server = local.LocalBackend(MODEL, slot_save_path=slots)
    url = await server.start()
    try:
        proxy = await make_proxy(
            url, kv_save_dir=slots, health_interval=0.2 if probe_sees_it else 600
        )
        client = proxy.client()
        first = await client.responses.create(
            model="local", input=long_message(3000, seed=17), max_output_tokens=8
        )
        await saved(proxy)
        assert [p for p in slots.iterdir() if p.name.endswith(".kv")]

        (backend,) = proxy.proxy.pool.fleet.backends
        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        if probe_sees_it:
            await until(lambda: not backend.healthy)  # the proxy's probe saw it go
        await until(lambda: not Path(f"/proc/{pid}").exists())  # gone, and reaped
        await server.start()
        await until(lambda: backend.healthy)
        assert backend.epoch == (1 if probe_sees_it else 0)

        second = await client.responses.create(
            model="local", input=QUESTIONS[0], previous_response_id=first.id, max_output_tokens=8
        )
        assert cached_ratio(second.usage) >= MIN_CACHED_RATIO, second.usage
        assert proxy.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
        assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0
    finally:
        await server.stop()


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(600):
        if condition():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("timed out")
