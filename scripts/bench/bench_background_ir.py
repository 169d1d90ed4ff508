"""bench_background's CPU figure counted in instructions (valgrind's callgrind): the
proxy's user-space instructions per streamed turn, background and foreground, a figure
that does not move with the load of a shared 2-core box (kernel time, the fsync helper
process and the fake backend are not counted; bench_background.py's /proc figure counts
the proxy's kernel time too).

Starts the fake backend (instant) and `serve` (the default durable configuration) under
callgrind with instrumentation off, then for each round and kind: warms up, switches it
on (`callgrind_control -i on`), runs --n turns read to the end, switches it off and dumps.
Needs `valgrind` (Debian's package). Prints instructions per turn of each kind (the
lowest of the rounds: a checkpoint or a collection of the garbage collector in one window
only adds) and their ratio.

    python scripts/bench/bench_background_ir.py              # ~10 min on a loaded box
    python scripts/bench/bench_background_ir.py --n 60 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench_background import start_fake, turns  # noqa: E402
from benchkit import PROXY_ARGS, PYTHON, running, start_child, state_args  # noqa: E402


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def collected(out: Path) -> int:
    """The instructions of the newest dump."""
    newest = max(out.parent.glob(out.name + ".*"), key=lambda p: p.stat().st_mtime)
    for line in newest.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    return 0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="turns counted per round and kind")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "callgrind.out"
    instant = start_fake(0.0)
    with running(instant):
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}.%p", PYTHON, "-m", "ocxproxy", "serve",
                "--upstream", instant.url, *PROXY_ARGS, *state_args()]  # fmt: skip
        proxy = start_child("proxy_cg", argv, r"listening on (http://\S+?)/v1", timeout=300)
        per_turn: dict[bool, list[float]] = {False: [], True: []}
        with running(proxy):
            for _ in range(args.rounds):
                for background in (False, True):
                    await turns(proxy.url, 10, background=background)
                    await asyncio.sleep(1.0)  # (the warm-up's log files written)
                    control(proxy.pid, "-z")
                    control(proxy.pid, "-i", "on")
                    await turns(proxy.url, args.n, background=background)
                    await asyncio.sleep(0.8)  # (and the counted turns')
                    control(proxy.pid, "-i", "off")
                    control(proxy.pid, "-d")
                    await asyncio.sleep(0.5)
                    per_turn[background].append(collected(out) / args.n)
    fg, bg = min(per_turn[False]), min(per_turn[True])
    rounds = zip(per_turn[False], per_turn[True], strict=True)
    print(
        f"instructions per streamed turn: foreground {fg:,.0f}, background {bg:,.0f}, "
        f"ratio {bg / fg:.3f} (each round: "
        + ", ".join(f"{f:,.0f} / {b:,.0f}" for f, b in rounds)
        + ")"
    )


if __name__ == "__main__":
    asyncio.run(main())
