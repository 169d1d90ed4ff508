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

`--cache` also simulates the caches (callgrind's `--cache-sim` with the geometry the kernel
reports for the first core, printed: its L1s, and its L2 as the last level); each cell is
then instructions / L1 misses / last-level misses per turn (instruction fetches, data
reads and writes). An 8k turn touches ~770 KB of distinct lines: more than a 512 KB L2
holds, so there whatever a turn runs once starts cold in it; a 2 MB L2 holds it, and then
only the 128k turns (their history's bytes read and written each turn) start cold in it.
The L1s start each turn cold for what it runs once either way (why each of the envelope's
calls takes several times its warm time in a turn: bench_envelope_calls.py). The misses
depend on where objects land: `--layouts N` runs each case over N heap paddings and
prints the cost's range, which stays within ~15 %, but another build or a checkout at
another path can move the envelope's whole-run misses by a factor of two. Compare two
versions by the functions a change touches (callgrind_annotate of the files `--keep DIR`
keeps: their counts are exact) and by instructions, not by whole-run misses.

`--cold` (with `--cache`) counts each turn after a sweep that writes over the simulated
caches, uncounted: the most a turn can miss, when whatever ran while it waited (for the
backend, for the journal) evicted all of its lines (bench_hotpath.py --idle). Such
an 8k turn misses ~14,000 last-level lines (~16,000 with --durable), where a turn after
another misses ~300, and more than half of the envelope's are instruction fetches, most
of them its compiled calls' code. The sweep is data: the L1 instruction cache keeps what
its own few instructions do not displace, so code a turn fetches cold misses at the last
level, not always in L1.

    python scripts/bench/bench_hotpath_ir.py            # ~5 min on a loaded box
    python scripts/bench/bench_hotpath_ir.py --sizes 8k --n 100
    python scripts/bench/bench_hotpath_ir.py --sizes 8k --n 30 --cache --cold --envelope-off
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

_COLLECTED = re.compile(r"Collected : ([\d ]+)")
# --cache: L1 instruction and data caches, and one core's L2 as the last level (what the
# kernel reports for cpu0; else a 2-core VM's of docs/BENCHMARKS.md)
_SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_DEFAULT_CACHES = {"I1": "32768,8,64", "D1": "32768,8,64", "LL": "524288,8,64"}
_SIMULATED = {("1", "Instruction"): "I1", ("1", "Data"): "D1", ("2", "Unified"): "LL"}


def cache_geometry() -> dict[str, str]:
    """callgrind's --I1, --D1 and --LL (size,ways,line) for this machine's first core."""
    found = dict(_DEFAULT_CACHES)
    for index in sorted(_SYSFS_CACHES.glob("index*")):
        try:
            level, kind, size, ways, line = (
                (index / name).read_text().strip()
                for name in (
                    "level",
                    "type",
                    "size",
                    "ways_of_associativity",
                    "coherency_line_size",
                )
            )
        except OSError:
            continue
        if (level, kind) in _SIMULATED and size.endswith("K"):
            found[_SIMULATED[level, kind]] = f"{int(size[:-1]) * 1024},{ways},{line}"
    return found


SWEEP = 4  # times the last level's size that `sweep` writes


def sweep(last_level: int) -> None:
    """Write over every line of the simulated caches (`last_level` bytes the largest)
    several times, in one memset, as what the core runs while the proxy waits for the
    backend or the journal evicts a turn's lines."""
    (b"\x01" * (SWEEP * last_level)).__len__()


def cache_options() -> list[str]:
    return ["--cache-sim=yes", *(f"--{name}={value}" for name, value in cache_geometry().items())]


def child(
    mode: str,
    size: str,
    n: int,
    codex: bool,
    durable: bool,
    first_turns: bool,
    served: bool,
    pad: int = 0,
    cold: bool = False,
) -> None:
    """Warm up, then run `n` turns inside functools.reduce (what callgrind counts). `pad`
    shifts where the heap's objects land (see --layouts); `cold`: each turn after `sweep`."""
    padding = [bytes(24 + 8 * (i % 61)) for i in range(pad * 211)]
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
    if cold:  # one turn at a time, each after a sweep that callgrind does not count
        last_level = int(cache_geometry()["LL"].split(",")[0])
        for _ in range(n):
            sweep(last_level)
            functools.reduce(lambda _, __: loop.run_until_complete(client.post(body)), [0], None)
    else:
        functools.reduce(lambda _, __: loop.run_until_complete(turns(client, body)), [0], None)
    shutil.rmtree(state_dir, ignore_errors=True)
    del padding


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
    cache: bool = False,
    keep: Path | None = None,
    pad: int = 0,
    cold: bool = False,
) -> tuple[int, int, int]:
    """Instructions, and (with `cache`) L1 and last-level cache misses, per turn."""
    name = f"{mode}-{size}{'-off' if off else ''}-{pad}.callgrind"
    out = "/dev/null" if keep is None else str(keep / name)
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    command += cache_options() if cache else []
    command += ["--collect-atstart=no", "--toggle-collect=*functools_reduce*"]
    command += [sys.executable, __file__, "--child", mode, size, str(n)]
    command += ["--envelope-off"] if off else []
    command += ["--codex"] if codex else []
    command += ["--durable"] if durable else []
    command += ["--first"] if first else []
    command += ["--served"] if served else []
    command += ["--cold"] if cold else []
    command += ["--pad", str(pad)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    found = _COLLECTED.search(result.stderr)
    if found is None:
        raise RuntimeError(result.stderr[-2000:])
    # Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw (with the caches simulated)
    events = [int(value) for value in found.group(1).split()]
    if not cache:
        return events[0] // n, 0, 0
    return events[0] // n, sum(events[3:6]) // n, sum(events[6:9]) // n


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
    parser.add_argument(
        "--cache",
        action="store_true",
        help="also simulate the caches: last-level misses per turn (several times slower)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="with --cache, each turn starts with the caches swept, as after an idle wait",
    )
    parser.add_argument("--keep", type=Path, help="keep callgrind's files in this directory")
    parser.add_argument(
        "--layouts",
        type=int,
        default=1,
        help="each case over this many heap layouts: their mean, and the cost's range (the "
        "counts move by ~1 %% with where objects land, the envelope's cost by ~±15 %%)",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--pad", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold and not args.cache and not args.child:
        parser.error("--cold sweeps the simulated caches: with --cache")
    if args.child:
        if args.envelope_off:
            rig.envelope_off()
        mode, size, n = args.child
        child(
            mode, size, int(n), args.codex, args.durable, args.first, args.served, args.pad,
            args.cold,
        )  # fmt: skip
        return
    members = " (Codex-sized instructions and tools)" if args.codex else ""
    store = "durable store" if args.durable else "memory-only store"
    turn = "first turn" if args.first else "continuation turn"
    members += ", served model names" if args.served else ""
    what = "instructions" + (" / L1 misses / last-level misses" if args.cache else "")
    print(f"{what} per {turn} (callgrind, {store}){members}")
    if args.cache:
        cold = ", swept before each turn" if args.cold else ""
        print("caches: " + ", ".join(f"{k} {v}" for k, v in cache_geometry().items()) + cold)
    width = 30 if args.cache else 12
    print(f"{'history':<8} {'JSON':>{width}} {'SSE':>{width}}")
    case = {"codex": args.codex, "durable": args.durable, "first": args.first}
    case |= {"served": args.served, "cache": args.cache, "keep": args.keep, "cold": args.cold}
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)

    def row(label: str, figures: list[list[tuple[int, int, int]]]) -> None:
        """Each case's mean over the layouts, and with several its range."""
        cells = []
        for runs in figures:
            counts = list(zip(*runs, strict=True))[: 3 if args.cache else 1]
            cell = " / ".join(f"{sum(c) // len(c):,}" for c in counts)
            if len(runs) > 1 and label.strip() == "cost":
                cell += " (" + " / ".join(f"{min(c):,}..{max(c):,}" for c in counts) + ")"
            cells.append(cell)
        print(f"{label:<8} {cells[0]:>{width}} {cells[1]:>{width}}", flush=True)

    def runs(mode: str, size: str, off: bool = False) -> list[tuple[int, int, int]]:
        return [count(mode, size, args.n, off=off, pad=pad, **case) for pad in range(args.layouts)]

    for size in args.sizes.split(","):
        on = [runs(mode, size) for mode in ("json", "sse")]
        row(size, on)
        if args.envelope_off:
            off = [runs(mode, size, off=True) for mode in ("json", "sse")]
            row("  off", off)
            cost = [
                [
                    (a[0] - b[0], a[1] - b[1], a[2] - b[2])
                    for a, b in zip(on_runs, off_runs, strict=True)
                ]
                for on_runs, off_runs in zip(on, off, strict=True)
            ]
            row("  cost", cost)


if __name__ == "__main__":
    main()
