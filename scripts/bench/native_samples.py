"""Where one thread's CPU time goes natively, by mode: Linux perf's samples of it.

`perf record` samples the thread on `cpu-clock` (a software event: it works on a VM with no
performance counters) every `period_us` µs of its CPU time, each sample stamped with
CLOCK_MONOTONIC; the caller marks the windows of time each mode ran in (`window`), and
`report` bins the samples by window: per shared object and per function, µs of CPU a turn
in each mode and their difference. Unlike cProfile or callgrind this is the machine's own
time, cache misses and all, without changing the code it measures; what it cannot see is a
Python function (CPython 3.11 runs them all in `_PyEval_EvalFrameDefault`).
"""

from __future__ import annotations

import bisect
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

MINOR_US = 0.1  # an object whose on - off is smaller is summed with the others like it


def available() -> str | None:
    """Why perf cannot sample here, or None when it can."""
    if shutil.which("perf") is None:
        return "no perf on PATH (Debian's linux-perf)"
    probe = subprocess.run(
        ["perf", "record", "-q", "-e", "cpu-clock", "-o", os.devnull, "--", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"perf record fails here: {probe.stderr.strip()[:200]}"
    return None


class Sampler:
    """perf sampling the calling thread from `start()` to `stop()`; `window(mode, ...)`
    marks when a mode ran, in CLOCK_MONOTONIC ns (`now()`)."""

    def __init__(self, period_us: float = 50.0) -> None:
        self.period_us = period_us
        self.windows: list[tuple[int, int, str]] = []  # (start, end, mode), in time order
        self.samples: dict[str, Counter[tuple[str, str]]] = {}  # by mode: (object, function)
        self._dir = tempfile.TemporaryDirectory(prefix="ocxproxy-perf-")
        self._data = Path(self._dir.name) / "perf.data"
        self._perf: subprocess.Popen[bytes] | None = None
        self._control = -1

    @staticmethod
    def now() -> int:
        return time.clock_gettime_ns(time.CLOCK_MONOTONIC)

    def start(self) -> None:
        """Attaches perf to this thread and returns once it samples (its control ack)."""
        control, control_end = os.pipe()
        ack_end, ack = os.pipe()
        command = [
            "perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-e", "cpu-clock",
            "-c", str(int(self.period_us * 1000)),  # (cpu-clock counts ns)
            "-t", str(threading.get_native_id()), "-D", "-1",  # (enabled below)
            "--control", f"fd:{control},{ack}", "-o", str(self._data),
        ]  # fmt: skip
        self._perf = subprocess.Popen(command, pass_fds=(control, ack))
        os.close(control)
        os.close(ack)
        self._control = control_end  # (open until stop: its end would be perf's too)
        try:
            os.write(control_end, b"enable\n")
            ready, _, _ = select.select([ack_end], [], [], 30)
            if not ready or not os.read(ack_end, 16).startswith(b"ack"):
                raise RuntimeError("perf record did not start sampling")
        except BaseException:
            self._perf.kill()
            self._perf.wait()
            self._perf = None
            os.close(control_end)
            raise
        finally:
            os.close(ack_end)

    def window(self, mode: str, start: int, end: int) -> None:
        self.windows.append((start, end, mode))

    def stop(self) -> None:
        """Stops perf and bins its samples by the windows' modes (outside them: dropped)."""
        if self._perf is None:
            return
        self._perf.send_signal(signal.SIGINT)
        self._perf.wait()
        self._perf = None
        os.close(self._control)
        script = subprocess.run(
            ["perf", "script", "-i", str(self._data), "-F", "time,ip,sym,dso"],
            capture_output=True,
            text=True,
            check=True,
        )
        self._bin(script.stdout.splitlines())
        self._dir.cleanup()

    def _bin(self, lines: list[str]) -> None:
        starts = [start for start, _, _ in self.windows]
        for line in lines:
            # "   46398.167294:      7ff7d5cfa8ed function+0x1d (/path/to/object.so)"
            stamp, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) < 2 or not stamp.strip():
                continue
            at = round(float(stamp) * 1e9)
            index = bisect.bisect_right(starts, at) - 1
            if index < 0 or at > self.windows[index][1]:
                continue
            function = " ".join(parts[1:-1]) or "[unknown]"
            where = parts[-1].strip("()").rsplit("/", 1)[-1]
            mode = self.windows[index][2]
            self.samples.setdefault(mode, Counter())[(where, function)] += 1

    def report(self, turns: dict[str, int], on: str, off: str, top: int) -> list[str]:
        """Lines: µs a turn in mode `on`, in `off`, and on - off, for all the samples, each
        shared object, and the `top` functions whose difference is largest."""
        us = {
            mode: {key: n * self.period_us / turns[mode] for key, n in counts.items()}
            for mode, counts in self.samples.items()
            if turns.get(mode)
        }
        first, second = us.get(on, {}), us.get(off, {})

        def line(label: str, a: float, b: float) -> str:
            return f"    {label[:44]:<44} {a:>8.2f} {b:>8.2f} {a - b:>+8.2f}"

        objects: dict[str, list[float]] = {}
        for column, values in ((0, first), (1, second)):
            for (where, _), value in values.items():
                objects.setdefault(where, [0.0, 0.0])[column] += value
        lines = [f"  {'natively (perf), µs a turn, by object':<46} {on:>8} {off:>8} on - off"]
        lines.append(line("all samples", sum(first.values()), sum(second.values())))
        ordered = sorted(objects.items(), key=lambda item: -abs(item[1][0] - item[1][1]))
        shown = [(where, a, b) for where, (a, b) in ordered if abs(a - b) >= MINOR_US]
        lines += [line(where, a, b) for where, a, b in shown]
        if len(shown) < len(ordered):
            rest = [values for _, values in ordered[len(shown) :]]
            label = f"{len(rest)} more objects"
            lines.append(line(label, sum(a for a, _ in rest), sum(b for _, b in rest)))
        functions = sorted(
            set(first) | set(second),
            key=lambda key: -abs(first.get(key, 0.0) - second.get(key, 0.0)),
        )
        lines.append(f"  the {min(top, len(functions))} functions whose µs differ most:")
        for where, function in functions[:top]:
            label = f"{function[:30]} ({where.split('.', 1)[0][:10]})"
            lines.append(
                line(label, first.get((where, function), 0.0), second.get((where, function), 0.0))
            )
        return lines
