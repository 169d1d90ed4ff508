"""Store-level figures for the journal at scale. Prints figures; asserts nothing.

    python scripts/bench/bench_journal.py [--records 100000] [--chain 100] [--clients 64]

1. fill: --records durable turns in chains of --chain turns, --clients turns in flight
   (each awaits its commit, as the HTTP layer does): turns/s and commits (fsyncs).
2. checkpoint at full size, with the GC settled as `serve` keeps it (heap.settle): per
   checkpoint its wall time, the event loop thread's CPU, the loop's stalls (a 1 ms
   ticker's lateness) over 2/5/10 ms and the worst, and the longest loop step's CPU
   (every callback the loop runs is timed); and the worst stall while idle, to compare.
3. restart: start() time (checkpoint + journal replay) and RSS after it, in a fresh process.
4. disk: allocated bytes of the state dir / bytes the store counts (live_bytes).

    python scripts/bench/bench_journal.py --keep DIR            # fill DIR/state, keep it
    python scripts/bench/bench_journal.py --restart-only DIR/state
    python scripts/bench/bench_journal.py --append-only DIR/state --bytes 16777216
    python scripts/bench/bench_journal.py --checkpoint-only DIR/state [--churn 20000]
    python scripts/bench/bench_journal.py --serve-only DIR/state [--python A B] [--nice -10]

    python scripts/bench/bench_journal.py --commit-cpu [--turns 20000] [--rounds 3] [--clients 4]

--commit-cpu times the commit path alone: --turns turns by 16 clients (or --clients; chains
of 100, each awaiting its commit, so each fsync carries as many turns as there are
clients) into a memory-only store and into a durable one with the fsync helper, in
alternating rounds; per turn, the on-CPU time of this process (every thread) and of the
helper from /proc/*/schedstat (nanoseconds: the scheduler's own account, not sampled
ticks), durable - memory, and turns per fsync.

    valgrind --tool=callgrind python scripts/bench/bench_journal.py --commit-round \
        --turns 2300 --clients 16 --chain 10

--commit-round runs one durable round of --commit-cpu's (300 warm turns first; --clients
clients, chains of --chain) and prints turns per fsync: under callgrind at two --turns,
the difference of the instruction counts is the commit path's per turn, beside the
figures of a memory-only round (--commit-round memory). With --callgrind only the
measured turns are counted (callgrind_control switches instrumentation on after the
warm-up and off before the store closes; start-up and imports, which differ by a few
million instructions between runs of one tree, are left out), so one run gives the
figure: the collected count ÷ --turns.

    PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no \
        python scripts/bench/bench_journal.py --commit-round --callgrind --turns 2000 \
        --clients 4 --chain 10

    valgrind --tool=callgrind --callgrind-out-file=/dev/null --collect-atstart=no \
        --toggle-collect='*functools_reduce*' \
        python scripts/bench/bench_journal.py --checkpoint-round DIR/state [--churn K]

--checkpoint-round loads a copy of DIR/state, writes a checkpoint, commits --churn new
turns, and writes one more inside functools.reduce: under callgrind as above, the
instructions of the event loop's thread for that checkpoint (its threads' work, the
writing, is not counted), a figure the machine's load does not move.

--append-only commits turns to DIR/state (chains of 10, 16 clients) with no checkpoint until
--bytes of journal follow the last one (the most start-up replays under a trigger of that
many bytes): --restart-only then times that start-up. Fill with room under the 100,000
records of --restart-only's store, so that no record is evicted at its start.

--checkpoint-only loads a copy of DIR/state and times --rounds checkpoints (2. above);
with --churn K, K new turns (evicting the K oldest records: sparse journal files, so
compaction runs too) are committed before each.

--serve-only times whole `ocxproxy serve` processes on a copy of the state dir, from spawn
to /readyz 200, with their CPU seconds and RSS then; several --python interpreters (each a
worktree's .venv/bin/python, run from that worktree) alternate, an A/B in one run. Python
caches ocxproxy's bytecode, as an installed package has it (--no-bytecode: removes it first
and writes none, as a source tree with PYTHONDONTWRITEBYTECODE set: every start compiles).

    python scripts/bench/bench_journal.py --rotations [--rounds 10] [--clients 8]

--rotations forces --rounds checkpoints (each rotates the journal to a new file), 0.4 s
apart, into a durable store with the fsync helper that --clients clients commit to, each
waiting 0-20 ms (uniform) after its commit before its next turn (16 clients unless
--clients is given; chains of --chain): per checkpoint, whether the fsync helper or the
committer's thread wrote the first commit after its capture, that commit's time from its
cut (taken from the queue) to its outcome applied, how long after the capture it landed,
and the longest commit latency of the turns begun during the capture or in the 20 ms
after it; then the first commits' cut-to-landed time against the others', and every
turn's commit latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import http.client
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import orjson

from ocxproxy import heap
from ocxproxy.model import Turn
from ocxproxy.store import Store


def turn(rid: str, i: int) -> Turn:
    user = orjson.dumps({"role": "user", "content": f"turn {i} of {rid}: please update the config"})
    out = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": f"Done with step {i}; the file is written."}],
    }
    response = {
        "id": rid,
        "object": "response",
        "status": "completed",
        "model": "m",
        "output": [out],
        "usage": {"input_tokens": 50, "output_tokens": 12},
    }
    return Turn(
        rid,
        "scope",
        True,
        user + b"," + orjson.dumps(out),
        2,
        frozenset(),
        orjson.dumps(response),
        backend="http://b",
        affinity_key="root:" + rid,
    )


def make(state: Path) -> Store:
    return Store(
        max_resident_bytes=64 * 1024**2, max_entries=100_000, ttl=30 * 86400.0, state_dir=state
    )


class Ticker:
    """The lateness of a 1 ms sleep: how long the loop was kept from running."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.late: list[float] = []
        self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - t - 0.001
            self.worst = max(self.worst, late)
            self.late.append(late)

    def reset(self) -> None:
        self.worst = 0.0
        self.late.clear()


class StepTimer:
    """The CPU of the longest callback (step) the event loop ran while installed."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._run = asyncio.events.Handle._run

    def __enter__(self) -> StepTimer:
        run, timer = self._run, self

        def timed(handle: asyncio.events.Handle) -> None:
            cpu = time.thread_time()
            run(handle)
            timer.worst = max(timer.worst, time.thread_time() - cpu)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.events.Handle._run = self._run  # type: ignore[method-assign]


async def checkpoints(store: Store, rounds: int, churn: int = 0) -> None:
    """Time `rounds` checkpoints (after `churn` new turns each) with the heap settled."""
    ticker = Ticker()
    for n in range(rounds):
        parent = None
        for i in range(churn):
            parent = store.put(turn(f"churn{n}_{i}", i % 50), parent if i % 50 else None)
        await store.commit()
        heap.settle()  # as `serve` keeps the heap: what was built since is frozen
        await asyncio.sleep(0.2)
        ticker.reset()
        with StepTimer() as steps:
            t0, cpu = time.perf_counter(), time.thread_time()
            assert await store.flush()
            took, cpu = time.perf_counter() - t0, time.thread_time() - cpu
        over = "/".join(str(sum(x > ms / 1e3 for x in ticker.late)) for ms in (2, 5, 10))
        print(
            f"checkpoint at {len(store)} records: {took * 1e3:.0f} ms wall, loop thread "
            f"{cpu * 1e3:.0f} ms CPU; loop stalls over 2/5/10 ms {over}, worst "
            f"{ticker.worst * 1e3:.1f} ms; longest loop step {steps.worst * 1e3:.1f} ms CPU"
        )
    ticker.task.cancel()


async def fill(state: Path, n: int, chain: int, clients: int) -> None:
    store = make(state)
    await store.start()
    ticker = Ticker()
    counter = iter(range(n))
    t0 = time.perf_counter()

    async def client() -> None:
        parent, depth = None, 0
        for i in counter:
            if depth == chain:
                parent, depth = None, 0
            record = store.put(turn(f"resp_{i:07d}", depth), parent)
            await store.commit(record)
            parent, depth = record, depth + 1

    await asyncio.gather(*(client() for _ in range(clients)))
    took = time.perf_counter() - t0
    commits = store.metrics.journal_commits.get()
    print(
        f"fill: {n} turns in {took:.1f}s = {n / took:.0f} turns/s, {commits:.0f} commits "
        f"({n / max(commits, 1):.1f} turns per fsync), worst loop stall {ticker.worst * 1e3:.1f} ms"
    )
    await asyncio.sleep(0.2)
    ticker.reset()
    await asyncio.sleep(1.0)
    print(f"idle: worst loop stall {ticker.worst * 1e3:.1f} ms over 1 s")
    await checkpoints(store, 2)
    # a few more turns so start-up also replays a journal tail
    for i in range(2000):
        await store.commit(store.put(turn(f"tail_{i}", 0), None))
    stats = store.stats()
    t0 = time.perf_counter()
    await store.close()
    print(f"close: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    allocated, n_files = disk_usage(state)
    print(
        f"disk: {allocated / 1e6:.1f} MB allocated, store counts {stats.live_bytes / 1e6:.1f} MB "
        f"-> {allocated / stats.live_bytes:.2f}x; {n_files} files"
    )
    ticker.task.cancel()


def disk_usage(root: Path) -> tuple[int, int]:
    """Allocated bytes (st_blocks) and number of files under `root`."""
    paths = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in paths), len(paths)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def checkpoint_only(state: Path, rounds: int, churn: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_journal_") as tmp:
        copy = Path(tmp) / "state"
        shutil.copytree(state, copy)
        store = make(copy)
        await store.start()
        print(f"load average: {' '.join(f'{n:.2f}' for n in os.getloadavg())}")
        await checkpoints(store, rounds, churn)
        t0 = time.perf_counter()
        await store.sweep()  # (a pass over every record, in short steps of the loop)
        print(f"sweep at {len(store)} records: {(time.perf_counter() - t0) * 1e3:.1f} ms")
        await store.close()


def checkpoint_round(state: Path, churn: int) -> None:
    """A checkpoint of a copy of `state` (after a first one and `churn` new turns) run
    inside functools.reduce, the C function callgrind is told to count in."""
    with tempfile.TemporaryDirectory(prefix="bench_journal_") as tmp:
        copy = Path(tmp) / "state"
        shutil.copytree(state, copy)
        loop = asyncio.new_event_loop()
        store = make(copy)
        loop.run_until_complete(store.start())
        assert loop.run_until_complete(store.flush())
        parent = None
        for i in range(churn):
            parent = store.put(turn(f"churn_{i}", i % 10), parent if i % 10 else None)
        loop.run_until_complete(store.commit())
        heap.settle()  # as `serve` keeps the heap
        functools.reduce(lambda _, __: loop.run_until_complete(store.flush()), [0], None)
        print(f"checkpoint at {len(store)} records")
        loop.run_until_complete(store.close())
        loop.close()


async def append_only(state: Path, bytes_: int) -> None:
    """Turns committed to DIR/state with no checkpoint until `bytes_` of journal follow the
    last one: what start-up replays at worst is the journal a checkpoint trigger allows."""
    store = Store(
        max_resident_bytes=64 * 1024**2, max_entries=100_000, ttl=30 * 86400.0,
        state_dir=state, checkpoint_bytes=1 << 40, max_disk_bytes=1 << 40,
    )  # fmt: skip
    await store.start()
    disk, counter = store.disk, iter(range(10**9))
    assert disk is not None

    async def client() -> None:
        parent, depth = None, 0
        for i in counter:
            if disk.since_checkpoint >= bytes_:
                return
            if depth == 10:
                parent, depth = None, 0
            record = store.put(turn(f"more_{i:07d}", depth), parent)
            await store.commit(record)
            parent, depth = record, depth + 1

    await asyncio.gather(*(client() for _ in range(16)))
    print(f"append: {disk.since_checkpoint} bytes of journal after the checkpoint")
    await store.close()


async def restart(state: Path) -> None:
    before = rss_mib()
    store = make(state)
    t0, cpu = time.perf_counter(), time.process_time()
    await store.start()
    took, cpu = time.perf_counter() - t0, time.process_time() - cpu
    print(
        f"restart: start() {took:.2f}s ({cpu:.2f}s CPU, both threads) for {len(store)} "
        f"records; RSS {rss_mib():.0f} MiB (interpreter + imports {before:.0f} MiB)"
    )
    await store.close()


def on_cpu(pid: int) -> float:
    """Seconds every thread of live process `pid` has run (/proc/.../schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


def helpers() -> list[int]:
    """This process's children (the fsync helper), listed under the thread that made them."""
    me, out = os.getpid(), []
    for task in os.listdir(f"/proc/{me}/task"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{me}/task/{task}/children").read_text().split()]
    return out


def instrument(on: bool) -> None:
    """Switch callgrind's instrumentation of this process on or off."""
    mode = "on" if on else "off"
    subprocess.run(["callgrind_control", "-i", mode, str(os.getpid())], check=True)


async def commit_round(
    state: Path | None, turns: int, clients: int = 16, chain: int = 100, *, counted: bool = False
) -> tuple[float, float, float]:
    """µs of CPU per turn (this process, the helper) and turns per fsync; `counted`:
    callgrind counts the measured turns only."""
    store = Store(
        max_resident_bytes=64 * 1024**2, max_entries=100_000, ttl=30 * 86400.0,
        state_dir=state, fsync_child=state is not None,
    )  # fmt: skip
    await store.start()
    for i in range(300):  # the journal's room allocated, the helper warm
        await store.commit(store.put(turn(f"warm_{i}", 0), None))
    kids, counter = helpers(), iter(range(turns))
    if counted:
        instrument(True)
    commits = store.metrics.journal_commits.get()
    cpu, helper = on_cpu(os.getpid()), sum(on_cpu(k) for k in kids)

    async def client() -> None:
        parent, depth = None, 0
        for i in counter:
            if depth == chain:
                parent, depth = None, 0
            record = store.put(turn(f"resp_{i:07d}", depth), parent)
            await store.commit(record)
            parent, depth = record, depth + 1

    await asyncio.gather(*(client() for _ in range(clients)))
    cpu = on_cpu(os.getpid()) - cpu
    helper = sum(on_cpu(k) for k in kids) - helper
    commits = store.metrics.journal_commits.get() - commits
    if counted:
        instrument(False)
    await store.close()
    return cpu / turns * 1e6, helper / turns * 1e6, turns / max(commits, 1)


async def commit_cpu(turns: int, rounds: int, clients: int = 16) -> None:
    print("load average: " + " ".join(f"{n:.2f}" for n in os.getloadavg()))
    got: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for n in range(rounds):
        for durable in (False, True) if n % 2 == 0 else (True, False):
            with tempfile.TemporaryDirectory(prefix="bench_journal_") as tmp:
                state = Path(tmp) / "state" if durable else None
                got[durable].append(await commit_round(state, turns, clients))
            cpu, helper, per = got[durable][-1]
            if durable:
                print(
                    f"durable: {cpu:.1f} + helper {helper:.1f} µs CPU/turn, {per:.1f} turns/fsync "
                    f"(helper {helper * per:.0f} µs a fsync)"
                )
            else:
                print(f"memory:  {cpu:.1f} µs CPU per turn")
    memory = sum(c for c, _, _ in got[False]) / rounds
    cpu = sum(c for c, _, _ in got[True]) / rounds
    helper = sum(h for _, h, _ in got[True]) / rounds
    print(
        f"durable - memory: {cpu + helper - memory:.1f} µs per turn ({cpu - memory:.1f} in this "
        f"process, {helper:.1f} in the helper); load average {os.getloadavg()[0]:.2f}"
    )


AFTER = 0.02  # --rotations: the turns begun this long after a capture are its
SOON = 0.05  # and the commits landed this long after it


async def rotations(rounds: int, clients: int, chain: int) -> None:
    """--rotations: the commits right after each of `rounds` forced checkpoints."""
    print("load average: " + " ".join(f"{n:.2f}" for n in os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="bench_journal_") as tmp:
        store = Store(
            max_resident_bytes=64 * 1024**2, max_entries=100_000, ttl=30 * 86400.0,
            state_dir=Path(tmp) / "state", fsync_child=True,
        )  # fmt: skip
        await store.start()
        disk = store.disk
        assert disk is not None and disk.committer is not None and disk.journal is not None
        committer, journal = disk.committer, disk.journal
        landed: list[tuple[float, Any, bool]] = []  # (when, commit, by the thread)
        threaded: set[Any] = set()  # the commits the thread wrote
        captures: list[tuple[float, float]] = []  # a capture's start and end

        finish, write, append, quiet, take = (
            committer._finish, journal.write, journal.append, committer.quiet, committer._take
        )  # fmt: skip
        cut: dict[Any, float] = {}  # a commit's future: when it was cut

        def finished(outcome: Any, future: Any) -> None:
            landed.append((time.perf_counter(), future, future in threaded))
            finish(outcome, future)

        grows: list[tuple[float, float]] = []  # the room's growths: start and end

        def grow(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return grow_(*args)
            finally:
                grows.append((t0, time.perf_counter()))

        def took() -> Any:
            taken = take()
            cut[taken[1]] = time.perf_counter()
            return taken

        def thread_write(*args: Any) -> Any:
            threaded.add(committer._inflight)
            return write(*args)

        def thread_append(*args: Any) -> Any:
            threaded.add(committer._inflight)
            return append(*args)

        @contextlib.asynccontextmanager
        async def held() -> Any:
            pack = journal.active
            async with quiet():
                began = time.perf_counter()
                yield
            if journal.active != pack:
                captures.append((began, time.perf_counter()))

        grow_ = journal.grow
        wrapped: dict[object, dict[str, Any]] = {
            committer: {"_finish": finished, "_take": took, "quiet": held},
            journal: {"write": thread_write, "append": thread_append, "grow": grow},
        }
        for owner, methods in wrapped.items():
            for name, method in methods.items():
                setattr(owner, name, method)
        waits: list[tuple[float, float, Any]] = []  # (submitted, landed, its commit)
        done = asyncio.Event()
        counter, spread = iter(range(10**9)), random.Random(0)

        async def client() -> None:
            parent, depth = None, 0
            while not done.is_set():
                if depth == chain:
                    parent, depth = None, 0
                record = store.put(turn(f"resp_{next(counter):07d}", depth), parent)
                t0, future = time.perf_counter(), committer.pending()
                await store.commit(record)
                waits.append((t0, time.perf_counter(), future))
                parent, depth = record, depth + 1
                await asyncio.sleep(spread.uniform(0.0, 0.02))

        tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
        await asyncio.sleep(1.0)
        for _ in range(rounds):
            assert await store.flush()
            await asyncio.sleep(0.4)
        done.set()
        await asyncio.gather(*tasks)
        await store.close()
    firsts, first_commits = [], set()
    for began, at in captures:
        first = next((x for x in landed if x[0] > at), None)
        if first is None:
            continue
        firsts.append(first[0] - cut[first[1]])
        first_commits.add(first[1])
        soon = [x[0] - cut[x[1]] for x in landed if at < x[0] < at + SOON and x[1] in cut]
        growth = [f"{(b - a) * 1e3:.1f}" for a, b in grows if at < a < at + SOON]
        near = [t1 - t0 for t0, t1, _ in waits if began <= t0 <= at + AFTER]
        print(
            f"first commit after a capture: {'thread' if first[2] else 'helper'}, cut to "
            f"landed {firsts[-1] * 1e3:.1f} ms, {(first[0] - at) * 1e3:.1f} ms after the "
            f"capture; the slowest of the {len(soon)} commits in {SOON * 1e3:.0f} ms "
            f"{max(soon) * 1e3:.1f} ms; the room's growth then {', '.join(growth) or '-'} ms; "
            f"the {len(near)} turns begun during the capture or {AFTER * 1e3:.0f} ms after "
            f"waited up to {max(near, default=0) * 1e3:.1f} ms"
        )
    others = sorted(t - cut[f] for t, f, _ in landed if f in cut and f not in first_commits)
    firsts.sort()
    print(
        f"cut to landed: the first commits after a capture p50 "
        f"{firsts[len(firsts) // 2] * 1e3:.2f} ms, max {firsts[-1] * 1e3:.2f}; the others p50 "
        f"{others[len(others) // 2] * 1e3:.2f}, p90 {others[len(others) * 9 // 10] * 1e3:.2f}"
    )
    lat = sorted(t1 - t0 for t0, t1, _ in waits)
    n = len(lat)
    print(
        f"{n} turns: commit p50 {lat[n // 2] * 1e3:.2f} ms, p99 {lat[n * 99 // 100] * 1e3:.2f}, "
        f"max {lat[-1] * 1e3:.2f}; commits by the thread {sum(x[2] for x in landed)} of "
        f"{len(landed)}; load average {os.getloadavg()[0]:.2f}"
    )


def proc_figures(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) and RSS MiB of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return cpu, int(line.split()[1]) / 1024
    return cpu, 0.0


def serve_once(
    python: Path, state: Path, upstream: str, *, bytecode: bool
) -> tuple[float, float, float]:
    """Spawn `serve` on `state` (run from the interpreter's worktree); seconds to /readyz
    200, CPU seconds and RSS MiB then. The process is stopped with SIGTERM after. With
    `bytecode`, Python caches ocxproxy's compiled modules (as an installed package has
    them); without, none is cached and every start compiles them."""
    venv = python.absolute().parent.parent
    tree = venv.parent if venv.name == ".venv" else Path.cwd()
    argv = [str(python), "-m", "ocxproxy", "serve", "--upstream", upstream, "--port", "0"]
    argv += ["--state-dir", str(state), "--log-level", "warning"]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "" if bytecode else "1"}
    if not bytecode:  # as in a source tree where it was never written: compiled at each start
        for cache in list((tree / "ocxproxy").rglob("__pycache__")):
            shutil.rmtree(cache)
    proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:
            if "listening on http://" in line:
                url = line.split("listening on http://", 1)[1].split("/", 1)[0]
                break
        host, port = url.rsplit(":", 1)
        while True:
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            try:
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.005)
        took = time.perf_counter() - t0
        cpu, rss = proc_figures(proc.pid)
        return took, cpu, rss
    finally:
        proc.terminate()
        proc.wait(60)


def serve_rounds(state: Path, pythons: list[Path], rounds: int, *, bytecode: bool) -> None:
    """Alternate the interpreters over copies of `state` (a start may rewrite its dir)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchkit import start_backend

    backend = start_backend()
    figures: dict[Path, list[tuple[float, float, float]]] = {p: [] for p in pythons}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_journal_") as tmp:
            for n in range(rounds):
                order = pythons if n % 2 == 0 else pythons[::-1]
                for python in order:
                    copy = Path(tmp) / "state"
                    shutil.copytree(state, copy)
                    os.sync()  # else the start's first fsync waits for the copy's writeback
                    figures[python].append(serve_once(python, copy, backend.url, bytecode=bytecode))
                    shutil.rmtree(copy)
                    took, cpu, rss = figures[python][-1]
                    print(f"{python}: /readyz {took:.2f}s, {cpu:.2f}s CPU, RSS {rss:.1f} MiB")
    finally:
        backend.stop()
    for python, got in figures.items():
        walls = sorted(t for t, _, _ in got)
        cpus = sorted(c for _, c, _ in got)
        print(
            f"{python}: /readyz median {walls[len(walls) // 2]:.2f}s (min {walls[0]:.2f}, max "
            f"{walls[-1]:.2f}), CPU median {cpus[len(cpus) // 2]:.2f}s, RSS max "
            f"{max(r for _, _, r in got):.0f} MiB over {len(got)} starts"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--chain", type=int, default=100)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--restart-only", metavar="DIR", help="only time a start on DIR")
    parser.add_argument("--keep", metavar="DIR", help="fill DIR/state and keep it")
    parser.add_argument("--serve-only", metavar="DIR", help="time serve to /readyz on DIR")
    parser.add_argument("--checkpoint-only", metavar="DIR", help="time checkpoints of DIR")
    parser.add_argument("--checkpoint-round", metavar="DIR", help="one, for callgrind")
    parser.add_argument("--append-only", metavar="DIR", help="journal after DIR's checkpoint")
    parser.add_argument("--bytes", type=int, default=16 * 1024**2, help="--append-only")
    parser.add_argument("--commit-cpu", action="store_true", help="the commit path's CPU")
    parser.add_argument(
        "--commit-round", nargs="?", const="durable", choices=("durable", "memory"),
        help="one round of --commit-cpu's, for callgrind",
    )  # fmt: skip
    parser.add_argument(
        "--callgrind", action="store_true",
        help="--commit-round: count the measured turns only (valgrind --instr-atstart=no)",
    )  # fmt: skip
    parser.add_argument("--turns", type=int, default=20_000, help="--commit-cpu: per round")
    parser.add_argument("--rotations", action="store_true", help="commits after rotations")
    parser.add_argument("--churn", type=int, default=0, help="--checkpoint-*: new turns")
    parser.add_argument("--python", nargs="+", type=Path, default=[Path(sys.executable)])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nice", type=int, metavar="N", help="--serve-only at niceness N")
    parser.add_argument(
        "--no-bytecode",
        dest="bytecode",
        action="store_false",
        help="--serve-only: no cached bytecode of ocxproxy (every start compiles it)",
    )
    args = parser.parse_args()
    if args.serve_only:
        if args.nice is not None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from benchkit import raise_priority

            print(raise_priority(args.nice))
        print("load average: " + " ".join(f"{n:.2f}" for n in os.getloadavg()))
        serve_rounds(Path(args.serve_only), args.python, args.rounds, bytecode=args.bytecode)
        return
    if args.commit_cpu:
        asyncio.run(commit_cpu(args.turns, args.rounds, 16 if args.clients == 64 else args.clients))
        return
    if args.rotations:
        asyncio.run(rotations(args.rounds, 16 if args.clients == 64 else args.clients, args.chain))
        return
    if args.commit_round:
        with tempfile.TemporaryDirectory(prefix="bench_journal_") as tmp:
            state = Path(tmp) / "state" if args.commit_round == "durable" else None
            round_ = commit_round(
                state, args.turns, args.clients, args.chain, counted=args.callgrind
            )
            print(f"{asyncio.run(round_)[2]:.1f} turns/fsync")
        return
    if args.checkpoint_only:
        asyncio.run(checkpoint_only(Path(args.checkpoint_only), args.rounds, args.churn))
        return
    if args.checkpoint_round:
        checkpoint_round(Path(args.checkpoint_round), args.churn)
        return
    if args.append_only:
        asyncio.run(append_only(Path(args.append_only), args.bytes))
        return
    if args.restart_only:
        asyncio.run(restart(Path(args.restart_only)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(args.keep or tmp) / "state"
        asyncio.run(fill(state, args.records, args.chain, args.clients))
        subprocess.run([sys.executable, __file__, "--restart-only", str(state)], check=True)


if __name__ == "__main__":
    main()
