"""`ocxproxy serve` in this process with cProfile switched by signals, for benchmarks.

SIGUSR1 starts profiling the event loop thread, SIGUSR2 stops it and writes the stats to
the file named by $OCXPROXY_PROFILE_OUT (pstats format). $OCXPROXY_PROFILE_CLOCK picks the
clock: `cpu` (default: this thread's CPU time, so time spent preempted by the backend or
the client on a busy box is not charged to the code that happened to be running) or
`wall`. $OCXPROXY_BENCH_ABLATE (comma list) changes the process for what-if figures,
without touching ocxproxy's code:
  metrics-off   every metric update a no-op (the most that metrics can cost)
Everything else is `ocxproxy`'s own command line:

    python scripts/bench/profiled_proxy.py serve --upstream URL --port 0 ...
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

from ocxproxy import cli

_CLOCK = os.environ.get("OCXPROXY_PROFILE_CLOCK", "cpu")
_profile = cProfile.Profile(time.thread_time if _CLOCK == "cpu" else time.perf_counter)


def _start(signum: int, frame: FrameType | None) -> None:
    _profile.enable()


def _stop(signum: int, frame: FrameType | None) -> None:
    _profile.disable()
    out = os.environ.get("OCXPROXY_PROFILE_OUT", "/tmp/ocxproxy.prof")
    _profile.dump_stats(out + ".part")
    os.replace(out + ".part", out)
    _profile.clear()


def _ablate(what: set[str]) -> None:
    if "metrics-off" in what:
        from ocxproxy import metrics

        def noop(*args: Any, **kwargs: Any) -> None:
            return None

        for cls in (metrics.Value, metrics.Buckets, metrics.Counter, metrics.Gauge):
            for name in ("inc", "dec", "set", "observe"):
                if hasattr(cls, name):
                    setattr(cls, name, noop)


def main() -> None:
    ablate = {x for x in os.environ.get("OCXPROXY_BENCH_ABLATE", "").split(",") if x}
    if ablate:
        _ablate(ablate)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
