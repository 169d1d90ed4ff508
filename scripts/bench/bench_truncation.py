"""`truncation: "auto"` on the real llama.cpp backend: a chain grown far past a small
context window, turn after turn, against ocxproxy in this process.

Reports the turns that failed with a context error (target: 0), the truncation steps,
and of the continuation turns after the first step that kept their drop point, the
share whose cached_tokens / input_tokens is at least 0.9 (target: ≥ 90 %); also the
share over every turn after the first step, the steps included (each step is one
cache miss by design). A chain's turn adds ~--turn-tokens of user text and a
--max-output answer, so a step (a quarter of the window) lasts several turns.
With --tool-loop the chain is one agentic turn: a user message, then every turn a tool
call and its ~--turn-tokens output (sent by the client, as a tool loop's are), so the
cut lands inside the turn, after its user message.

    python scripts/bench/bench_truncation.py                 # 100 turns, ctx 2048
    python scripts/bench/bench_truncation.py --turns 20 --ctx 1024
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from ocxproxy.config import Config
from ocxproxy.server import build_app, listen
from ocxproxy.upstream import local

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.e2e.text import long_message

RATIO = 0.9
TOOLS: Any = [{"type": "function", "name": "read", "parameters": {"type": "object"}}]


async def run(args: argparse.Namespace) -> None:
    model = local.default_model_path()
    if model is None or not local.is_available():
        sys.exit(local.MISSING_MESSAGE)
    backend = local.LocalBackend(model, ctx=args.ctx)
    url = await backend.start()
    with tempfile.TemporaryDirectory() as state:
        app = build_app(Config(upstream=(url,), state_dir=Path(state), health_interval=1.0))
        server = await listen(app, "127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-bench", max_retries=0)
        try:
            await measure(client, app, url, args)
        finally:
            await client.close()
            await server.close()
            await backend.stop()


async def measure(
    client: openai.AsyncOpenAI, app: object, url: str, args: argparse.Namespace
) -> None:
    from ocxproxy.http.context import PROXY

    proxy = app[PROXY]  # type: ignore[index]
    metrics = proxy.metrics.registry
    while proxy.pool.window_for(None) is None:  # noqa: ASYNC110 (the health probe learns it)
        await asyncio.sleep(0.1)
    print(f"window: {proxy.pool.window_for(None)[1].tokens} tokens; {args.turns} turns")
    previous = None
    errors = 0
    steps = 0.0
    kept: list[float] = []  # ratios of turns that kept their drop point, after the first step
    every: list[float] = []  # ratios of every turn after the first step
    max_input = 0
    started = time.perf_counter()
    for turn in range(args.turns):
        text = long_message(args.turn_tokens, seed=turn)
        turn_input: Any = text
        if args.tool_loop and turn:
            call_id = f"call_{turn}"
            turn_input = [
                {"type": "function_call", "call_id": call_id, "name": "read", "arguments": "{}"},
                {"type": "function_call_output", "call_id": call_id, "output": text},
            ]
        try:
            answer = await client.responses.create(
                model="local",
                input=turn_input,
                previous_response_id=previous,
                max_output_tokens=args.max_output,
                truncation="auto",
                **({"tools": TOOLS} if args.tool_loop else {}),
            )
        except openai.APIStatusError as error:
            errors += 1
            print(f"turn {turn}: {error.status_code} {error.code}", flush=True)
            continue
        usage = answer.usage
        assert usage is not None
        now = metrics.get_sample_value("ocxproxy_truncation_steps_total") or 0.0
        ratio = usage.input_tokens_details.cached_tokens / max(1, usage.input_tokens)
        if steps > 0 or now > 0:
            every.append(ratio)
            if now == steps:
                kept.append(ratio)
        steps = now
        max_input = max(max_input, usage.input_tokens)
        previous = answer.id
        if args.verbose:
            print(f"turn {turn}: input {usage.input_tokens} cached {ratio:.2f} steps {now:.0f}")
    elapsed = time.perf_counter() - started
    counts = metrics.get_sample_value("ocxproxy_token_counts_total", {"backend": url}) or 0.0

    def share(ratios: list[float]) -> str:
        if not ratios:
            return "n/a"
        hits = sum(r >= RATIO for r in ratios)
        return f"{hits}/{len(ratios)} = {100 * hits / len(ratios):.0f} %"

    print(f"context errors: {errors}")
    print(f"truncation steps: {steps:.0f}; token-count round trips: {counts:.0f}")
    print(f"largest input: {max_input} tokens")
    print(f"turns after a step that kept the drop point, cached/input >= {RATIO}: {share(kept)}")
    print(f"every turn after the first step, steps included: {share(every)}")
    print(f"{args.turns} turns in {elapsed:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--ctx", type=int, default=2048, help="llama.cpp context size")
    parser.add_argument("--turn-tokens", type=int, default=40, help="user text per turn")
    parser.add_argument("--max-output", type=int, default=16)
    parser.add_argument("--tool-loop", action="store_true", help="one agentic turn")
    parser.add_argument("--verbose", action="store_true")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
