"""bench_hotpath's turns counted in CPU instructions (valgrind's callgrind): a figure that
does not move with the machine's load, to compare two versions on a busy box.

The rig is bench_hotpath.py's (the real request path in one process, in-memory
transports, `--zdr`, or with `--durable` the default durable store in a scratch state dir);
only the measured turns are counted: they run inside `functools.reduce`, and callgrind
collects only while that C function is on the stack, in the event loop's thread (with
`--durable`, what the journal's threads do is not counted; the fsync helper is another
process, which valgrind does not trace).
Needs `valgrind` (Debian's package). Prints instructions per continuation turn for JSON and
SSE at each history size; a turn takes ~2,000 instructions per µs on the 2-core VM of
docs/BENCHMARKS.md, so 10,000 instructions are ~5 µs.

    python scripts/bench/bench_hotpath_ir.py            # ~5 min on a loaded box
    python scripts/bench/bench_hotpath_ir.py --sizes 8k --n 100
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_hotpath as rig
import orjson
from benchkit import codex_members, make_items, user_message

from ocxproxy.config import Config
from ocxproxy.continuation.envelope import ServedModels
from ocxproxy.http.context import PROXY
from ocxproxy.http.front import FrontEnd
from ocxproxy.server import build_app

_COLLECTED = re.compile(r"Collected : (\d+)")


def child(
    mode: str, size: str, n: int, codex: bool, durable: bool, first_turns: bool, served: bool
) -> None:
    """Warm up, then run `n` turns inside functools.reduce (what callgrind counts)."""
    loop: asyncio.AbstractEventLoop
    try:  # the loop bench_hotpath.py runs on
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    state_dir = tempfile.mkdtemp()

    async def setup() -> tuple[rig.Client, bytes]:
        config = Config(
            upstream=("http://backend.invalid:80",),
            state_dir=Path(state_dir),
            zdr=not durable,
            health_interval=0,
        )
        proxy = build_app(config)[PROXY]
        if served:  # as the embedded backend's: the name the backend answers, its sampling
            proxy.served_models = ServedModels(("bench",), {"temperature": 0.8, "top_p": 0.95})
        await proxy.store.start()
        backend = rig.Backend()
        backend.head = 40_000 if codex else backend.head
        proxy.pool.http._connect = lambda origin: rig._connected(backend)  # type: ignore[method-assign]
        client = rig.Client(FrontEnd(proxy, web_server=lambda: None))  # type: ignore[arg-type,return-value]
        members = codex_members() if codex else {}
        first = orjson.dumps({"model": "m", **members, "input": make_items(rig.SIZES[size])})
        found = rig._RID.search(await client.post(first))
        assert found is not None
        turn = {"model": "m", **members, "previous_response_id": found.group(1).decode()}
        turn |= {"input": [user_message("next")], "stream": mode == "sse"}
        if first_turns:  # a new conversation each time: the whole history is the request's own
            turn = {"model": "m", **members, "stream": mode == "sse"}
            turn["input"] = make_items(rig.SIZES[size])  # (after stream: the backend reads it)
        body = orjson.dumps(turn)
        for _ in range(100):  # warm-up: caches, the shapes a backend answers in
            await client.post(body)
        return client, body

    async def turns(client: rig.Client, body: bytes) -> None:
        for _ in range(n):
            await client.post(body)

    client, body = loop.run_until_complete(setup())
    gc.collect()
    functools.reduce(lambda _, __: loop.run_until_complete(turns(client, body)), [0], None)
    shutil.rmtree(state_dir, ignore_errors=True)


def count(
    mode: str,
    size: str,
    n: int,
    *,
    off: bool = False,
    codex: bool = False,
    durable: bool = False,
    first: bool = False,
    served: bool = False,
) -> int:
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    command += ["--collect-atstart=no", "--toggle-collect=*functools_reduce*"]
    command += [sys.executable, __file__, "--child", mode, size, str(n)]
    command += ["--envelope-off"] if off else []
    command += ["--codex"] if codex else []
    command += ["--durable"] if durable else []
    command += ["--first"] if first else []
    command += ["--served"] if served else []
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    found = _COLLECTED.search(result.stderr)
    if found is None:
        raise RuntimeError(result.stderr[-2000:])
    return int(found.group(1)) // n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100, help="measured turns per case")
    parser.add_argument("--sizes", default="8k,128k")
    parser.add_argument(
        "--envelope-off",
        action="store_true",
        help="also count each case with the Response envelope a no-op (its cost: the difference)",
    )
    parser.add_argument(
        "--codex",
        action="store_true",
        help="each request carries a coding agent's instructions and tools (~28 KB, benchkit)",
    )
    parser.add_argument(
        "--durable",
        action="store_true",
        help="the default durable store (a scratch state dir) instead of --zdr",
    )
    parser.add_argument(
        "--first",
        action="store_true",
        help="count first turns (no previous_response_id: the history is the request's input)",
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="served model names with sampling values, as the embedded llama.cpp backend has",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.envelope_off:
            rig.envelope_off()
        mode, size, n = args.child
        child(mode, size, int(n), args.codex, args.durable, args.first, args.served)
        return
    members = " (Codex-sized instructions and tools)" if args.codex else ""
    store = "durable store" if args.durable else "memory-only store"
    turn = "first turn" if args.first else "continuation turn"
    members += ", served model names" if args.served else ""
    print(f"instructions per {turn} (callgrind, {store}){members}")
    print(f"{'history':<8} {'JSON':>12} {'SSE':>12}")
    case = {"codex": args.codex, "durable": args.durable, "first": args.first}
    case["served"] = args.served
    for size in args.sizes.split(","):
        on = [count(mode, size, args.n, **case) for mode in ("json", "sse")]
        print(f"{size:<8} {on[0]:>12,} {on[1]:>12,}", flush=True)
        if args.envelope_off:
            off = [count(mode, size, args.n, off=True, **case) for mode in ("json", "sse")]
            print(f"{'  off':<8} {off[0]:>12,} {off[1]:>12,}")
            print(f"{'  cost':<8} {on[0] - off[0]:>12,} {on[1] - off[1]:>12,}", flush=True)


if __name__ == "__main__":
    main()
