"""Compaction on the real llama.cpp backend (xllamacpp + SmolLM2-135M, CONTRACT.md C10):
the model writes a real summary, the summary request reuses the chain's prefix cache, and
a chain continued from the compaction forwards only the compacted window."""

from __future__ import annotations

import pytest

from ocxproxy.continuation.compaction import SUMMARY_PREFIX
from ocxproxy.http.context import scope_of
from tests.conftest import MakeProxy, ProxyHandle, unavailable
from tests.e2e.conftest import HAVE_LLAMA, MIN_CACHED_RATIO, MISSING, cached_ratio
from tests.e2e.text import QUESTIONS, long_message

pytestmark = [pytest.mark.llama, pytest.mark.timeout(300)]

if not HAVE_LLAMA:
    unavailable(MISSING)

KEY = "sk-test-a"


@pytest.fixture
async def llama_proxy(make_proxy: MakeProxy, llama_url: str) -> ProxyHandle:
    return await make_proxy(llama_url)


def opened_summary(handle: ProxyHandle, token: str) -> str:
    message = handle.proxy.sealer.open(token, scope_of({"Authorization": f"Bearer {KEY}"}))
    text = message.decode()
    assert SUMMARY_PREFIX.replace("\n", "\\n") in text
    return text


async def test_a_chain_compacts_into_a_real_summary(llama_proxy: ProxyHandle) -> None:
    client = llama_proxy.client(KEY)
    first = await client.responses.create(
        model="local", input=long_message(1200, seed=3), max_output_tokens=16
    )
    second = await client.responses.create(
        model="local", input=QUESTIONS[0], previous_response_id=first.id, max_output_tokens=16
    )
    assert second.usage is not None
    compaction = await client.responses.create(
        model="local",
        previous_response_id=second.id,
        input=[{"type": "compaction_trigger"}],
        max_output_tokens=48,
    )
    assert [item.type for item in compaction.output] == ["compaction"]
    item = compaction.output[0].model_dump()
    assert len(opened_summary(llama_proxy, item["encrypted_content"])) > 60
    usage = compaction.usage
    assert usage is not None and usage.output_tokens > 0
    # The summary request is the chain's prefix plus the prompt: the cache holds the rest.
    assert usage.input_tokens > second.usage.input_tokens
    assert cached_ratio(usage) >= MIN_CACHED_RATIO, usage
    # Continued from the compaction, the chain forwards only the compacted window.
    after = await client.responses.create(
        model="local", input=QUESTIONS[1], previous_response_id=compaction.id, max_output_tokens=16
    )
    assert after.status in ("completed", "incomplete")
    assert after.usage is not None and after.usage.input_tokens < usage.input_tokens


async def test_compact_endpoint_on_the_embedded_model(llama_proxy: ProxyHandle) -> None:
    client = llama_proxy.client(KEY)
    history = [
        {"role": "user", "content": long_message(600, seed=4)},
        {"role": "user", "content": QUESTIONS[2]},
    ]
    compacted = await client.responses.compact(model="local", input=history)  # type: ignore[arg-type]
    assert compacted.object == "response.compaction"
    assert compacted.output[-1].type == "compaction"
    token = compacted.output[-1].model_dump()["encrypted_content"]
    assert len(opened_summary(llama_proxy, token)) > 60
    window = [o.model_dump(exclude_none=True, warnings=False) for o in compacted.output]
    answer = await client.responses.create(
        model="local",
        input=[*window, {"role": "user", "content": QUESTIONS[3]}],
        store=False,
        max_output_tokens=16,
    )
    assert answer.output_text
