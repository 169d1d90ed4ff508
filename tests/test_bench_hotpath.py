"""scripts/bench/bench_hotpath.py still runs: a few-second smoke run with tiny counts, so
that a change which breaks the benchmark fails the suite. Its figures are not judged here
(speed is measured by running the benchmark, not by a timed test)."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import missing_tool

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(8k|128k) +(\d+\.\d) \( *(\d+\.\d)\) +(\d+\.\d) \( *(\d+\.\d)\)$", re.M)


async def run_bench(script: str, *args: str, seconds: float = 60) -> str:
    """What scripts/bench/`script` prints with `args`, once it exited 0."""
    argv = [sys.executable, str(ROOT / "scripts" / "bench" / script), *args]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    async with asyncio.timeout(seconds):
        out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    return out


async def test_bench_hotpath_prints_its_figures() -> None:
    out = await run_bench("bench_hotpath.py", "--n", "20", "--rounds", "2")
    rows = {m.group(1): [float(x) for x in m.groups()[1:]] for m in ROW.finditer(out)}
    assert set(rows) == {"8k", "128k"}, out
    for figures in rows.values():
        json_median, json_min, sse_median, sse_min = figures
        assert 0 < json_min <= json_median and 0 < sse_min <= sse_median, out


@pytest.mark.parametrize(
    "mode",
    [["--envelope-ab"], ["--null"], ["--envelope-ab", "--part", "final"],
     ["--envelope-ab", "--idle", "50"]],
)  # fmt: skip
async def test_bench_hotpath_envelope_ab_prints_its_figures(mode: list[str]) -> None:
    out = await run_bench("bench_hotpath.py", "--n", "20", "--rounds", "3", *mode)
    x = r"-?\d+\.\d\d"  # differences: noise can make them negative
    cells = rf"({x}) ± +(\d+\.\d\d) +({x}) +({x}) ± +(\d+\.\d\d) +(\d+\.\d) +(\d+) +(\d+\.\d|-)"
    rows = re.findall(rf"^(8k|128k) (JSON|SSE) +{cells}$", out, re.M)
    assert [row[:2] for row in rows] == [
        ("8k", "JSON"), ("8k", "SSE"), ("128k", "JSON"), ("128k", "SSE")
    ], out  # fmt: skip
    for row in rows:
        se, trimmed_se, on = float(row[3]), float(row[6]), float(row[7])
        assert on > 0 and se >= 0 and trimmed_se >= 0, out
        assert row[9] == "-" or 0 <= float(row[9]) <= 100, out
        assert row[8] == "0", out  # no collection in a timed round: both modes' alike


async def test_bench_hotpath_envelope_ab_times_the_turns_calls_in_place() -> None:
    out = await run_bench(
        "bench_hotpath.py", "--n", "10", "--rounds", "3", "--durable", "--envelope-ab", "--calls"
    )
    cases = re.split(r"^(?:8k|128k) (?:JSON|SSE) .*$", out, flags=re.M)[1:]
    assert len(cases) == 4, out
    x = r"\d+\.\d\d"
    for case in cases:  # each case's calls, under its row
        calls = dict(re.findall(rf"^  (\w+\.\w+) +({x} +{x} +[+-]{x})$", case, re.M))
        assert set(calls) == {"Exchange.finish", "Store.put", "Ledger.put", "Exchange.commit",
                              "Committer._cut", "Journal.encode"}, out  # fmt: skip
        for cells in calls.values():
            on, off, difference = (float(cell) for cell in cells.split())  # (each rounded)
            assert on > 0 and off > 0 and abs(on - off - difference) < 0.02, out


async def test_bench_hotpath_envelope_ab_samples_where_the_time_goes_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    import native_samples

    if (why := native_samples.available()) is not None:  # (.ci/run installs perf)
        missing_tool(why)
    out = await run_bench(
        "bench_hotpath.py", "--n", "10", "--rounds", "20", "--envelope-ab", "--perf",
        "--perf-period", "20", "--top", "100000",
    )  # fmt: skip
    cases = re.split(r"^(?:8k|128k) (?:JSON|SSE) .*$", out, flags=re.M)[1:]
    assert len(cases) == 4, out
    x = r"-?\d+\.\d\d"
    row = re.compile(rf"^    (.+?) +({x}) +({x}) +([+-]{x})$", re.M)
    for case in cases:
        by_object, by_function = re.split(r"^  the \d+ functions whose .*$", case, flags=re.M)
        objects = {
            label: [float(cell) for cell in cells] for label, *cells in row.findall(by_object)
        }
        functions = {
            label: [float(cell) for cell in cells] for label, *cells in row.findall(by_function)
        }
        total_on, total_off, _ = objects.pop("all samples")
        assert total_on > 0 and total_off > 0 and functions, case
        # Every sample is in one object's line (the minor ones summed), each rounded.
        assert abs(sum(on for on, _, _ in objects.values()) - total_on) < 0.01 * len(objects), case
        assert abs(sum(off for _, off, _ in objects.values()) - total_off) < 0.01 * len(objects), (
            case
        )
        for on, off, difference in (*objects.values(), *functions.values()):
            assert abs(on - off - difference) < 0.02, case
        # The compiled envelope runs in the rounds with the envelope on only.
        on, off, _ = functions["answer_members (_speedups)"]
        assert on > 0 and off == 0, case


def test_call_timers_put_back_what_they_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    import importlib

    import bench_hotpath

    owners = [(getattr(importlib.import_module(module), owner), name)
              for module, owner, name in bench_hotpath.TIMED_CALLS]  # fmt: skip
    before = [vars(owner)[name] for owner, name in owners]
    timers = bench_hotpath.CallTimers()
    try:
        assert all(vars(o)[n] is not b for (o, n), b in zip(owners, before, strict=True))
    finally:
        timers.remove()
    assert all(vars(o)[n] is b for (o, n), b in zip(owners, before, strict=True))


async def test_bench_compaction_item_prints_its_figures() -> None:
    out = await run_bench("bench_compaction_item.py", "--n", "10", "--rounds", "2", seconds=120)
    rows = re.findall(
        r"^(8k|128k) +\d+\.\d / +\d+\.\d +\d+\.\d / +\d+\.\d +[+-]\d+\.\d / +[+-]\d+\.\d$",
        out,
        re.M,
    )
    assert rows == ["8k", "128k"], out


@pytest.mark.parametrize(
    ("part", "turned_off"),
    [("all", [0, 1, 2, 3, 4, 5]), ("request", [4]), ("pending", [1]), ("final", [0, 2, 3, 5])],
)
def test_envelope_switch_puts_back_what_it_turned_off(
    monkeypatch: pytest.MonkeyPatch, part: str, turned_off: list[int]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    import bench_hotpath

    from ocxproxy.continuation.envelope import Envelope
    from ocxproxy.http import exchange

    def current() -> list[object]:
        return [Envelope.answer, Envelope.pending_event, Envelope.terminal_event,
                Envelope.complete, exchange.Envelope, exchange.spliced]  # fmt: skip

    before = current()
    switch = bench_hotpath.EnvelopeSwitch(part=part)
    switch.off()
    try:
        changed = [i for i, (now, then) in enumerate(zip(current(), before, strict=True))
                   if now is not then]  # fmt: skip
        assert changed == turned_off
    finally:  # (the envelope on again for the tests after this one, whatever happens)
        switch.on()
    assert all(now is then for now, then in zip(current(), before, strict=True))


@pytest.mark.parametrize("size", ["8k", "128k"])
async def test_bench_envelope_calls_prints_its_figures(size: str) -> None:
    out = await run_bench(
        "bench_envelope_calls.py", "--size", size, "--turns", "60", "--repeat", "20"
    )
    assert f"µs per call, {size} continuation turns" in out, out
    rows = re.findall(r"^  (\S+(?: \S+)?) +(-?\d+\.\d\d) +(-?\d+\.\d\d) +(-?\d+\.\d)x$", out, re.M)
    labels = {row[0] for row in rows}
    assert labels >= {
        "Envelope()", "answer", "pending_event response.created",
        "pending_event response.in_progress", "terminal_event response.completed",
    }, out  # fmt: skip
    assert all(float(warm) > 0 for _, _, warm, _ in rows), out


def test_bench_hotpath_ir_simulates_this_machines_caches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--cache gives callgrind the first core's L1s and L2 as the kernel reports them, and
    the 2-core VM's where it reports none."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    import bench_hotpath_ir

    caches = [("1", "Data", "48K", "12"), ("1", "Instruction", "32K", "8"),
              ("2", "Unified", "2048K", "16"), ("3", "Unified", "307200K", "20")]  # fmt: skip
    for number, (level, kind, size, ways) in enumerate(caches):
        index = tmp_path / f"index{number}"
        index.mkdir()
        files = {"level": level, "type": kind, "size": size, "ways_of_associativity": ways}
        for name, value in (files | {"coherency_line_size": "64"}).items():
            (index / name).write_text(value + "\n")
    monkeypatch.setattr(bench_hotpath_ir, "_SYSFS_CACHES", tmp_path)
    assert bench_hotpath_ir.cache_options() == [
        "--cache-sim=yes", "--I1=32768,8,64", "--D1=49152,12,64", "--LL=2097152,16,64"
    ]  # fmt: skip
    monkeypatch.setattr(bench_hotpath_ir, "_SYSFS_CACHES", tmp_path / "none")
    assert bench_hotpath_ir.cache_geometry() == bench_hotpath_ir._DEFAULT_CACHES


def test_steal_is_the_share_of_all_cores_time_stolen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    import bench_hotpath

    assert bench_hotpath.steal_percent((10, 1000), (60, 2000)) == "5.0"
    assert bench_hotpath.steal_percent(None, (60, 2000)) == "-"
    assert bench_hotpath.steal_percent((10, 1000), (10, 1000)) == "-"
    assert bench_hotpath.steal_percent((10, 1000), (10, 1001)) == "0.0"
    ticks = bench_hotpath.cpu_ticks()
    assert ticks is None or 0 <= ticks[0] <= ticks[1]


def test_bench_hotpath_ir_sweeps_before_each_cold_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """--cold's child (as callgrind runs it, here without valgrind) sweeps the last level's
    size before each counted turn, and only with --cold."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    import bench_hotpath_ir

    sweeps: list[int] = []
    monkeypatch.setattr(bench_hotpath_ir, "sweep", sweeps.append)
    geometry = {"I1": "32768,8,64", "D1": "49152,12,64", "LL": "2097152,16,64"}
    monkeypatch.setattr(bench_hotpath_ir, "cache_geometry", lambda: geometry)
    run = bench_hotpath_ir.child
    run("sse", "8k", 3, codex=False, durable=False, first_turns=False, served=False, cold=True)
    assert sweeps == [2097152] * 3
    run("json", "8k", 2, codex=False, durable=False, first_turns=False, served=False)
    assert sweeps == [2097152] * 3


async def test_bench_hotpath_ir_refuses_cold_without_the_caches() -> None:
    argv = [sys.executable, str(ROOT / "scripts" / "bench" / "bench_hotpath_ir.py"), "--cold"]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(30):
        err = (await proc.communicate())[1].decode()
    assert proc.returncode == 2 and "--cold sweeps the simulated caches" in err, err
