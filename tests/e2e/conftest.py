"""The real llama.cpp backend (xllamacpp + SmolLM2-135M), one per test module."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest_asyncio

from ocxproxy.upstream import local

MODEL = local.default_model_path()
HAVE_LLAMA = MODEL is not None and local.is_available()
MISSING = "xllamacpp or the SmolLM2 model is not installed"
MIN_CACHED_RATIO = 0.9  # least continuation cached_tokens / input_tokens a test accepts


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llama_url() -> AsyncIterator[str]:
    assert MODEL is not None
    backend = local.LocalBackend(MODEL)
    url = await backend.start()
    try:
        yield url
    finally:
        await backend.stop()


def cached_ratio(usage: openai.types.responses.ResponseUsage | None) -> float:
    assert usage is not None and usage.input_tokens > 0
    return usage.input_tokens_details.cached_tokens / usage.input_tokens
