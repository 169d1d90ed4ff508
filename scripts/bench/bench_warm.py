"""Warm resume on the embedded llama.cpp backend, against ocxproxy in this process: a chain
whose first message is ~--tokens tokens, then its continuation after the backend was
killed (-9) and restarted by the watchdog, and after a graceful restart of the whole
proxy on the same state dir. With `--rewarm N`: instead, N chains on a llama.cpp server
with no save API (a second process, the proxy's --upstream, --rewarm-budget on), the
server killed and started again, and the first continuation of each chain once the
re-warm is done.

Prints: the continuation's latency after the kill ÷ the cold first turn (target ≤ 0.25)
and its cached/input (≥ 0.9); the same after the proxy's restart; the save cost on the
reply path (p50 of short continuations with a save after every turn against saves off,
alternated); bytes saved per token; restore seconds.

    python scripts/bench/bench_warm.py                     # ~3,000 tokens
    python scripts/bench/bench_warm.py --tokens 7000
    python scripts/bench/bench_warm.py --rewarm 10 --tokens 400
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from aiohttp import web

from ocxproxy.config import Config
from ocxproxy.http.context import PROXY, Proxy
from ocxproxy.server import Listener, build_app, listen
from ocxproxy.upstream import local

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.e2e.text import QUESTIONS, long_message


class Running:
    """One proxy in this process, on the embedded backend."""

    def __init__(self, app: web.Application, listener: Listener) -> None:
        self.app, self.listener = app, listener
        self.client = openai.AsyncOpenAI(
            base_url=listener.url + "/v1", api_key="sk-bench", max_retries=0, timeout=3600
        )

    @classmethod
    async def start(cls, state: Path, **settings: Any) -> Running:
        settings.setdefault("health_interval", 0)
        app = build_app(Config(state_dir=state, port=0, **settings))
        return cls(app, await listen(app, "127.0.0.1", 0))

    @property
    def proxy(self) -> Proxy:
        return self.app[PROXY]

    async def turn(self, text: str, prev: str | None) -> tuple[Any, float]:
        started = time.perf_counter()
        response = await self.client.responses.create(
            model="local", input=text, previous_response_id=prev, max_output_tokens=4
        )
        return response, time.perf_counter() - started

    async def saved(self) -> None:
        saves = self.proxy.kv_saves
        while saves is not None and saves.tasks:
            await asyncio.wait(list(saves.tasks))

    async def kill_backend(self) -> None:
        (backend,) = self.proxy.pool.fleet.backends
        restarts = backend.restarts
        os.kill(llama_child(), signal.SIGKILL)
        for _ in range(3000):
            if backend.restarts > restarts:
                return
            await asyncio.sleep(0.1)
        raise SystemExit("the watchdog did not restart the backend")

    def sample(self, name: str, **labels: str) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def stop(self) -> None:
        await self.client.close()
        await self.listener.close()


def llama_child() -> int:
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = (entry / "stat").read_text().rpartition(")")[2].split()[1]
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if ppid == me and b"ocxproxy.upstream.llama_server" in cmdline:
                return int(entry.name)
    raise SystemExit("no embedded llama.cpp child")


def ratio(usage: Any) -> float:
    return float(usage.input_tokens_details.cached_tokens / usage.input_tokens)


async def run(args: argparse.Namespace) -> None:
    if local.default_model_path() is None or not local.is_available():
        sys.exit(local.MISSING_MESSAGE)
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        proxy = await Running.start(state)
        first, cold = await proxy.turn(long_message(args.tokens, seed=3), None)
        await proxy.saved()
        (save,) = (state / "kv").glob("*.kv")
        assert proxy.proxy.kv_saves is not None
        n_saved = next(iter(proxy.proxy.kv_saves.by_name.values())).tokens
        per_token = save.stat().st_size / n_saved
        await proxy.kill_backend()
        second, after_kill = await proxy.turn(QUESTIONS[0], first.id)
        restore_seconds = proxy.sample("ocxproxy_kv_restore_seconds_sum")
        await proxy.saved()
        await proxy.stop()

        proxy = await Running.start(state)  # a graceful restart on the same state dir
        third, after_restart = await proxy.turn(QUESTIONS[1], second.id)
        await proxy.stop()

        # The reply path with a save after every turn, against saves off, alternated.
        with_saves: list[float] = []
        without: list[float] = []
        for round_ in range(args.rounds):
            for every, out in ((1, with_saves), (0, without)):
                settings = {"kv_save_every": 1} if every else {"kv_save": "off"}
                proxy = await Running.start(Path(tmp) / f"s{round_}{every}", **settings)
                prev, _ = await proxy.turn(long_message(args.tokens // 3, seed=round_), None)
                prev_id = prev.id
                for question in QUESTIONS[:3]:
                    await proxy.saved()  # the slot is free: only the reply path is timed
                    response, seconds = await proxy.turn(question, prev_id)
                    out.append(seconds)
                    prev_id = response.id
                await proxy.stop()

    load = os.getloadavg()[0]
    print(f"chain of {first.usage.input_tokens} tokens, load average {load:.1f}")
    print("| figure | value | target |")
    print("|---|---|---|")
    print(f"| cold first turn | {cold:.2f} s | |")
    print(f"| continuation after kill -9 | {after_kill:.2f} s | |")
    print(f"| ÷ cold first turn | {after_kill / cold:.3f} | ≤ 0.25 |")
    print(f"| its cached/input | {ratio(second.usage):.3f} | ≥ 0.9 |")
    print(f"| continuation after a graceful proxy restart | {after_restart:.2f} s | |")
    print(f"| ÷ cold first turn | {after_restart / cold:.3f} | ≤ 0.25 |")
    print(f"| its cached/input | {ratio(third.usage):.3f} | ≥ 0.9 |")
    p50_with, p50_without = statistics.median(with_saves), statistics.median(without)
    print(f"| reply p50, a save after every turn | {p50_with:.3f} s | |")
    print(f"| reply p50, saves off | {p50_without:.3f} s | |")
    print(f"| bytes saved per token | {per_token:,.0f} | |")
    print(f"| restore seconds | {restore_seconds:.3f} | |")


async def rewarmed(args: argparse.Namespace) -> None:
    """N chains on an external server with no save API, which is killed and started
    again; the first continuation of each once the proxy has re-warmed them."""
    model = local.default_model_path()
    assert model is not None
    server = local.LocalBackend(model)
    url = await server.start()
    with tempfile.TemporaryDirectory() as tmp:
        proxy = await Running.start(
            Path(tmp) / "state", upstream=(url,), health_interval=0.2, rewarm_budget=1 << 20
        )
        try:
            chains = []
            for n in range(args.rewarm):
                response, _ = await proxy.turn(long_message(args.tokens, seed=100 + n), None)
                chains.append(response)
            (backend,) = proxy.proxy.pool.fleet.backends
            pid = server.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            for _ in range(600):
                if not backend.healthy:
                    break
                await asyncio.sleep(0.1)
            await server.start()
            started = time.perf_counter()
            for _ in range(36000):
                if proxy.sample("ocxproxy_rewarm_total", outcome="warmed") >= len(chains):
                    break
                await asyncio.sleep(0.1)
            rewarm_seconds = time.perf_counter() - started
            ratios = []
            for chain in reversed(chains):  # the newest chain first, as a user returns
                response, _ = await proxy.turn(QUESTIONS[0], chain.id)
                ratios.append(ratio(response.usage))
        finally:
            await proxy.stop()
            await server.stop()
    load = os.getloadavg()[0]
    print(f"{len(chains)} chains of ~{args.tokens} tokens, load average {load:.1f}")
    print("| figure | value | target |")
    print("|---|---|---|")
    print(f"| re-warm after the restart | {rewarm_seconds:.1f} s | |")
    print(f"| first continuations' cached/input, least | {min(ratios):.3f} | ≥ 0.9 |")
    print(f"| the same, median | {statistics.median(ratios):.3f} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3000, help="the first message's size")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the save-cost part")
    parser.add_argument("--rewarm", type=int, default=0, help="N chains re-warmed (no save API)")
    args = parser.parse_args()
    asyncio.run(rewarmed(args) if args.rewarm else run(args))


if __name__ == "__main__":
    main()
