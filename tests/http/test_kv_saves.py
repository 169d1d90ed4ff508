"""Warm resume's saves and restores (CONTRACT.md C12) against a fake llama.cpp backend
with slot actions, through the proxy: a restore that takes, one that says it did but did
not, a fingerprint that changed, the budget, store:false, DELETE."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from ocxproxy.upstream.kvsave import KvSaves
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend

FIRST = [
    {"role": "user", "content": "the chain's long first message " * 60},
    {"role": "user", "content": "go"},
]


@dataclass
class Warm:
    proxy: ProxyHandle
    fake: FakeBackend
    saves: KvSaves
    directory: Path
    boot: list[str]

    @property
    def client(self) -> openai.AsyncOpenAI:
        return self.proxy.client()

    def files(self) -> list[str]:
        return sorted(p.name for p in self.directory.iterdir() if p.name.endswith(".kv"))

    async def settled(self) -> None:
        await settled(self.saves)

    def restart(self) -> None:
        """The backend starts again: a new identity, an empty cache (the embedded
        backend's watchdog counts the restart as this does)."""
        self.boot[0] += "'"
        self.proxy.proxy.pool.fleet.backends[0].restarts += 1
        self.fake.forget_cache()

    def metric(self, name: str, **labels: str) -> float:
        return self.proxy.metric(name, **labels)


async def settled(saves: KvSaves) -> None:
    """Until the saves under way are written."""
    while saves.tasks:
        await asyncio.wait(list(saves.tasks))


async def saved_first_turn(proxy: ProxyHandle, directory: Path) -> tuple[str, str]:
    """A chain's first turn through `proxy` (with --kv-save-dir `directory`), once its save
    is written: the turn's id and the save's file name (the only one there)."""
    saves = proxy.proxy.kv_saves
    assert saves is not None
    first = await proxy.client().responses.create(model="m", input=FIRST)  # type: ignore[arg-type]
    await settled(saves)
    return first.id, the_save(directory)


def the_save(directory: Path) -> str:
    (name,) = (p.name for p in directory.glob("*.kv"))
    return name


async def warm_proxy(
    make_proxy: MakeProxy, tmp_path: Path, *, restores: bool = True, budget: int = 1 << 30
) -> Warm:
    directory = tmp_path / "kv"
    directory.mkdir()
    fake = FakeBackend(slot_dir=directory, restores=restores)
    await fake.start()
    proxy = await make_proxy(fake.url)
    inner = proxy.proxy
    saves = KvSaves(directory, budget, 100, inner.pool.http, inner.metrics)
    await saves.open()
    model = tmp_path / "model.gguf"
    model.write_bytes(b"the model's weights")
    boot = ["first"]
    await saves.attach(fake.url, lambda: boot[0], model)
    inner.kv_saves = saves
    return Warm(proxy, fake, saves, directory, boot)


async def turn(warm: Warm, text: str | list[dict[str, str]], prev: str | None, **kw: object) -> str:
    response = await warm.client.responses.create(
        model="m", input=text, previous_response_id=prev, **kw
    )
    await warm.settled()
    return response.id


async def test_a_restore_that_takes_spares_the_prefill(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    warm = await warm_proxy(make_proxy, tmp_path)
    try:
        first = await turn(warm, FIRST, None)
        assert len(warm.files()) == 1 and first not in warm.files()[0]
        second = await turn(warm, "short", first)  # grew < 100 tokens: joins that save
        assert len(warm.files()) == 1
        warm.restart()
        await turn(warm, "after the restart", second)
        assert warm.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
        assert warm.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0
        pinned = warm.fake.responses_seen[-1].body
        assert pinned.startswith(b'{"id_slot":0,')
    finally:
        await warm.fake.close()


async def test_a_restore_that_did_not_take_is_counted_dropped_and_stops_after_three(
    make_proxy: MakeProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    warm = await warm_proxy(make_proxy, tmp_path, restores=False)
    try:
        for n in range(3):
            before = warm.files()
            first = await turn(warm, [*FIRST, {"role": "user", "content": f"chain {n}"}], None)
            (old,) = set(warm.files()) - set(before)
            warm.restart()
            await turn(warm, "after the restart", first)
            assert old not in warm.files()  # dropped (the turn after it is saved anew)
            assert warm.metric("ocxproxy_kv_restores_total", outcome="failed") == n + 1
            assert warm.metric("ocxproxy_cache_miss_total", reason="restore_failed") == n + 1
        assert not warm.saves.backends[warm.fake.url].restoring
        assert "restores are off" in caplog.text
        first = await turn(warm, FIRST, None)
        warm.restart()
        await turn(warm, "no restore is tried now", first)
        assert warm.metric("ocxproxy_kv_restores_total", outcome="failed") == 3
        assert warm.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 1
        assert warm.fake.responses_seen[-1].body.startswith(b'{"model"')
    finally:
        await warm.fake.close()


async def test_a_conversations_turns_are_saved_and_restored_like_a_chains(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    warm = await warm_proxy(make_proxy, tmp_path)
    try:
        conversation = await warm.client.conversations.create()

        async def say(text: str | list[dict[str, str]]) -> None:
            await warm.client.responses.create(model="m", input=text, conversation=conversation.id)  # type: ignore[arg-type]
            await warm.settled()

        await say(FIRST)
        (first,) = warm.files()
        await say("short")  # grew < 100 tokens: the same save
        assert warm.files() == [first]
        warm.restart()
        await say("after the restart")
        assert warm.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
        assert warm.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0
        assert warm.fake.responses_seen[-1].body.startswith(b'{"id_slot":0,')
        await say([*FIRST, {"role": "user", "content": "it grew"}])  # a longer save
        (second,) = warm.files()
        assert second != first
        await warm.client.conversations.delete(conversation.id)
        await warm.settled()
        assert warm.files() == []
    finally:
        await warm.fake.close()


async def test_another_fingerprint_is_not_restored(make_proxy: MakeProxy, tmp_path: Path) -> None:
    warm = await warm_proxy(make_proxy, tmp_path)
    try:
        first = await turn(warm, FIRST, None)
        assert len(warm.files()) == 1
        warm.restart()
        warm.fake.template = "another chat template"
        model = tmp_path / "model.gguf"
        await warm.saves.attach(warm.fake.url, lambda: warm.boot[0], model)
        (old,) = warm.files()
        await turn(warm, "after the upgrade", first)
        assert old not in warm.files()
        assert warm.metric("ocxproxy_kv_restores_total", outcome="fingerprint_mismatch") == 1
        assert warm.metric("ocxproxy_kv_restores_total", outcome="ok") == 0
        assert warm.metric("ocxproxy_cache_miss_total", reason="fingerprint_mismatch") == 1
    finally:
        await warm.fake.close()


async def test_store_false_is_never_saved_and_delete_removes_the_save(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    warm = await warm_proxy(make_proxy, tmp_path)
    try:
        private = await turn(warm, FIRST, None, store=False)
        assert warm.files() == []
        assert warm.metric("ocxproxy_kv_saves_total", outcome="saved") == 0
        first = await turn(warm, FIRST, None)
        second = await turn(warm, "short", first)
        assert len(warm.files()) == 1
        await warm.client.responses.delete(first)
        assert len(warm.files()) == 1  # the second turn reaches it still
        await warm.client.responses.delete(second)
        await warm.settled()
        assert warm.files() == []
        assert private
    finally:
        await warm.fake.close()


async def test_the_budget_keeps_the_most_recently_used(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    warm = await warm_proxy(make_proxy, tmp_path, budget=3000)  # one save is ~1.9 kB
    try:
        first = await turn(warm, FIRST, None)
        (old,) = warm.files()
        await turn(warm, [*FIRST, {"role": "user", "content": "another chain"}], None)
        await warm.settled()
        assert len(warm.files()) == 1 and warm.files() != [old]
        assert warm.metric("ocxproxy_kv_evictions_total") == 1
        warm.restart()
        await turn(warm, "its save is gone", first)
        assert warm.metric("ocxproxy_kv_restores_total", outcome="ok") == 0
    finally:
        await warm.fake.close()


async def test_saves_outlive_the_proxy_and_strays_are_removed(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    warm = await warm_proxy(make_proxy, tmp_path)
    try:
        first = await turn(warm, FIRST, None)
        (name,) = warm.files()
        (warm.directory / "cut-short.kv.part").write_bytes(b"half a save")
        (warm.directory / "unnamed.kv").write_bytes(b"no index names it")
        inner = warm.proxy.proxy
        again = KvSaves(warm.directory, 1 << 30, 100, inner.pool.http, inner.metrics)
        await again.open()  # as the next start of the proxy does
        assert warm.files() == [name]
        assert not (warm.directory / "cut-short.kv.part").exists()
        await again.attach(warm.fake.url, lambda: "a later start", tmp_path / "model.gguf")
        found = again.saved_for(first, warm.fake.url)
        assert found is not None
        save, slots = found
        assert save.name == name and save.fingerprint == slots.fingerprint
    finally:
        await warm.fake.close()


async def test_an_external_llama_server_with_slot_saves_is_detected_and_used(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    directory = tmp_path / "slots"
    directory.mkdir()
    async with FakeBackend(slot_dir=directory) as fake:
        proxy = await make_proxy(fake.url, kv_save_dir=directory, kv_save_every=100)
        saves = proxy.proxy.kv_saves
        assert saves is not None and list(saves.backends) == [fake.url]
        first, _ = await saved_first_turn(proxy, directory)
        fleet = proxy.proxy.pool.fleet
        (backend,) = fleet.backends
        fleet.mark_down(backend, "restarting")  # what the health probe sees of a restart
        fleet.mark_up(backend)
        fake.forget_cache()
        await proxy.client().responses.create(model="m", input="again", previous_response_id=first)
        assert proxy.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
        assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0


async def test_an_external_server_without_slot_saves_gets_none(
    make_proxy: MakeProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # llama.cpp's /props, no slot actions (404 where llama.cpp says 501)
    async with FakeBackend(window=("llama", 8192)) as fake:
        proxy = await make_proxy(fake.url, kv_save_dir=tmp_path / "slots")
        assert proxy.proxy.kv_saves is None
        assert "was not started with --slot-save-path" in caplog.text


async def test_a_chain_whose_backend_is_down_is_restored_on_another_of_the_fleet(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    directory = tmp_path / "slots"
    directory.mkdir()
    async with FakeBackend(slot_dir=directory) as one, FakeBackend(slot_dir=directory) as two:
        proxy = await make_proxy(one.url, two.url, kv_save_dir=directory, kv_save_every=100)
        saves = proxy.proxy.kv_saves
        assert saves is not None and set(saves.backends) == {one.url, two.url}
        client = proxy.client()
        first, name = await saved_first_turn(proxy, directory)
        home, other = (one, two) if one.responses_seen else (two, one)
        assert [a[0] for a in chain_actions(home)] == ["save"] and chain_actions(other) == []
        await home.close()  # the chain's home is down: affinity sends it elsewhere
        await client.responses.create(model="m", input="again", previous_response_id=first)
        assert chain_actions(other)[0] == ("restore", name, 0)  # before the turn it served
        (turn,) = other.responses_seen
        assert turn.body.startswith(b'{"id_slot":0,')
        assert proxy.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
        assert proxy.metric("ocxproxy_cache_miss_total", reason="rerouted") == 0
        restores = [a for a in chain_actions(other) if a[0] == "restore"]
        second = await client.responses.create(
            model="m", input="and again", previous_response_id=first
        )
        assert second.id and [a for a in chain_actions(other) if a[0] == "restore"] == restores


def chain_actions(fake: FakeBackend) -> list[tuple[str, str, int]]:
    """The slot actions on chains' saves (not the probe the proxy starts with)."""
    return [action for action in fake.slot_actions if action[1] != "ocxproxy-probe.kv"]


async def test_a_restore_that_did_not_take_on_one_backend_leaves_the_save_to_the_others(
    make_proxy: MakeProxy, tmp_path: Path
) -> None:
    directory = tmp_path / "slots"
    directory.mkdir()
    one, two = FakeBackend(slot_dir=directory), FakeBackend(slot_dir=directory)
    await one.start()
    await two.start()
    again = FakeBackend(slot_dir=directory)  # the chain's home started again, cache empty
    try:
        proxy = await make_proxy(
            one.url, two.url, kv_save_dir=directory, kv_save_every=100, health_interval=0.05
        )
        saves = proxy.proxy.kv_saves
        assert saves is not None
        client = proxy.client()
        first, name = await saved_first_turn(proxy, directory)
        home, other = (one, two) if one.responses_seen else (two, one)
        other.restores = False  # says it restored, and did not
        fleet = proxy.proxy.pool.fleet
        served = next(b for b in fleet.backends if b.url == home.url)
        await home.close()
        await fleet.wait_for(lambda: not served.healthy, within=10)
        await client.responses.create(
            model="m", input="elsewhere", previous_response_id=first, store=False
        )
        assert chain_actions(other)[0] == ("restore", name, 0)
        assert proxy.metric("ocxproxy_kv_restores_total", outcome="failed") == 1
        assert [p.name for p in directory.glob("*.kv")] == [name]  # kept for its home
        assert saves.saved_for(first, other.url) is None  # not tried there again
        await again.start(port=int(home.url.rsplit(":", 1)[1]))
        await fleet.wait_for(lambda: served.healthy, within=10)
        await client.responses.create(model="m", input="home", previous_response_id=first)
        assert chain_actions(again)[0] == ("restore", name, 0)
        assert proxy.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
    finally:
        await one.close()
        await two.close()
        await again.close()


@pytest.mark.parametrize("seen", ["not", "not, another client first", "by the probe"])
async def test_an_external_server_restarted_between_two_probes_is_noticed_before_the_turn(
    make_proxy: MakeProxy, tmp_path: Path, seen: str
) -> None:
    directory = tmp_path / "slots"
    directory.mkdir()
    old, new = FakeBackend(slot_dir=directory), FakeBackend(slot_dir=directory)
    await old.start()
    try:
        proxy = await make_proxy(
            old.url, kv_save_dir=directory, kv_save_every=100, health_interval=60
        )
        client = proxy.client()
        first, name = await saved_first_turn(proxy, directory)
        second = await client.responses.create(
            model="m", input="the same process", previous_response_id=first
        )
        assert chain_actions(old) == [("save", name + ".part", 1)]  # nothing restored
        await old.close()  # a new process on its port before the probe looks again
        await new.start(port=int(old.url.rsplit(":", 1)[1]))
        if seen == "not, another client first":  # its slot ran a task, numbered anew
            async with aiohttp.ClientSession() as session:
                await session.post(f"{new.url}/v1/responses", json={"model": "m", "input": "hi"})
        elif seen == "by the probe":
            fleet = proxy.proxy.pool.fleet
            (backend,) = fleet.backends
            fleet.mark_down(backend, "restarting")
            fleet.mark_up(backend)
        await client.responses.create(model="m", input="restarted", previous_response_id=second.id)
        assert chain_actions(new)[0][:2] == ("restore", name)
        assert proxy.metric("ocxproxy_kv_restores_total", outcome="ok") == 1
        assert proxy.metric("ocxproxy_cache_miss_total", reason="evicted") == 0
        assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0
        await client.responses.create(model="m", input="again", previous_response_id=second.id)
        restores = [action for action in chain_actions(new) if action[0] == "restore"]
        assert len(restores) == 1  # the same process: nothing restored again
        assert proxy.proxy.pool.fleet.backends[0].epoch == 1
    finally:
        await old.close()
        await new.close()


@pytest.mark.parametrize(("types", "restored"), [("f16/f16", True), ("q8_0/q8_0", False)])
async def test_an_external_servers_kv_cache_types_are_in_the_fingerprint(
    make_proxy: MakeProxy, tmp_path: Path, types: str, restored: bool
) -> None:
    directory, state = tmp_path / "slots", tmp_path / "kept"
    directory.mkdir()
    async with FakeBackend(slot_dir=directory) as fake:
        settings = {"kv_save_dir": directory, "kv_save_every": 100, "state_dir": state}
        before = await make_proxy(fake.url, **settings)  # llama.cpp's default types
        first, name = await saved_first_turn(before, directory)
        await before.server.close()
        fake.forget_cache()  # its operator started it again, with `types` this time
        proxy = await make_proxy(fake.url, kv_cache_types=types, **settings)
        await proxy.client().responses.create(model="m", input="after", previous_response_id=first)
        assert proxy.metric("ocxproxy_kv_restores_total", outcome="ok") == int(restored)
        mismatch = proxy.metric("ocxproxy_kv_restores_total", outcome="fingerprint_mismatch")
        assert mismatch == int(not restored)
        misses = proxy.metric("ocxproxy_cache_miss_total", reason="fingerprint_mismatch")
        assert misses == int(not restored)
        assert (("restore", name, 1) in chain_actions(fake)) == restored
        assert (directory / name).exists() == restored  # no backend of those types is left
