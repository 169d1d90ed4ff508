"""The disk's own fdatasync tail, to read beside a durable-store benchmark.

A durable turn is answered after its journal's fdatasync, so no window of the proxy's
latency can be shorter than the disk's worst sync in it. This writes 550 bytes and
fdatasyncs them every 5 ms in its own file under DIR (as a small journal commit does),
prints each sync over --slow ms with the wall time, and p99/max every 10 s, until stopped
(Ctrl-C, SIGTERM) or --seconds have passed:

    python scripts/bench/disk_canary.py /tmp --seconds 30
    python scripts/bench/disk_canary.py /tmp &   # beside bench_durable.py --only-latency

`Watch` runs it beside a benchmark (`--record FILE --every 0.025`: each sync's monotonic
start and duration appended to FILE, with how late the canary woke up for it, nothing
printed), so the benchmark can report the disk's syncs in the same seconds as each of its
windows (bench_durable.py), and the box's own stalls: a wake-up late by many ms is the
machine not running a ready process, whatever the disk does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOM = 64 << 20  # preallocated, as the journal's room is
DATA = b"x" * 550  # a small journal commit
STALL = 0.05  # a sync this long counts as the disk stalling


class Canary:
    """A file under `directory` that takes one small write and fdatasync at a time."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"disk-canary-{os.getpid()}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.at = 0
        try:
            os.posix_fallocate(self.fd, 0, ROOM)
        except OSError:
            self.close()
            raise

    def sync(self) -> float:
        """Write the next 550 bytes and fdatasync them; how long the sync took (s)."""
        os.pwrite(self.fd, DATA, self.at)
        self.at = (self.at + len(DATA)) % (ROOM - len(DATA))
        start = time.perf_counter()
        os.fdatasync(self.fd)
        return time.perf_counter() - start

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


class Watch:
    """This script in a child process, recording every sync while in use, so a benchmark
    can say what the disk did in each of its windows (in its own process: a thread would
    share the benchmark's GIL, and time its waits for it as the disk's):

        with Watch(directory) as watch:
            start = time.monotonic(); ...; print(describe(watch.between(start, time.monotonic())))
    """

    def __init__(self, directory: Path, interval: float = 0.025) -> None:
        self.record = directory / "disk-canary.syncs"
        self.argv = [sys.executable, __file__, str(directory), "--record", str(self.record)]
        self.argv += ["--every", str(interval)]

    def __enter__(self) -> Watch:
        """Once the canary's first sync is recorded: a window opened after it has syncs."""
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self.between(0.0, float("inf")):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the disk canary did not start: {' '.join(self.argv)}")
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self._proc.terminate()
        self._proc.wait(10)

    def between(self, start: float, end: float) -> list[float]:
        """The durations of the syncs under way in [start, end) (time.monotonic seconds):
        a stall begun before the window and lasting into it counts, so a window shorter
        than a stall still shows it."""
        return [took for at, took, _ in self._lines() if at < end and at + took > start]

    def late(self, start: float, end: float) -> list[float]:
        """How late (seconds) the canary woke up for each sync in [start, end): its sleep
        overran by that much, the box's stall rather than the disk's."""
        return [late for at, _, late in self._lines() if start <= at < end]

    def _lines(self) -> list[tuple[float, float, float]]:
        lines = []
        with contextlib.suppress(FileNotFoundError), open(self.record) as f:
            for line in f:
                fields = line.split()
                if len(fields) != 3:  # a torn last line
                    continue
                lines.append((float(fields[0]), float(fields[1]), float(fields[2])))
        return lines


def tail(syncs: list[float]) -> tuple[int, float, float]:
    """How many syncs (seconds), their p99 and their max (NaN for none)."""
    if not syncs:
        return 0, float("nan"), float("nan")
    syncs = sorted(syncs)
    return len(syncs), syncs[min(len(syncs) - 1, int(len(syncs) * 0.99))], syncs[-1]


def describe(syncs: list[float]) -> str:
    """Syncs (seconds) in a line: how many, p99, max, and those over STALL."""
    if not syncs:
        return "no syncs"
    n, p99, worst = tail(syncs)
    stalls = [s for s in syncs if s > STALL]
    return (
        f"{n} syncs, p99 {p99 * 1000:,.1f} ms, max {worst * 1000:,.0f} ms, "
        f"{len(stalls)} over {STALL * 1000:.0f} ms ({sum(stalls):.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a directory on the disk to watch")
    parser.add_argument("--seconds", type=float, default=0.0, help="0: until stopped")
    parser.add_argument("--slow", type=float, default=20.0, help="print syncs over this, ms")
    parser.add_argument("--every", type=float, default=0.005, help="pause between syncs, s")
    parser.add_argument("--record", type=Path, help="append each sync here, print nothing")
    args = parser.parse_args()
    canary = Canary(args.dir)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleaned up as on Ctrl-C
    try:
        if args.record:
            record(canary, args.record, args.every)
        else:
            run(canary, args.seconds, args.slow / 1000, args.every)
    except KeyboardInterrupt:
        pass
    finally:
        canary.close()


def record(canary: Canary, path: Path, every: float) -> None:
    with open(path, "a", buffering=1) as out:
        late = 0.0
        while True:
            at = time.monotonic()
            out.write(f"{at:.6f} {canary.sync():.6f} {late:.6f}\n")
            asleep = time.monotonic()
            time.sleep(every)
            late = max(time.monotonic() - asleep - every, 0.0)


def run(canary: Canary, seconds: float, slow: float, every: float) -> None:
    end = time.monotonic() + seconds if seconds else float("inf")
    window: list[float] = []
    report = time.monotonic() + 10
    while time.monotonic() < end:
        took = canary.sync()
        window.append(took)
        if took > slow:
            print(f"{time.strftime('%H:%M:%S')} sync {took * 1000:,.0f} ms", flush=True)
        if time.monotonic() >= report:
            window.sort()
            p99, worst = window[int(len(window) * 0.99)], window[-1]
            print(
                f"{time.strftime('%H:%M:%S')} 10 s: {len(window)} syncs, "
                f"p99 {p99 * 1000:.1f} ms, max {worst * 1000:,.0f} ms",
                flush=True,
            )
            window, report = [], report + 10
        time.sleep(every)


if __name__ == "__main__":
    main()
