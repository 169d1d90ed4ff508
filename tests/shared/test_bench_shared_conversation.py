"""scripts/bench/bench_shared_conversation.py still runs: a smoke run with tiny counts
(--quick), so that a change which breaks the benchmark fails the suite. Its figures are not
judged here (speed is measured by running the benchmark, not by a timed test); only that
each section printed figures that make sense (a turn writes, so fsyncs at least once)."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

from tests.shared.conftest import require

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "bench_shared_conversation.py"


async def test_bench_shared_conversation_prints_its_figures() -> None:
    require("valkey")
    argv = [sys.executable, str(SCRIPT), "--quick"]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    async with asyncio.timeout(90):
        out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    added = re.search(
        r"^added latency per conversation turn, ack: ([+-]\d+\.\d+) ms p50", out, re.M
    )
    assert added is not None, out
    trips = re.search(r"^shared ack .* (\d+\.\d\d)$", out, re.M)
    assert trips is not None and float(trips.group(1)) >= 2, out
    if "## fsyncs: skipped" not in out:  # (no strace, or ptrace refused)
        fsyncs = re.search(r"^conversation turn +\d+ +\d+ +(\d+\.\d\d)$", out, re.M)
        assert fsyncs is not None and float(fsyncs.group(1)) >= 1, out
    stored = re.search(r"^shared-tier bytes (\d+\.\d+)x the conversation's items", out, re.M)
    assert stored is not None and float(stored.group(1)) > 0, out
