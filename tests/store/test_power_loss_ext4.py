"""Power loss under a real filesystem: the state dir is an ext4 image on a loop device, and
a real `ocxproxy serve` (default flags, `--durability ack`; then `relaxed`; then large
turns kept in the journal with frequent checkpoints: MODES) takes concurrent chains of
JSON and SSE turns (some with large segments, which get their own files) and DELETEs. At
a random moment the proxy and its fsync helper are stopped (SIGSTOP to its process
group), the image file is copied, and the proxy is killed; the copy is mounted on
another loop device (ext4 replays its own journal), `ocxproxy state verify` must find
nothing but a torn journal tail, and a proxy started on it must serve every acknowledged
turn (with `relaxed`, every one answered before its window) with a continuation whose
input is a byte-extension of what the backend was sent for that turn, its whole history;
none of those DELETEs; and nothing half-made: a later or never acknowledged turn that is
there continues with its whole history too. The next round runs on that copy.

Why the copy is what a power loss leaves: every thread of the stopped processes is seen
stopped (no system call in flight) and the loop device idle before the image file is read,
and the read is taken again if the device wrote anything meanwhile, so the copy holds
exactly the blocks the device had been given, not what sat dirty in the page cache above
it. Unsynced writes stay in that page cache: the mount's `commit=600` keeps jbd2 from
committing on its 5 s timer, the kernel writes dirty pages back only once they are 30 s old
(`vm.dirty_expire_centisecs`, left as it is; a proxy lives a few seconds here), and nothing
calls `sync`; the test checks it with a write of its own, never synced, made right before
each stop, which must be gone from most copies. What this hardly sees: a journal fdatasync
whose bytes land in preallocated space not yet written makes ext4 commit its whole running
transaction (it must record that space as written), every new or renamed directory entry
included, and with concurrent turns one comes within milliseconds, so a missing fsync of a
directory shows only when the stop falls just between a rename and that commit
(tests/store/powerloss.py's simulated layer catches it).

Root and loop devices are needed (`losetup`, `mkfs.ext4`, `mount`); without them the test
is skipped with the reason. OCX_POWER_SEED=n replays a run, OCX_POWER_ROUNDS=n sets how
many power losses it cuts."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.fakes.backend import FakeBackend
from tests.http.helpers import top_level_span
from tests.serve import ROOT, Serve
from tests.store.traffic import delete, until_the_proxy_goes

WINDOW = 2.0 + 2.0  # relaxed: --snapshot-delay, plus two journal writes on a disk that stalls
IMAGE_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class Mode:
    args: tuple[str, ...]  # `serve`'s flags
    rounds: int  # power losses per run
    traffic: tuple[float, float]  # how long the traffic runs before a loss (uniform)
    large: int  # random bytes (in base64) in every `large_every`th turn's text
    large_every: int = 4
    most: tuple[int, int] | None = None  # or the loss comes once this many were answered
    budget: int = 0  # if set, --max-disk-bytes is this many MiB per loss

    def flags(self, rounds: int) -> tuple[str, ...]:
        budget = ("--max-disk-bytes", f"{self.budget * rounds}MiB") if self.budget else ()
        return self.args + budget


MODES = {
    # Default flags; every 4th turn's items go to segment files of their own.
    "ack": Mode((), 8, (0.2, 1.5), 9000),
    # Traffic outlasts the window, so some answers are older than it at the loss.
    "relaxed": Mode(("--durability", "relaxed"), 3, (WINDOW + 0.5, WINDOW + 2), 9000),
    # Large turns (~55 KiB each) kept in the journal and a checkpoint every eighth of the
    # disk budget (6 MiB with 4 losses), so the power goes while checkpoints are written and
    # after; at most ~80 turns (4.3 MiB) a round stay within the 7.2 MiB a round (0.6 of the
    # budget) the store keeps before it evicts turns.
    "ack-checkpoints": Mode(
        ("--large-segment-bytes", "1GiB"),
        4,
        (1.5, 4.0),
        48000,
        large_every=1,
        most=(40, 70),
        budget=12,
    ),
}
CHUNK = 1 << 20
CANARY = 64 * 1024  # bytes the test writes and never syncs right before each loss
BYTES = re.compile(r"checkpoint +\d+ bytes")  # `state verify`'s line for one written
TORN = "torn or corrupt journal at"  # the only problem `state verify` may report here

ASKED = int(os.environ.get("OCX_POWER_ROUNDS") or 0)  # OCX_POWER_ROUNDS: losses per test
pytestmark = pytest.mark.timeout(120 + 30 * (ASKED or max(m.rounds for m in MODES.values())))


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the state dir is an ext4 image mounted on a loop device"
    if not Path("/dev/loop-control").exists():
        return "no loop devices (/dev/loop-control is missing)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    return None


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise OSError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip()


@dataclass
class Mounted:
    image: Path
    device: str  # /dev/loopN
    path: Path  # its mount point

    def stat(self) -> list[int]:
        """The device's /sys/block/<dev>/stat counters."""
        name = Path(self.device).name
        return [int(v) for v in Path(f"/sys/block/{name}/stat").read_text().split()]


class Disks:
    """Loop devices and mounts made by the test, all undone by close() whatever happens."""

    def __init__(self) -> None:
        self.devices: list[str] = []
        self.mounts: list[Path] = []
        self.proxies: list[Serve] = []  # started on them, each in its own process group

    def mount(self, image: Path, at: Path) -> Mounted:
        device = _run("losetup", "--find", "--show", str(image))
        self.devices.append(device)
        at.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "ext4", "-o", "commit=600", device, str(at))
        self.mounts.append(at)
        return Mounted(image, device, at)

    def unmount(self, disk: Mounted) -> None:
        self._umount(disk.path)
        self._detach(disk.device)

    def _umount(self, at: Path) -> None:
        if at not in self.mounts:
            return
        for _ in range(50):  # a killed process may hold a file a moment longer
            try:
                _run("umount", str(at))
                break
            except OSError:
                time.sleep(0.1)
        else:
            _run("umount", "--lazy", str(at))
        self.mounts.remove(at)

    def _detach(self, device: str) -> None:
        if device in self.devices:
            _run("losetup", "--detach", device)
            self.devices.remove(device)

    def close(self) -> None:
        for proxy in self.proxies:
            if proxy.proc is not None and proxy.proc.returncode is None:  # its group is ours
                os.killpg(proxy.pid, signal.SIGKILL)
        errors = []
        for at in reversed(list(self.mounts)):
            try:
                self._umount(at)
            except OSError as exc:
                errors.append(exc)
        for device in reversed(list(self.devices)):
            try:
                self._detach(device)
            except OSError as exc:
                errors.append(exc)
        assert not errors, errors


@pytest.fixture
def disks() -> Iterator[Disks]:
    missing = _missing()
    if missing:
        pytest.skip(missing)
    made = Disks()
    try:
        yield made
    finally:
        made.close()


def make_image(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(IMAGE_BYTES)
    _run("mkfs.ext4", "-q", "-F", str(path))


def writeback_after() -> float:
    """How old dirty pages get before the kernel writes them back by itself."""
    return int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text()) / 100


def write_unsynced(path: Path, data: bytes) -> None:
    """A new file (ext4 pushes out at once what replaces a file's contents by truncating
    it: its auto_da_alloc)."""
    with open(path, "xb") as f:
        f.write(data)


def kept(path: Path, data: bytes) -> bool:
    """Whether all of `data` made it to `path`."""
    try:
        return path.read_bytes() == data
    except FileNotFoundError:
        return False


def group_tasks(group: int) -> list[Path]:
    """/proc/<pid>/task/<tid> of every thread of every process in the process group."""
    tasks = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) == group:
                tasks += list((proc / "task").iterdir())
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return tasks


async def stop_group(group: int) -> None:
    """SIGSTOP the proxy's process group and wait until each of its threads is stopped
    (one inside a system call, an fsync, stops only when it returns)."""
    os.killpg(group, signal.SIGSTOP)
    async with asyncio.timeout(30):
        while True:
            states = []
            for task in group_tasks(group):
                try:
                    states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
                except OSError:
                    continue
            if states and all(s in "tTZX" for s in states):
                return
            await asyncio.sleep(0.005)


def copy_device(disk: Mounted, to: Path) -> int:
    """Copy the image as the loop device holds it now (what a power loss leaves), once
    the device is idle and did no write while it was read; the tries it took."""
    for tries in range(1, 200):
        before = disk.stat()
        if before[8]:  # I/O in flight
            time.sleep(0.01)
            continue
        with open(disk.image, "rb") as src, open(to, "wb") as dst:
            while chunk := src.read(CHUNK):  # holes stay holes: the copy is sparse
                if chunk.count(0) == len(chunk):
                    dst.seek(len(chunk), os.SEEK_CUR)
                else:
                    dst.write(chunk)
            dst.truncate(IMAGE_BYTES)
        after = disk.stat()
        if after[8] == 0 and after[4] == before[4] and after[11:12] == before[11:12]:
            return tries
    raise AssertionError(f"{disk.device} never stayed idle while its image was copied")


@dataclass
class Chain:
    name: str
    turns: list[tuple[str, list[str]]] = field(default_factory=list)  # acknowledged, in
    # order: (response id, the user texts of its whole history)

    @property
    def head(self) -> str | None:
        return self.turns[-1][0] if self.turns else None

    @property
    def users(self) -> list[str]:
        return self.turns[-1][1] if self.turns else []


@dataclass
class Ledger:
    """What the clients were told, and when (time.monotonic() as the answer came)."""

    acked: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (round, when)
    deleted: dict[str, float] = field(default_factory=dict)  # DELETE answered 200 -> when
    uncertain: set[str] = field(default_factory=set)  # DELETE sent, its answer never came
    pending: dict[str, list[str]] = field(default_factory=dict)  # created, never completed:
    # id -> its user texts
    per_round: list[int] = field(default_factory=list)
    large: int = 0  # acknowledged turns with a large segment
    checked: int = 0  # acknowledged turns that had to be there after a loss, summed
    unacked_kept: int = 0  # turns never acknowledged found there (and whole) after a loss
    window_lost: int = 0  # relaxed: turns answered within the window that a loss took

    def live(self, by: float = float("inf")) -> list[str]:
        """Turns acknowledged by `by` and not deleted (nor maybe deleted)."""
        gone = self.deleted.keys() | self.uncertain
        return [r for r, (_, at) in self.acked.items() if at <= by and r not in gone]


def user_text(chain: Chain, tag: str, n: int, rng: random.Random, mode: Mode) -> str:
    text = f"{chain.name} {tag} t{n}"
    if n % mode.large_every == 0:
        text += " " + base64.b64encode(rng.randbytes(mode.large)).decode()
    return text


async def send_turn(
    http: aiohttp.ClientSession, url: str, previous: str | None, text: str, stream: bool
) -> tuple[str | None, str | None]:
    """(the id the proxy announced, the id once acknowledged): a 200 JSON body, or an SSE
    stream's `response.completed` (its `response.created` announced it before)."""
    body: dict[str, object] = {"model": "m", "input": [{"role": "user", "content": text}]}
    body["stream"] = stream
    if previous is not None:
        body["previous_response_id"] = previous
    async with http.post(url + "/v1/responses", json=body) as r:
        if r.status != 200:
            await r.read()
            return None, None
        if not stream:
            rid = str((await r.json())["id"])
            return rid, rid
        announced = None
        async for raw in r.content:
            if not raw.startswith(b"data:"):
                continue
            event = orjson.loads(raw[5:])
            if event.get("type") == "response.created":
                announced = str(event["response"]["id"])
            elif event.get("type") == "response.completed":
                return announced, str(event["response"]["id"])
        return announced, None


async def drive(
    url: str, chains: list[Chain], ledger: Ledger, rng: random.Random, tag: str, mode: Mode
) -> None:
    """Turns on every chain and DELETEs of older acknowledged turns, until the proxy goes."""
    count = [0]

    async def one_chain(chain: Chain, http: aiohttp.ClientSession) -> None:
        n = 0
        while True:
            n += 1
            text = user_text(chain, tag, n, rng, mode)
            history = [*chain.users, text]
            announced, rid = None, None
            try:
                announced, rid = await send_turn(http, url, chain.head, text, n % 2 == 0)
            finally:
                if announced is not None and rid is None:
                    ledger.pending[announced] = history
            if rid is None:
                await asyncio.sleep(0.05)
                continue
            chain.turns.append((rid, history))
            ledger.acked[rid] = (tag, time.monotonic())
            ledger.large += n % mode.large_every == 0
            count[0] += 1
            await asyncio.sleep(rng.uniform(0, 0.02))

    async def deleter(http: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(0.05)
            heads = {c.head for c in chains}
            old = [r for r in ledger.live() if r not in heads]
            if not old:
                continue
            rid = rng.choice(old)
            await delete(http, url, rid, ledger.uncertain)
            ledger.deleted[rid] = time.monotonic()

    try:
        await until_the_proxy_goes([*(partial(one_chain, c) for c in chains), deleter])
    finally:
        ledger.per_round.append(count[0])


def last_user_text(body: bytes) -> str:
    return str(orjson.loads(top_level_span(body, "input"))[-1]["content"])


class Seen:
    """The `input` the backend was sent for each user text (texts are unique)."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.spans: dict[str, bytes] = {}
        self.read = 0

    def span(self, text: str) -> bytes:
        seen = self.backend.responses_seen
        for s in seen[self.read :]:
            self.spans[last_user_text(s.body)] = top_level_span(s.body, "input")
        self.read = len(seen)
        return self.spans[text]


async def continues(
    http: aiohttp.ClientSession, url: str, rid: str, history: list[str], seen: Seen, where: str
) -> tuple[str, str]:
    """Continue from `rid`: the backend must get what it was sent for that turn, byte for
    byte, then its answer and the new turn; (the new turn's id, its user text)."""
    text = f"after {rid} {where}"
    _, new = await send_turn(http, url, rid, text, stream=len(history) % 2 == 0)
    assert new is not None, f"{where}: {rid} does not continue"
    before, after = seen.span(history[-1]), seen.span(text)
    assert after.startswith(before[:-1] + b","), f"{where}: {rid}'s history is not byte-identical"
    items = orjson.loads(after)
    users = [i["content"] for i in items if i.get("role") == "user"]
    assert users == [*history, text], f"{where}: {rid} lost history"
    assert len(items) == 2 * len(history) + 1, f"{where}: {rid}: {len(items)} items"
    return new, text


async def verify(
    url: str, chains: list[Chain], ledger: Ledger, seen: Seen, cutoff: float, where: str
) -> None:
    """After a loss: what was answered by `cutoff` holds (turns there, DELETEs done); what
    came later may be there or not, never in part, and from now on what is there must stay."""
    forever = float("-inf")  # there after a restart: as old as any cutoff
    async with aiohttp.ClientSession() as http:
        sem = asyncio.Semaphore(16)

        async def status(rid: str) -> int:
            async with sem, http.get(f"{url}/v1/responses/{rid}") as r:
                body = await r.read()
                return 200 if r.status == 200 and orjson.loads(body)["id"] == rid else r.status

        async def statuses(ids: list[str]) -> dict[str, int]:
            return dict(zip(ids, await asyncio.gather(*map(status, ids)), strict=True))

        wanted = await statuses(ledger.live(cutoff))
        ledger.checked += len(wanted)
        lost = [f"{r} ({ledger.acked[r][0]}: {c})" for r, c in wanted.items() if c != 200]
        assert not lost, (
            f"{where}: {len(lost)} of {len(wanted)} acknowledged turns lost: {lost[:5]}"
        )
        done = sorted(r for r, at in ledger.deleted.items() if at <= cutoff)
        back = [r for r, c in (await statuses(done)).items() if c != 404]
        assert not back, f"{where}: {len(back)} acknowledged DELETEs undone: {back[:5]}"
        # Answered after the cutoff (relaxed only): there or not.
        later = await statuses([r for r in ledger.live() if ledger.acked[r][1] > cutoff])
        for rid, code in later.items():
            assert code in (200, 404), f"{where}: {rid}: {code}"
            if code == 200:
                ledger.acked[rid] = (ledger.acked[rid][0], forever)
            else:
                del ledger.acked[rid]
                ledger.window_lost += 1
        undone = await statuses([r for r, at in ledger.deleted.items() if at > cutoff])
        for rid, code in undone.items():
            assert code in (200, 404), f"{where}: deleted {rid}: {code}"
            if code == 200:  # the DELETE was lost: the turn is back, and stays
                del ledger.deleted[rid]
                ledger.acked[rid] = (ledger.acked[rid][0], forever)
            else:
                ledger.deleted[rid] = forever
        live = set(ledger.live())
        for chain in chains:
            while chain.turns and chain.turns[-1][0] not in live:
                chain.turns.pop()  # lost within the window: the chain goes on from before
        # Turns never acknowledged: there or not, but never in part.
        pending = await statuses([r for r in ledger.pending if r not in ledger.acked])
        for rid, code in pending.items():
            assert code in (200, 404), f"{where}: unacknowledged {rid}: {code}"
            if code == 200:
                new, _ = await continues(http, url, rid, ledger.pending[rid], seen, where)
                ledger.acked[new] = (where, time.monotonic())
                ledger.unacked_kept += 1
        ledger.pending.clear()
        for chain in chains:
            if chain.head is None:
                continue
            rid, text = await continues(http, url, chain.head, chain.users, seen, where)
            chain.turns.append((rid, [*chain.users, text]))
            ledger.acked[rid] = (where, time.monotonic())


async def state_verify(state: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ocxproxy", "state", "verify", "--state-dir", str(state),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return await proc.wait(), out.decode(errors="replace")


@pytest.mark.parametrize("name", list(MODES))
async def test_answered_turns_survive_power_loss_on_ext4(
    backend: FakeBackend, tmp_path: Path, disks: Disks, name: str
) -> None:
    """`ack`: every acknowledged turn and DELETE survives every loss. `relaxed`: every one
    answered before the last WINDOW seconds does; the traffic runs longer than that."""
    mode = MODES[name]
    relaxed = "relaxed" in mode.args
    seed = int(os.environ.get("OCX_POWER_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    rounds = ASKED or mode.rounds
    image = tmp_path / "disk0.img"
    make_image(image)
    try:
        disk = disks.mount(image, tmp_path / "mnt0")
    except OSError as exc:  # e.g. root in a container that may not mount
        pytest.skip(f"cannot mount an ext4 image on a loop device here: {exc}")
    chains = [Chain(f"c{i}") for i in range(8)]
    ledger = Ledger()
    seen = Seen(backend)
    torn = copies = dropped = 0
    checkpoints: set[str] = set()  # the checkpoint lines `state verify` printed
    cutoff = 0.0
    for n in range(rounds + 1):
        where = f"after power loss {n} (seed {seed}, {name})"
        state = disk.path / "state"
        if n:
            code, report = await state_verify(state)
            problems = [line for line in report.splitlines() if line.startswith("problem:")]
            assert code in (0, 1) and all(TORN in p for p in problems), f"{where}:\n{report}"
            assert code == 0 or problems, f"{where}:\n{report}"
            torn += len(problems)
            checkpoints.update(x.split(",")[0] for x in report.splitlines() if BYTES.match(x))
        proxy = Serve(
            backend.url, state, *mode.flags(rounds), "--log-level", "warning",
            preexec_fn=os.setpgrp,
        )  # fmt: skip
        disks.proxies.append(proxy)
        await proxy.start()
        if n:
            await verify(proxy.url, chains, ledger, seen, cutoff, where)
        if n == rounds:
            assert await proxy.stop() == 0
            break
        tag = f"r{n + 1}"
        before = len(ledger.acked)
        traffic = asyncio.ensure_future(drive(proxy.url, chains, ledger, rng, tag, mode))
        most = rng.randint(*mode.most) if mode.most else 1 << 30
        with contextlib.suppress(TimeoutError):
            await backend.wait_for(
                lambda at=before, most=most: len(ledger.acked) - at >= most,
                within=rng.uniform(*mode.traffic),
            )
        await backend.wait_for(lambda at=before: len(ledger.acked) - at >= 5, within=30)
        # With ack, an answer still on its way to the client at the stop was released
        # before it (its fsync done): it counts too, whenever it arrives.
        cutoff = time.monotonic() - WINDOW if relaxed else float("inf")
        unsynced = rng.randbytes(CANARY)
        write_unsynced(disk.path / f"unsynced{n}", unsynced)
        await stop_group(proxy.pid)
        copy = tmp_path / f"disk{n + 1}.img"
        copies += await asyncio.to_thread(copy_device, disk, copy)
        os.killpg(proxy.pid, signal.SIGKILL)
        await proxy.stop(signal.SIGKILL)
        await traffic
        disks.unmount(disk)
        disk.image.unlink()
        disk = disks.mount(copy, tmp_path / f"mnt{n + 1}")
        dropped += not kept(disk.path / f"unsynced{n}", unsynced)
    disks.unmount(disk)
    print(
        f"seed {seed}, {name}: {rounds} power losses, {len(ledger.acked)} turns "
        f"acknowledged ({ledger.large} with large items, per round {ledger.per_round}), "
        f"{ledger.checked} checks of turns that had to be there, {ledger.window_lost} lost "
        f"within the window, {len(ledger.deleted)} DELETEs, {ledger.unacked_kept} "
        f"unacknowledged turns kept whole, {torn} torn journal tails, {copies} copies taken, "
        f"an unsynced write dropped by {dropped} of {rounds} losses, "
        f"{len(checkpoints)} checkpoints found, "
        f"dirty pages written back after {writeback_after()} s"
    )
    assert min(ledger.per_round) >= 5, ledger.per_round  # every loss came amid traffic
    assert ledger.deleted, "no DELETE was acknowledged: the test proved nothing about them"
    assert ledger.large, "no large turn was acknowledged"
    if name == "ack-checkpoints" and rounds >= mode.rounds:  # (fewer may come before one)
        assert checkpoints, "no checkpoint was written: the losses never came near one"
    assert ledger.checked > rounds * 10, "too few turns were old enough to be checked"
    # The test's own write, never synced, must be gone after most losses, or the copies
    # were not what a power loss leaves (the kernel wrote the page cache back: its dirty
    # memory past vm.dirty_background_ratio, or a short vm.dirty_expire_centisecs).
    assert dropped > rounds // 2, f"an unsynced write survived {rounds - dropped} of {rounds}"
