"""Continuations whose prefix the backend no longer had are counted by reason
(CONTRACT.md C12), from what the backends report, through the proxy's /metrics."""

from __future__ import annotations

import openai

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend

# A long first message the fake does not echo back (it repeats the last one): its cache,
# unlike llama.cpp's, holds prompts only, not what it generated.
FIRST = [
    {"role": "user", "content": "the chain's long first message " * 60},
    {"role": "user", "content": "go"},
]


def misses(proxy: ProxyHandle) -> dict[str, float]:
    found = {}
    for reason in ("evicted", "backend_restarted", "rerouted", "diverged", "truncated"):
        value = proxy.metric("ocxproxy_cache_miss_total", reason=reason)
        if value:
            found[reason] = value
    return found


async def turn(
    client: openai.AsyncOpenAI, text: str | list[dict[str, str]], prev: str | None, **kw: object
) -> str:
    response = await client.responses.create(model="m", input=text, previous_response_id=prev, **kw)
    return response.id


async def test_a_cached_chain_counts_checks_and_no_miss(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    proxy = await make_proxy(backend.url)
    client = proxy.client()
    prev = await turn(client, FIRST, None)
    for n in range(3):
        prev = await turn(client, f"turn {n}", prev)
    assert proxy.metric("ocxproxy_cache_checks_total") == 3
    assert misses(proxy) == {}


async def test_a_backend_that_lost_its_cache_is_an_eviction_and_a_changed_prompt_diverged(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    proxy = await make_proxy(backend.url)
    client = proxy.client()
    prev = await turn(client, FIRST, None, instructions="be brief")
    prev = await turn(client, "second", prev, instructions="be brief")
    backend.forget_cache()
    prev = await turn(client, "third", prev, instructions="be brief")
    assert misses(proxy) == {"evicted": 1}
    assert proxy.metric("ocxproxy_cache_missed_tokens_total", reason="evicted") > 400
    backend.forget_cache()
    await turn(client, "fourth", prev, instructions="be verbose")
    assert misses(proxy) == {"evicted": 1, "diverged": 1}
    assert proxy.metric("ocxproxy_cache_checks_total") == 3


async def test_a_backend_that_was_down_in_between_restarted(make_proxy: MakeProxy) -> None:
    first = FakeBackend()
    url = await first.start()
    port = int(url.rsplit(":", 1)[1])
    proxy = await make_proxy(url, health_interval=0.05)
    client = proxy.client()
    prev = await turn(client, FIRST, None)
    fleet = proxy.proxy.pool.fleet
    (served,) = fleet.backends
    await first.close()  # the backend goes away; the probe sees it
    await fleet.wait_for(lambda: not served.healthy, within=10)
    second = FakeBackend()  # a new process on the same address, its cache empty
    await second.start(port=port)
    try:
        await fleet.wait_for(lambda: served.healthy, within=10)
        await turn(client, "after the restart", prev)
        assert misses(proxy) == {"backend_restarted": 1}
    finally:
        await second.close()


async def test_a_chain_moved_to_another_backend_was_rerouted(make_proxy: MakeProxy) -> None:
    async with FakeBackend(name="a") as a, FakeBackend(name="b") as b:
        proxy = await make_proxy(a.url, b.url)
        client = proxy.client()
        prev = await turn(client, FIRST, None)
        home = a if a.responses_seen else b
        await home.close()  # refused: marked down, the turn goes to the other one
        await turn(client, "elsewhere", prev)
        assert misses(proxy) == {"rerouted": 1}


async def test_a_conversations_turns_are_compared_like_a_chains(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    proxy = await make_proxy(backend.url)
    client = proxy.client()
    conversation = await client.conversations.create()
    for text in (FIRST, "second", "third"):
        await client.responses.create(model="m", input=text, conversation=conversation.id)  # type: ignore[arg-type]
    assert proxy.metric("ocxproxy_cache_checks_total") == 2
    assert misses(proxy) == {}
    backend.forget_cache()
    await client.responses.create(model="m", input="fourth", conversation=conversation.id)
    assert misses(proxy) == {"evicted": 1}
    (served,) = proxy.proxy.pool.fleet.backends
    proxy.proxy.pool.fleet.restarted(served)
    backend.forget_cache()
    await client.responses.create(model="m", input="fifth", conversation=conversation.id)
    assert misses(proxy) == {"evicted": 1, "backend_restarted": 1}


async def test_a_conversation_whose_item_was_deleted_diverged(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    proxy = await make_proxy(backend.url)
    client = proxy.client()
    conversation = await client.conversations.create(items=FIRST)  # type: ignore[arg-type]
    await client.responses.create(model="m", input="first turn", conversation=conversation.id)
    items = await client.conversations.items.list(conversation.id, order="asc")
    await client.conversations.items.delete(items.data[0].id, conversation_id=conversation.id)
    await client.responses.create(model="m", input="after the delete", conversation=conversation.id)
    assert misses(proxy) == {"diverged": 1}
