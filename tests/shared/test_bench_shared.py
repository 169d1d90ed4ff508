"""scripts/bench/bench_shared.py still runs: a smoke run with tiny counts (--quick), so that
a change which breaks the benchmark fails the suite. Its figures are not judged here (speed
is measured by running the benchmark, not by a timed test); only that each section printed
figures that make sense."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

from tests.shared.conftest import require

ROOT = Path(__file__).resolve().parents[2]


async def test_bench_shared_prints_its_figures() -> None:
    require("valkey")
    argv = [sys.executable, str(ROOT / "scripts" / "bench" / "bench_shared.py"), "--quick"]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    async with asyncio.timeout(90):
        out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    added = re.search(r"^added overhead ack: ([+-]\d+\.\d+) ms p50", out, re.M)
    assert added is not None, out
    trips = re.search(
        r"^  per round: median [+-][\d.]+ ms, .*two PING round trips alone", out, re.M
    )
    assert trips is not None, out  # the relaxed profile's rounds and what round trips cost
    ratio = re.search(r"^ack +([\d,]+) +[\d.]+ +([\d,]+) +[\d.]+ +[\d.]+ +(\d+\.\d+)x", out, re.M)
    assert ratio is not None and float(ratio.group(3)) > 0, out
    # what the disk did in each profile's windows, beside its figures
    disk = re.findall(r"^  (ack|relaxed): the disk meanwhile: 1 replica (\d+) syncs, .*; "
                      r"3 replicas (\d+) syncs, p99 [\d.,]+ ms, max", out, re.M)  # fmt: skip
    assert {d[0] for d in disk} == {"ack", "relaxed"}, out
    assert all(int(n) > 0 for d in disk for n in d[1:]), out
    stored = re.search(r"^shared-tier bytes (\d+\.\d+)x the items", out, re.M)
    assert stored is not None and float(stored.group(1)) > 0, out
