"""The disk's own fdatasync tail, to read beside a durable-store benchmark.

A durable turn is answered after its journal's fdatasync, so no window of the proxy's
latency can be shorter than the disk's worst sync in it. This writes 550 bytes and
fdatasyncs them every 5 ms in its own file under DIR (as a small journal commit does),
prints each sync over --slow ms with the wall time, and p99/max every 10 s, until stopped
(Ctrl-C, SIGTERM) or --seconds have passed:

    python scripts/bench/disk_canary.py /tmp --seconds 30
    python scripts/bench/disk_canary.py /tmp &   # beside bench_durable.py --only-latency
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

ROOM = 64 << 20  # preallocated, as the journal's room is


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a directory on the disk to watch")
    parser.add_argument("--seconds", type=float, default=0.0, help="0: until stopped")
    parser.add_argument("--slow", type=float, default=20.0, help="print syncs over this, ms")
    args = parser.parse_args()
    path = args.dir / f"disk-canary-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleaned up as on Ctrl-C
    try:
        os.posix_fallocate(fd, 0, ROOM)
        run(fd, args.seconds, args.slow / 1000)
    except KeyboardInterrupt:
        pass
    finally:
        os.close(fd)
        path.unlink()


def run(fd: int, seconds: float, slow: float) -> None:
    data, at = b"x" * 550, 0
    end = time.monotonic() + seconds if seconds else float("inf")
    window: list[float] = []
    report = time.monotonic() + 10
    while time.monotonic() < end:
        os.pwrite(fd, data, at)
        at = (at + len(data)) % (ROOM - len(data))
        start = time.perf_counter()
        os.fdatasync(fd)
        took = time.perf_counter() - start
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
        time.sleep(0.005)


if __name__ == "__main__":
    main()
