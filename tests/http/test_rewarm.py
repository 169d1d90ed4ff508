"""Re-warm (CONTRACT.md C12): a backend with no save API that came back gets its most
recent chains replayed with a one-token answer, newest first, within the budget, so their
next turns find them cached."""

from __future__ import annotations

import asyncio

import orjson

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend


def chain_start(n: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"chain {n}'s long first message " * 60},
        {"role": "user", "content": "go"},
    ]


async def chains(proxy: ProxyHandle, count: int) -> list[str]:
    client = proxy.client()
    ids = []
    for n in range(count):
        first = await client.responses.create(model="m", input=chain_start(n))  # type: ignore[arg-type]
        second = await client.responses.create(
            model="m", input="more", previous_response_id=first.id
        )
        ids.append(second.id)
    return ids


async def replayed(proxy: ProxyHandle, count: int) -> None:
    for _ in range(200):
        if proxy.metric("ocxproxy_rewarm_total", outcome="warmed") >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not re-warmed")


async def back_up(proxy: ProxyHandle, fake: FakeBackend) -> None:
    """The backend comes back with an empty cache, as the health probe sees it."""
    fleet = proxy.proxy.pool.fleet
    (backend,) = fleet.backends
    fake.forget_cache()
    fleet.mark_down(backend, "restarting")
    fleet.mark_up(backend)


async def test_the_newest_chains_are_replayed_and_their_next_turns_hit(
    make_proxy: MakeProxy,
) -> None:
    async with FakeBackend() as fake:
        proxy = await make_proxy(fake.url, rewarm_budget=100_000)
        ids = await chains(proxy, 3)
        before = len(fake.responses_seen)
        await back_up(proxy, fake)
        await replayed(proxy, 3)
        replays = [orjson.loads(seen.body) for seen in fake.responses_seen[before:]]
        assert [r["max_output_tokens"] for r in replays] == [1, 1, 1]
        firsts = [r["input"][0]["content"][:8] for r in replays]
        assert firsts == ["chain 2'", "chain 1'", "chain 0'"]  # newest first, once each
        assert proxy.metric("ocxproxy_rewarm_total", outcome="warmed") == 3
        client = proxy.client()
        for response_id in ids:
            await client.responses.create(
                model="m", input="after", previous_response_id=response_id
            )
        assert proxy.metric("ocxproxy_cache_checks_total") == 6
        assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0


async def test_the_budget_bounds_the_replays(make_proxy: MakeProxy) -> None:
    async with FakeBackend() as fake:
        proxy = await make_proxy(fake.url, rewarm_budget=700)  # one chain is ~470 tokens
        ids = await chains(proxy, 3)
        await back_up(proxy, fake)
        await replayed(proxy, 1)
        assert proxy.metric("ocxproxy_rewarm_total", outcome="warmed") == 1
        client = proxy.client()
        for response_id in ids:
            await client.responses.create(
                model="m", input="after", previous_response_id=response_id
            )
        assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 2


async def test_a_conversation_is_replayed_like_a_chain(make_proxy: MakeProxy) -> None:
    async with FakeBackend() as fake:
        proxy = await make_proxy(fake.url, rewarm_budget=100_000)
        (chain,) = await chains(proxy, 1)
        client = proxy.client()
        conversation = await client.conversations.create()
        for text in (chain_start(1), "more"):
            await client.responses.create(model="m", input=text, conversation=conversation.id)  # type: ignore[arg-type]
        before = len(fake.responses_seen)
        # (the fake caches prompts, not outputs: a turn may fall short by its last output)
        evicted = proxy.metric("ocxproxy_cache_miss_total", reason="evicted")
        await back_up(proxy, fake)
        await replayed(proxy, 2)
        replays = [orjson.loads(seen.body) for seen in fake.responses_seen[before:]]
        firsts = [r["input"][0]["content"][:8] for r in replays]
        assert firsts == ["chain 1'", "chain 0'"]  # the conversation is the newest
        assert [r["model"] for r in replays] == ["m", "m"]
        assert len(replays[0]["input"]) == 5  # its items: two turns' input and output
        await client.responses.create(model="m", input="after", previous_response_id=chain)
        await client.responses.create(model="m", input="after", conversation=conversation.id)
        assert proxy.metric("ocxproxy_cache_checks_total") == 4  # both turns before too
        assert proxy.metric("ocxproxy_cache_miss_total", reason="backend_restarted") == 0
        assert proxy.metric("ocxproxy_cache_miss_total", reason="evicted") == evicted


async def test_a_conversation_edited_since_its_last_turn_is_not_replayed(
    make_proxy: MakeProxy,
) -> None:
    async with FakeBackend() as fake:
        proxy = await make_proxy(fake.url, rewarm_budget=100_000)
        await chains(proxy, 1)
        client = proxy.client()
        conversation = await client.conversations.create()
        await client.responses.create(model="m", input=chain_start(1), conversation=conversation.id)  # type: ignore[arg-type]
        items = await client.conversations.items.list(conversation.id, order="asc")
        await client.conversations.items.delete(items.data[0].id, conversation_id=conversation.id)
        before = len(fake.responses_seen)
        await back_up(proxy, fake)
        await replayed(proxy, 1)
        await asyncio.sleep(0.2)  # (a replay of the conversation would come before the chain's)
        replays = [orjson.loads(seen.body) for seen in fake.responses_seen[before:]]
        assert [r["input"][0]["content"][:8] for r in replays] == ["chain 0'"]
