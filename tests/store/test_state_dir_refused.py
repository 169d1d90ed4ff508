"""A state dir the proxy cannot use, black-box: a real `ocxproxy serve` refuses to start
(exit 2, one line naming the directory, why, and the fix) rather than acknowledge turns
that a restart would lose. `--zdr` is the only memory-only mode.

The read-only case mounts a read-only tmpfs (needs root): skipped otherwise, but failed
under CI=true."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.fakes.backend import FakeBackend
from tests.serve import Serve, ServeExited, create
from tests.store.test_disk_full import mount_tmpfs, umount


async def refused(serve: Serve, processes: list[Serve]) -> str:
    """The one line `serve` printed before it exited 2."""
    processes.append(serve)
    with pytest.raises(ServeExited) as exited:
        await serve.start()
    assert exited.value.code == 2, exited.value.output
    lines = exited.value.output.splitlines()
    assert len(lines) == 1, exited.value.output
    assert lines[0].startswith("ocxproxy: error: state dir "), lines[0]
    assert "--state-dir" in lines[0] and "--zdr" in lines[0]  # the fix
    return lines[0]


async def test_a_second_proxy_on_a_dir_in_use_refuses_to_start(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve], http: aiohttp.ClientSession
) -> None:
    state = tmp_path / "state"
    first = Serve(backend.url, state)
    processes.append(first)
    await first.start()
    line = await refused(Serve(backend.url, state), processes)
    assert f"state dir {state} " in line and "another ocxproxy process holds it" in line
    # The first one is untouched: it stores, and its turns survive its restart.
    status, _, rid = await create(http, first.url, {"model": "m", "input": "kept"})
    assert status == 200 and rid is not None
    assert await first.stop() == 0
    again = Serve(backend.url, state)
    processes.append(again)
    await again.start()
    async with http.get(f"{again.url}/v1/responses/{rid}") as r:
        assert r.status == 200


async def test_a_read_only_state_dir_refuses_to_start(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "ro"
    mount_tmpfs(state, "1m", read_only=True)
    try:
        line = await refused(Serve(backend.url, state), processes)
    finally:
        umount(state)
    assert f"state dir {state} " in line and "Read-only file system" in line


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A dir any user can pass through (pytest's tmp_path sits in root's private one)."""
    path = Path(tempfile.mkdtemp())
    path.chmod(0o711)
    yield path
    shutil.rmtree(path)


@pytest.mark.parametrize("inside", [False, True], ids=["dir", "parent"])
async def test_a_state_dir_without_permission_refuses_to_start(
    backend: FakeBackend, reachable: Path, processes: list[Serve], inside: bool
) -> None:
    """Not writable by the proxy's user (`inside`: nor is its parent searchable). Root
    passes any chmod, so as root the proxy runs as `nobody` (setpriv)."""
    base = reachable / "base"
    state = base / "state"
    state.mkdir(parents=True)
    serve = Serve(backend.url, state)
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv (util-linux) to run the proxy as another user")
        serve.args = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *serve.args]
        base.chmod(0o700 if inside else 0o755)
        state.chmod(0o755)  # root's: others may read it, not write it
    else:
        (base if inside else state).chmod(0o500)
    processes.append(serve)
    try:
        with pytest.raises(ServeExited) as exited:
            await serve.start()
    finally:
        base.chmod(0o755)
        state.chmod(0o755)
    assert exited.value.code == 2, exited.value.output
    line = exited.value.output.splitlines()[-1]  # (a warning may come first: see below)
    assert line.startswith(f"ocxproxy: error: state dir {state} cannot be used: "), line
    assert "Permission denied" in line and "--state-dir" in line and "--zdr" in line
    where = state if inside else state / "lock"
    assert f"({where})" in line
    errors = [x for x in exited.value.output.splitlines() if "error" in x.lower()]
    assert errors == [line]  # one error; a warning (say, the fsync helper could not
    # start: nobody may not run an interpreter under /root) is not one


@pytest.mark.parametrize("parent", ["missing", "a file"])
async def test_a_state_dir_without_a_parent_dir_refuses_to_start(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve], parent: str
) -> None:
    if parent == "a file":
        (tmp_path / "volume").write_text("not a directory")
    state = tmp_path / "volume" / "state"
    line = await refused(Serve(backend.url, state), processes)
    assert f"state dir {state} " in line and f"its parent {state.parent} " in line
    assert not state.exists()


async def test_zdr_keeps_nothing_and_needs_no_state_dir(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve], http: aiohttp.ClientSession
) -> None:
    (tmp_path / "volume").write_text("not a directory")
    serve = Serve(backend.url, tmp_path / "volume" / "state", "--zdr")
    processes.append(serve)
    await serve.start()
    status, _, rid = await create(http, serve.url, {"model": "m", "input": "hi"})
    assert status == 200 and rid is not None
