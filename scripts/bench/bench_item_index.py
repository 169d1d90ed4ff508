"""What the item-id index (for `item_reference`) costs: memory per item, and a lookup's time.

Puts N turns into a memory-only Store twice, once with each turn's item ids (its output
message, and with --ids 2 an input reasoning item too) and once without, and reports the
difference in traced memory per indexed item: the index slot, the id string kept with the
segment, and its span. Then times Store.find_item_nowait + item_bytes on the full store.

    .venv/bin/python scripts/bench/bench_item_index.py [--turns 100000] [--ids 1|2] [--resend L]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import secrets
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import orjson

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from ocxproxy.continuation.record import build_turn  # noqa: E402
from ocxproxy.model import NO_ITEMS  # noqa: E402
from ocxproxy.store import Store  # noqa: E402


def answer(text: str) -> dict[str, Any]:
    return {
        "id": f"msg_{secrets.token_hex(24)}",  # as long as OpenAI's ids
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


def make_turns(n: int, ids: int, resend: int) -> list[Any]:
    """n turns. With `resend` L, conversations of L turns as the AI SDK sends them: each
    turn's input is the whole history, its earlier answers by reference (so the segment
    holds them again, with their ids, decoded afresh as a resolved reference is)."""
    turns = []
    history: list[Any] = []
    for i in range(n):
        if resend and i % resend == 0:
            history = []
        inputs: list[Any] = [*history, {"role": "user", "content": f"question {i}"}]
        if ids > 1:
            inputs.append({"type": "reasoning", "id": f"rs_{secrets.token_hex(24)}", "summary": []})
        output = answer(f"answer {i}")
        response = {"id": f"resp_{secrets.token_hex(24)}", "object": "response", "output": [output]}
        turns.append(
            build_turn(
                response=response,
                scope="scope",
                durable=False,
                tail=[orjson.dumps(item) for item in inputs],
                tail_items=[orjson.loads(orjson.dumps(item)) for item in inputs],
            )
        )
        if resend:
            history = [*inputs, output]
    return turns


def stored_bytes(n: int, per: int, resend: int, *, indexed: bool) -> tuple[int, Store]:
    """Traced memory after building n turns and putting them into a store, their item ids
    kept (segment metadata and index) or dropped before the put."""
    gc.collect()
    tracemalloc.start()
    store = Store(max_resident_bytes=1 << 40, max_entries=n + 1, ttl=1e9)
    turns = make_turns(n, per, resend)
    for turn in turns:
        if not indexed:
            object.__setattr__(turn, "item_ids", NO_ITEMS)
        store.put(turn, None)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del turns
    return held, store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--ids", type=int, choices=(1, 2), default=1, help="new ids per turn")
    parser.add_argument(
        "--resend", type=int, default=0, metavar="L", help="AI SDK-style conversations of L turns"
    )
    args = parser.parse_args()
    n, per, resend = args.turns, args.ids, args.resend
    without, _ = stored_bytes(n, per, resend, indexed=False)
    with_ids, store = stored_bytes(n, per, resend, indexed=True)
    items = store.items.entries()
    shape = f", conversations of {resend} turns resent in full" if resend else ""
    print(f"{n:,} turns{shape}: {items:,} indexed items, {len(store.items):,} distinct ids")
    print(f"turns + store, with item ids:    {with_ids / 2**20:8.1f} MiB")
    print(f"turns + store, without item ids: {without / 2**20:8.1f} MiB")
    print(f"item-id cost per item:  {(with_ids - without) / items:8.1f} B (index slot, id, span)")
    print(f"(ids of {len('msg_') + 48} characters: a str of {sys.getsizeof('msg_' + 48 * 'a')} B)")

    ids = [s.item_ids.ids[0] for s in (r.segments[-1] for r in store._records.values())]
    picks = [ids[i] for i in range(0, len(ids), max(1, len(ids) // 2000))]

    async def lookups() -> float:
        start = time.perf_counter()
        for item_id in picks:
            record = store.find_item_nowait("scope", item_id)
            await store.item_bytes([(record, item_id)])
        return (time.perf_counter() - start) / len(picks)

    print(f"find_item + item_bytes: {asyncio.run(lookups()) * 1e6:8.2f} µs per reference")


if __name__ == "__main__":
    main()
