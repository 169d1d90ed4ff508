"""The prefix cache around a compaction, on the embedded llama.cpp backend (SmolLM2).

A chain of about --tokens tokens (a long first message, then a few short turns), then a
create whose input is a compaction trigger (`previous_response_id`: the chain), then two
turns continued from the compaction. Prints, per request, input and cached tokens as the
backend reports them: the compaction's own summary request extends the chain's prompt, so
its cache should hold nearly all of it; the first turn after it forwards the compacted
window, a new prefix (the proxy does not pre-warm it); the second one extends that.

    python scripts/bench/bench_compaction_cache.py                # starts a proxy
    python scripts/bench/bench_compaction_cache.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo import QUESTIONS, long_message, started_proxy


def ratio(response: Any) -> str:
    usage = response.usage
    cached = usage.input_tokens_details.cached_tokens
    return f"{usage.input_tokens:>6} {cached:>7} {cached / max(usage.input_tokens, 1):>7.2f}"


async def measure(base_url: str, tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-bench", max_retries=0)
    print(f"{'request':<32} {'input':>6} {'cached':>7} {'ratio':>7}")
    turn = await client.responses.create(
        model="local", input=long_message(tokens), max_output_tokens=16
    )
    print(f"{'chain, first turn':<32} {ratio(turn)}")
    for question in QUESTIONS[:3]:
        turn = await client.responses.create(
            model="local", input=question, previous_response_id=turn.id, max_output_tokens=16
        )
        print(f"{'chain, continuation':<32} {ratio(turn)}")
    compaction = await client.responses.create(
        model="local",
        input=[{"type": "compaction_trigger"}],
        previous_response_id=turn.id,
        max_output_tokens=96,
    )
    print(f"{'compaction (summary request)':<32} {ratio(compaction)}")
    turn = compaction
    for label in ("after compaction, 1st turn", "after compaction, 2nd turn"):
        turn = await client.responses.create(
            model="local", input=QUESTIONS[4], previous_response_id=turn.id, max_output_tokens=16
        )
        print(f"{label:<32} {ratio(turn)}")
    await client.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", help="a running proxy (default: start one)")
    parser.add_argument("--tokens", type=int, default=3000, help="the first message's size")
    args = parser.parse_args()
    if args.base_url:
        await measure(args.base_url, args.tokens)
        return
    async with started_proxy() as base_url:
        await measure(base_url, args.tokens)


if __name__ == "__main__":
    asyncio.run(main())
