"""A fleet of two fake backends behind one proxy: affinity, failover, recovery, admission."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from ocxproxy.aio import spawn
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.fakes.scripted import ScriptedPeer


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FakeBackend, FakeBackend]]:
    # A small delay makes concurrent first turns overlap, so placement by load shows.
    async with FakeBackend(name="a", delay=0.02) as a, FakeBackend(name="b", delay=0.02) as b:
        yield a, b


def hosts_of(marker: str, *backends: FakeBackend) -> dict[str, int]:
    """How many requests mentioning `marker` each backend received."""
    counts = {
        fb.name: sum(marker.encode() in seen.body for seen in fb.responses_seen) for fb in backends
    }
    return {name: n for name, n in counts.items() if n}


async def create(client: openai.AsyncOpenAI, *, stream: bool = False, **kwargs: Any) -> Any:
    """One turn, streamed or not; the finished response either way."""
    if not stream:
        return await client.responses.create(model="m", **kwargs)
    events = await client.responses.create(model="m", stream=True, **kwargs)
    async for event in events:
        if event.type == "response.completed":
            return event.response
    raise AssertionError("the stream ended without response.completed")


async def run_chain(
    client: openai.AsyncOpenAI, name: str, turns: range, prev: str | None = None, **kw: Any
) -> str | None:
    """Turns of a previous_response_id chain; each answer proves the full history arrived."""
    for turn in turns:
        text = f"{name} turn-{turn}"
        response = await create(client, input=text, previous_response_id=prev, **kw)
        assert response.output_text == f"echo#{2 * turn + 1}: {text}"
        prev = response.id
    return prev


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.json()


async def test_every_turn_of_a_chain_lands_on_its_backend(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend]
) -> None:
    a, b = pair
    handle = await make_proxy(a.url, b.url)
    client = handle.client()
    names = [f"chain-{i}" for i in range(6)]
    await asyncio.gather(*(run_chain(client, name, range(4)) for name in names))
    placed = [hosts_of(name + " ", a, b) for name in names]
    assert all(len(hosts) == 1 and sum(hosts.values()) == 4 for hosts in placed), placed
    assert {next(iter(hosts)) for hosts in placed} == {"a", "b"}  # the chains spread
    assert handle.metric("ocxproxy_affinity_total", result="new") == 6
    assert handle.metric("ocxproxy_affinity_total", result="hit") == 18
    assert handle.metric("ocxproxy_affinity_total", result="reroute") == 0


@pytest.mark.parametrize("keyed", [True, False], ids=["prompt_cache_key", "opening"])
async def test_full_history_requests_of_a_conversation_share_a_backend(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend], keyed: bool
) -> None:
    """Codex over HTTP: store:false, the whole history every turn, no previous_response_id;
    grouped by prompt_cache_key, or without one by how the conversation opens."""
    a, b = pair
    handle = await make_proxy(a.url, b.url)
    client = handle.client()

    async def session(i: int) -> list[tuple[int, int]]:
        opening = "You are a coding agent." if keyed else f"Opening of session {i}."
        history: list[dict[str, Any]] = [{"role": "user", "content": opening}]
        extra = {"prompt_cache_key": f"session-{i}"} if keyed else {}
        usages = []
        for turn in range(4):
            history.append({"role": "user", "content": f"session-{i} turn-{turn}"})
            response = await client.responses.create(model="m", input=history, store=False, **extra)  # type: ignore[call-overload]
            assert response.output_text.startswith(f"echo#{len(history)}:")
            history.append({"role": "assistant", "content": response.output_text})
            usage = response.usage
            assert usage is not None
            usages.append((usage.input_tokens, usage.input_tokens_details.cached_tokens))
        return usages

    results = await asyncio.gather(*(session(i) for i in range(4)))
    placed = [hosts_of(f"session-{i} turn-0", a, b) for i in range(4)]
    assert all(len(hosts) == 1 and sum(hosts.values()) == 4 for hosts in placed), placed
    assert {next(iter(hosts)) for hosts in placed} == {"a", "b"}
    for usages in results:  # the backend's (simulated) prefix cache holds each last turn
        for (before, _), (_, cached) in itertools.pairwise(usages):
            assert cached >= before - 1, usages
    assert handle.proxy.pool.fleet.stats().keys == 4


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_killed_backends_chains_move_with_their_full_history(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend], stream: bool
) -> None:
    a, b = pair
    handle = await make_proxy(a.url, b.url)
    client = handle.client()
    names = [f"chain-{i}" for i in range(4)]
    prevs = await asyncio.gather(
        *(run_chain(client, name, range(2), stream=stream) for name in names)
    )
    on_a = [name for name in names if hosts_of(name + " ", a, b) == {"a": 2}]
    assert on_a and len(on_a) < len(names)

    await a.close()  # no request in flight; none of the later ones may fail
    await asyncio.gather(
        *(
            run_chain(client, name, range(2, 5), prev, stream=stream)
            for name, prev in zip(names, prevs, strict=True)
        )
    )
    for name in on_a:
        assert hosts_of(name + " ", a, b) == {"a": 2, "b": 3}
        # The first turn on b carried the whole chain: 5 items before its own.
        first_on_b = next(s.json for s in b.responses_seen if f"{name} turn-2".encode() in s.body)
        assert len(first_on_b["input"]) == 5
    assert not handle.proxy.pool.backends[0].healthy
    assert handle.metric("ocxproxy_backend_up", backend=a.url) == 0
    assert handle.metric("ocxproxy_affinity_total", result="reroute") == len(on_a)


async def test_recovery_is_detected_by_the_probe_and_readyz_follows(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend]
) -> None:
    a, b = pair
    handle = await make_proxy(a.url, b.url, health_interval=0.05)
    pool = handle.proxy.pool
    assert (await get_json(handle.url + "/readyz"))[0] == 200
    ports = [int(fb.url.rsplit(":", 1)[1]) for fb in pair]

    await a.close()
    await pool.fleet.wait_for(lambda: not pool.backends[0].healthy)
    status, body = await get_json(handle.url + "/readyz")
    assert status == 200 and body["backends"] == {a.url: "down", b.url: "up"}

    await b.close()
    await pool.fleet.wait_for(lambda: not pool.backends[1].healthy)
    status, body = await get_json(handle.url + "/readyz")
    assert status == 503 and body["status"] == "not ready"

    async with FakeBackend(name="a2") as restarted:
        await restarted.close()
        await restarted.start(port=ports[0])
        await pool.fleet.wait_for(lambda: pool.backends[0].healthy)
        status, body = await get_json(handle.url + "/readyz")
        assert status == 200 and body["backends"] == {a.url: "up", b.url: "down"}
        assert handle.metric("ocxproxy_backend_up", backend=a.url) == 1
        response = await handle.client().responses.create(model="m", input="back")
        assert response.output_text == "echo#1: back"
        assert len(restarted.responses_seen) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_all_backends_down_fails_fast_in_openai_shape(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend], stream: bool
) -> None:
    a, b = pair
    handle = await make_proxy(a.url, b.url)
    await a.close()
    await b.close()
    body = {"model": "m", "input": "anyone?", "stream": stream}
    async with aiohttp.ClientSession() as http:
        for expected in (502, 503):  # found dead, then known dead
            start = time.monotonic()
            async with http.post(handle.base_url + "/responses", json=body) as resp:
                assert resp.status == expected
                assert resp.headers["Content-Type"].startswith("application/json")
                error = (await resp.json())["error"]
            assert time.monotonic() - start < 2.0
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "server_error"
            assert error["code"] in ("upstream_unreachable", "no_backend_available")


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        ({"max_concurrency": 1}, "total"),
        ({"max_concurrency_per_backend": 1}, "backend"),
    ],
)
async def test_past_the_admission_bound_is_429(
    make_proxy: MakeProxy, backend: FakeBackend, config: dict[str, int], limit: str
) -> None:
    handle = await make_proxy(backend.url, admission_timeout=0.05, **config)
    client = handle.client()
    backend.stall_next(0.5)
    held = spawn(client.responses.create(model="m", input="slow"), name="held")
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    async with (
        aiohttp.ClientSession() as http,
        http.post(handle.base_url + "/responses", json={"model": "m", "input": "x"}) as resp,
    ):
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    with pytest.raises(openai.RateLimitError):
        await client.responses.create(model="m", input="y")
    assert (await held).output_text == "echo#1: slow"
    assert len(backend.responses_seen) == 1  # rejected requests never reached it
    assert handle.metric("ocxproxy_admission_rejected_total", limit=limit) == 2
    assert handle.proxy.pool.fleet.stats().in_flight == 0


async def test_a_short_wait_for_a_slot_is_not_an_error(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url, max_concurrency=1, admission_timeout=3.0)
    client = handle.client()
    backend.stall_next(0.2)
    outputs = await asyncio.gather(
        *(client.responses.create(model="m", input=f"q{i}") for i in range(2))
    )
    assert sorted(r.output_text for r in outputs) == ["echo#1: q0", "echo#1: q1"]
    assert handle.metric("ocxproxy_admission_rejected_total", limit="total") == 0


async def test_a_full_home_spills_over_to_another_backend(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend]
) -> None:
    a, b = pair
    handle = await make_proxy(a.url, b.url, max_concurrency_per_backend=1, admission_timeout=0.05)
    client = handle.client()
    for fb in pair:
        fb.stall_next(0.5)
    kwargs: Any = {"model": "m", "extra_body": {"prompt_cache_key": "k"}}
    held = spawn(client.responses.create(input="first", **kwargs), name="held")
    fleet = handle.proxy.pool.fleet
    await fleet.wait_for(lambda: fleet.in_flight == 1)
    second = await client.responses.create(input="second", **kwargs)  # home is busy
    assert second.output_text == "echo#1: second"
    await held
    assert hosts_of("first", a, b).keys() != hosts_of("second", a, b).keys()
    assert handle.metric("ocxproxy_affinity_total", result="reroute") == 1


async def test_a_stream_is_never_retried_once_it_started(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend]
) -> None:
    a, b = pair
    handle = await make_proxy(a.url, b.url)
    for fb in pair:
        fb.hang_up_next(after_events=3)
    body = {"model": "m", "input": "cut", "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(handle.base_url + "/responses", json=body) as resp,
    ):
        assert resp.status == 200
        raw = await resp.read()
    assert b"response.created" in raw and b"response.completed" not in raw
    assert len(a.responses_seen) + len(b.responses_seen) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_post_the_backend_read_and_dropped_is_not_sent_again(
    make_proxy: MakeProxy, backend: FakeBackend, stream: bool
) -> None:
    """RFC 9110 §9.2.2: the backend may have acted on it (and a generation may be what
    crashed it), so the proxy answers 502 instead of repeating it, here or elsewhere."""
    async with ScriptedPeer(None) as dropper:  # reads each request, then closes
        handle = await make_proxy(dropper.url, backend.url)
        pool = handle.proxy.pool
        pool.fleet._remember("pck:k", pool.backends[0])  # make the dropper its home
        body = {"model": "m", "input": "hi", "stream": stream, "prompt_cache_key": "k"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(handle.base_url + "/responses", json=body) as resp,
        ):
            assert resp.status == 502
            assert resp.headers["Content-Type"].startswith("application/json")
            error = (await resp.json())["error"]
    assert error["type"] == "server_error" and error["code"] == "upstream_disconnected"
    assert "not sent again" in error["message"]
    assert len(dropper.requests) == 1 and b'"hi"' in dropper.bodies[0]
    assert backend.seen == []
    assert pool.backends[1].healthy


async def test_a_post_with_an_idempotency_key_is_sent_again_to_another_backend(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    async with ScriptedPeer(None) as dropper:
        handle = await make_proxy(dropper.url, backend.url)
        pool = handle.proxy.pool
        pool.fleet._remember("pck:k", pool.backends[0])
        response = await handle.client().responses.create(
            model="m",
            input="hi",
            extra_body={"prompt_cache_key": "k"},
            extra_headers={"Idempotency-Key": "key-1"},
        )
    assert response.output_text == "echo#1: hi"
    assert len(dropper.requests) == 1  # never twice where it broke
    assert len(backend.responses_seen) == 1
    assert handle.metric("ocxproxy_affinity_total", result="reroute") == 1


async def test_a_post_with_an_idempotency_key_and_no_other_backend_is_a_502(
    make_proxy: MakeProxy,
) -> None:
    async with ScriptedPeer(None) as dropper:
        handle = await make_proxy(dropper.url)
        with pytest.raises(openai.InternalServerError) as caught:
            await handle.client().responses.create(
                model="m", input="hi", extra_headers={"Idempotency-Key": "key-2"}
            )
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_disconnected"
    assert len(dropper.requests) == 1


async def test_an_idempotent_request_is_redialed_once_then_the_backend_is_down(
    make_proxy: MakeProxy,
) -> None:
    async with ScriptedPeer(None) as dropper, aiohttp.ClientSession() as http:
        handle = await make_proxy(dropper.url)
        async with http.get(handle.base_url + "/models") as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "upstream_unreachable"
    assert [r.split(b" ")[:2] for r in dropper.requests] == [[b"GET", b"/v1/models"]] * 2
    assert not handle.proxy.pool.backends[0].healthy


async def test_round_robin_routing_ignores_affinity(
    make_proxy: MakeProxy, pair: tuple[FakeBackend, FakeBackend]
) -> None:
    a, b = pair
    handle = await make_proxy(a.url, b.url, routing="round-robin")
    await run_chain(handle.client(), "rr", range(4))
    assert hosts_of("rr ", a, b) == {"a": 2, "b": 2}
    assert handle.metric("ocxproxy_affinity_total", result="hit") == 0


def test_metrics_render_the_fleet_series() -> None:
    from ocxproxy.metrics import Metrics

    text = Metrics().render().decode()
    for name in ("ocxproxy_affinity_total", "ocxproxy_backend_up"):
        assert f"# TYPE {name.removesuffix('_total')}" in text


IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What is in this image?"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
        ],
    }
]


@pytest.mark.parametrize("n_backends", [1, 2])
async def test_a_bad_request_does_not_take_the_fleet_out(
    make_proxy: MakeProxy, n_backends: int
) -> None:
    """A backend that cannot take images answers 500 to the same body each time: the
    SDK's call with its 2 retries is 3 answers of 500, which used to eject the backend
    (the only one: 503 `no_backend_available` for the next valid requests). The
    repeated body is the request's fault; the next valid request gets 200."""
    async with contextlib.AsyncExitStack() as stack:
        backends = [
            await stack.enter_async_context(FakeBackend(name=f"b{i}", rejects_images=True))
            for i in range(n_backends)
        ]
        # Probes on: only a probe would bring an ejected backend back (in 30 s).
        handle = await make_proxy(*(b.url for b in backends), health_interval=30)
        retrying = handle.client().with_options(max_retries=2, timeout=10)
        with pytest.raises(openai.InternalServerError):
            await retrying.responses.create(model="m", input=IMAGE)  # type: ignore[arg-type]
        assert sum(len(b.responses_seen) for b in backends) == 3
        client = handle.client()  # no retries: a 503 would show
        for i in range(3):
            response = await client.responses.create(model="m", input=f"valid {i}")
            assert response.status == "completed"
        assert all(b.healthy for b in handle.proxy.pool.fleet.backends)
        assert handle.metric("ocxproxy_backend_request_faults_total") == 2


async def test_passive_evidence_never_ejects_the_last_backend(make_proxy: MakeProxy) -> None:
    """Different bodies failing with 5xx on the only backend: it stays in (its answers,
    errors included, still reach the client) rather than every request getting 503."""
    async with FakeBackend() as only:
        handle = await make_proxy(only.url, health_interval=30)
        client = handle.client()
        for i in range(4):
            only.fail_next(500)
            with pytest.raises(openai.InternalServerError):
                await client.responses.create(model="m", input=f"fails {i}")
        response = await client.responses.create(model="m", input="fine")
        assert response.status == "completed"
        assert (
            handle.metric("ocxproxy_backend_ejections_total", backend=only.url, outcome="kept") >= 1
        )
