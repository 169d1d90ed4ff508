"""scripts/bench/bench_background_shared.py still runs: a smoke run with tiny counts
(--quick), so that a change which breaks the benchmark fails the suite. Its timings are
not judged here (speed is measured by running the benchmark); only that every section
printed its figures, and that every resume on another replica was exact."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from tests.shared.conftest import require

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


async def test_bench_background_shared_prints_its_figures() -> None:
    require("valkey")
    script = ROOT / "scripts" / "bench" / "bench_background_shared.py"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "--quick", cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(240):
        out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    for row in ("create -> queued answer", "cancel on another replica", "owner kill -9"):
        assert re.search(rf"^{row}.* \d+ +[\d,.]+ +[\d,.]+ +[\d,.]+ ", out, re.M), out
    assert re.search(r"^cancelled: 10/10$", out, re.M), out
    assert "resume on another replica after a random cut: 16/16 gap-free" in out, out
