"""`ocxproxy serve` in this process, telling on SIGUSR1 where its memory is, for benchmarks.

On SIGUSR1 it writes a JSON report to $OCXPROXY_MEMORY_OUT (default
/tmp/ocxproxy-memory.json): its RSS (anonymous and file-backed), glibc malloc's heap
(`mallinfo2`: bytes in use, free inside the heap, mmapped), pymalloc's arenas and the
bytes in their allocated blocks (`sys._debugmallocstats`), and the bytes tracemalloc
traces when $OCXPROXY_TRACEMALLOC=N (frames kept per allocation) is set; then, with
tracemalloc on, the snapshot goes to the same path + `.snap` (read it with
`tracemalloc.Snapshot.load`). Tracing doubles the process's memory and slows it down: its
RSS figures are not the product's. Everything else is `ocxproxy`'s own command line:

    python scripts/bench/memory_proxy.py serve --upstream URL --port 0 ...
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import re
import signal
import sys
import tempfile
import tracemalloc
from pathlib import Path
from types import FrameType

import orjson

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from ocxproxy import cli  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mallinfo() -> dict[str, int]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc 2.33+
        return {}
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {
        "heap": info.arena,  # bytes of the main and thread arenas (not mmapped chunks)
        "in_use": info.uordblks,
        "free": info.fordblks,
        "mmapped": info.hblkhd,
        "top_free": info.keepcost,  # at the top of the main heap: what malloc_trim gives back
    }


def _pymalloc() -> dict[str, int]:
    """A few totals of `sys._debugmallocstats()` (it prints them to the C stderr)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    figures = {}
    for name, pattern in (
        ("arenas", r"# arenas allocated current\s*=\s*([\d,]+)"),
        ("allocated_blocks", r"# bytes in allocated blocks\s*=\s*([\d,]+)"),
        ("available_blocks", r"# bytes in available blocks\s*=\s*([\d,]+)"),
        ("total", r"\nTotal\s*=\s*([\d,]+)"),
    ):
        m = re.search(pattern, text)
        if m:
            figures[name] = int(m.group(1).replace(",", ""))
    return figures


def _status() -> dict[str, int]:
    figures = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                figures[key] = int(value.split()[0]) * 1024
    return figures


def report(signum: int, frame: FrameType | None) -> None:
    out = os.environ.get("OCXPROXY_MEMORY_OUT", "/tmp/ocxproxy-memory.json")
    figures: dict[str, object] = {
        "status": _status(),
        "malloc": _mallinfo(),
        "pymalloc": _pymalloc(),
        "gc_tracked": len(gc.get_objects()) + gc.get_freeze_count(),  # frozen ones too
    }
    if tracemalloc.is_tracing():
        figures["traced"] = tracemalloc.get_traced_memory()[0]
        tracemalloc.take_snapshot().dump(out + ".snap")
    Path(out + ".part").write_bytes(orjson.dumps(figures))
    os.replace(out + ".part", out)


def main() -> None:
    frames = int(os.environ.get("OCXPROXY_TRACEMALLOC", "0") or 0)
    if frames > 0:
        tracemalloc.start(frames)
    signal.signal(signal.SIGUSR1, report)
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
