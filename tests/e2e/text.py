"""Deterministic prompts for the real llama.cpp tests: a long opening message of a chosen
size and short follow-up questions about it."""

from __future__ import annotations

import random

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
