"""The context window against the real llama.cpp server with a small context
(CONTRACT.md C10): learned from its /props, counted with its own template and tokenizer;
`truncation: "disabled"` refuses an overflow before the backend generates anything;
`"auto"` carries a chain far past the window with no context error, and the turns after a
truncation step hit the prefix cache again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from ocxproxy.upstream import local
from tests.conftest import MakeProxy, ProxyHandle, unavailable
from tests.e2e.conftest import HAVE_LLAMA, MIN_CACHED_RATIO, MISSING, MODEL, cached_ratio
from tests.e2e.text import long_message

pytestmark = [pytest.mark.llama, pytest.mark.timeout(1200)]  # ~45 turns: minutes if loaded

if not HAVE_LLAMA:
    unavailable(MISSING)

CTX = 1024


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small_llama() -> AsyncIterator[str]:
    assert MODEL is not None
    backend = local.LocalBackend(MODEL, ctx=CTX)
    url = await backend.start()
    try:
        yield url
    finally:
        await backend.stop()


async def windowed(make_proxy: MakeProxy, url: str) -> ProxyHandle:
    proxy = await make_proxy(url, health_interval=0.2)
    async with asyncio.timeout(10):
        while not proxy.metric("ocxproxy_backend_context_window_tokens", backend=url):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert proxy.metric("ocxproxy_backend_context_window_tokens", backend=url) == CTX
    return proxy


def generations(proxy: ProxyHandle, url: str) -> float:
    return sum(
        proxy.metric("ocxproxy_upstream_requests_total", backend=url, outcome=outcome)
        for outcome in ("2xx", "4xx", "5xx")
    )


async def test_disabled_refuses_the_overflow_before_generation(
    make_proxy: MakeProxy, small_llama: str
) -> None:
    proxy = await windowed(make_proxy, small_llama)
    client = proxy.client()
    previous = None
    for turn in range(20):
        before = generations(proxy, small_llama)
        try:
            answer = await client.responses.create(
                model="local",
                input=long_message(150, seed=turn),
                previous_response_id=previous,
                max_output_tokens=8,
            )
        except openai.BadRequestError as error:
            assert error.code == "context_length_exceeded"
            assert error.param == "input"
            assert generations(proxy, small_llama) == before  # llama.cpp never saw it
            assert proxy.metric("ocxproxy_token_counts_total", backend=small_llama) >= 1
            break
        assert answer.usage is not None and answer.usage.input_tokens < CTX
        previous = answer.id
    else:
        pytest.fail("the chain never reached the window")
    assert turn >= 3


async def test_auto_carries_a_chain_three_times_the_window(
    make_proxy: MakeProxy, small_llama: str
) -> None:
    proxy = await windowed(make_proxy, small_llama)
    client = proxy.client()
    previous = None
    chain_tokens = 0  # what the input would be without truncation
    ratios: list[float] = []
    steps_before = 0.0
    after_step = False
    turns = last_input = 0
    while chain_tokens < 3 * CTX:
        answer = await client.responses.create(
            model="local",
            input=long_message(40, seed=turns),
            previous_response_id=previous,
            max_output_tokens=16,
            truncation="auto",
        )
        assert answer.status in ("completed", "incomplete")
        assert answer.usage is not None and answer.usage.input_tokens < CTX
        steps = proxy.metric("ocxproxy_truncation_steps_total")
        turns += 1
        if steps == steps_before:  # no step: the input grew by this turn's own tokens
            chain_tokens += answer.usage.input_tokens - last_input
            if after_step:
                ratios.append(cached_ratio(answer.usage))
        else:
            chain_tokens += chain_tokens // turns  # about one turn's growth
        last_input = answer.usage.input_tokens
        after_step = after_step or steps > 0
        steps_before = steps
        previous = answer.id
    assert proxy.metric("ocxproxy_truncation_steps_total") >= 2
    assert proxy.metric("ocxproxy_context_length_exceeded_total", truncation="auto") == 0
    # Between steps, the prefix is the same: the backend's cache serves it.
    assert ratios and sum(r >= MIN_CACHED_RATIO for r in ratios) / len(ratios) >= 0.8, ratios
