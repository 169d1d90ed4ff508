"""A multi-turn conversation through ocxproxy, chained with previous_response_id.

Prints, per turn, the latency and what the backend reports: input_tokens and
cached_tokens (its prefix cache reusing the history the proxy replayed byte-stable).

    python scripts/demo.py                       # starts a proxy on the embedded backend
    python scripts/demo.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import sys
import time
from collections.abc import AsyncIterator

import openai
from openai.types.responses import Response

QUESTIONS = (
    "Summarise the notes above in one sentence.",
    "Which module was mentioned first?",
    "Name one number that appears in the notes.",
    "Say goodbye in three words.",
    "What was my first question?",
    "Give the notes a title.",
)


def long_message(tokens: int, seed: int = 7) -> str:
    """Deterministic filler of roughly `tokens` SmolLM2 tokens (≈ 0.72 words a token)."""
    rng = random.Random(seed)
    words = [
        "proxy",
        "cache",
        "segment",
        "backend",
        "chain",
        "turn",
        "module",
        "snapshot",
        "spill",
        "request",
        "stream",
        "token",
        "prefix",
        "history",
        "record",
        "scope",
        "credential",
        "replay",
        "latency",
        "budget",
    ]
    out = ["Project notes:"]
    for i in range(int(tokens * 0.72)):
        out.append(rng.choice(words) if i % 9 else str(rng.randint(10, 999)))
    return " ".join(out)


@contextlib.asynccontextmanager
async def started_proxy() -> AsyncIterator[str]:
    """`ocxproxy serve` on the embedded backend, on a free port; yields its base URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ocxproxy", "serve", "--port", "0", "--zdr",
        "--log-level", "warning", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 180)).decode()
        match = re.search(r"(http://\S+/v1)", line)
        if match is None:
            raise SystemExit(f"the proxy did not start: {line!r}")
        yield match.group(1)
    finally:
        proc.terminate()
        await proc.wait()


async def converse(base_url: str, turns: int, first_tokens: int, stream: bool) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-demo", max_retries=0)
    previous: str | None = None
    print(
        f"{'turn':>4} {'latency':>9} {'input_tokens':>13} {'cached_tokens':>14} {'ratio':>6}  reply"
    )
    for turn in range(turns):
        text = long_message(first_tokens) if turn == 0 else QUESTIONS[(turn - 1) % len(QUESTIONS)]
        start = time.perf_counter()
        response: Response
        if stream:
            async with client.responses.stream(
                model="local", input=text, previous_response_id=previous, max_output_tokens=24
            ) as events:
                # (response.incomplete ends an answer cut at the 24 tokens, which the
                # helper's get_final_response() does not take)
                async for event in events:
                    if event.type in ("response.completed", "response.incomplete"):
                        response = event.response
        else:
            response = await client.responses.create(
                model="local", input=text, previous_response_id=previous, max_output_tokens=24
            )
        elapsed = time.perf_counter() - start
        usage = response.usage
        assert usage is not None
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        ratio = cached / usage.input_tokens if usage.input_tokens else 0.0
        reply = response.output_text.replace("\n", " ")[:40]
        if response.status == "incomplete":  # cut at max_output_tokens
            reply += " …"
        figures = f"{elapsed:>8.2f}s {usage.input_tokens:>13} {cached:>14} {ratio:>6.2f}"
        print(f"{turn + 1:>4} {figures}  {reply}")
        previous = response.id
    await client.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running proxy (default: start one)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--first-tokens", type=int, default=1500)
    parser.add_argument("--stream", action="store_true", help="use the SDK's stream helper")
    args = parser.parse_args()
    if args.base_url:
        await converse(args.base_url, args.turns, args.first_tokens, args.stream)
        return
    async with started_proxy() as base_url:
        print(f"proxy on the embedded backend at {base_url}")
        await converse(base_url, args.turns, args.first_tokens, args.stream)


if __name__ == "__main__":
    asyncio.run(main())
