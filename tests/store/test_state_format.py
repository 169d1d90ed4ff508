"""The state dir's format marker, black-box: a real `ocxproxy serve` marks a fresh dir
and an unmarked one (written before the marker) with its format, and refuses a dir in a
newer format (exit 2, one line naming both formats) without changing a byte of it, as
`ocxproxy state stats|verify|gc` do."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import aiohttp
import pytest

from ocxproxy.cli import main
from ocxproxy.store.local import stateformat
from tests.fakes.backend import FakeBackend
from tests.serve import Serve, ServeExited, create

LEGACY = Path(__file__).resolve().parent / "data" / "legacy_state" / "state"


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under `root`: its mode, its modification time and its bytes."""
    out: dict[str, tuple[int, int, bytes]] = {}
    for base, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(base, name)
            st = path.lstat()
            data = path.read_bytes() if path.is_file() else b""
            out[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, data)
    return out


async def test_a_fresh_dir_is_marked(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    serve = Serve(backend.url, state)
    processes.append(serve)
    await serve.start()
    marker = state / stateformat.NAME
    assert marker.read_bytes() == b"%d\n" % stateformat.FORMAT
    assert marker.stat().st_mode & 0o777 == 0o600
    assert await serve.stop() == 0


async def test_a_dir_in_a_newer_format_is_refused_and_left_as_it_was(
    backend: FakeBackend,
    tmp_path: Path,
    processes: list[Serve],
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = tmp_path / "state"
    first = Serve(backend.url, state)
    processes.append(first)
    await first.start()
    status, _, rid = await create(http, first.url, {"model": "m", "input": "kept"})
    assert status == 200 and rid is not None
    await first.kill9()  # a journal to replay, a tail a start would settle
    newer = stateformat.FORMAT + 1
    (state / stateformat.NAME).write_bytes(b"%d\n" % newer)
    before = snapshot(state)

    refused = Serve(backend.url, state)
    processes.append(refused)
    with pytest.raises(ServeExited) as exited:
        await refused.start()
    assert exited.value.code == 2, exited.value.output
    lines = exited.value.output.splitlines()
    assert len(lines) == 1, exited.value.output
    assert lines[0].startswith(f"ocxproxy: error: state dir {state} is in format {newer}, ")
    assert f"(format {stateformat.FORMAT})" in lines[0] and "--state-dir" in lines[0]
    for action in ("stats", "verify", "gc"):
        assert main(["state", action, "--state-dir", str(state)]) == 2
        err = capsys.readouterr().err
        assert f"is in format {newer}, newer than this ocxproxy reads" in err, (action, err)
    assert snapshot(state) == before

    # Nothing was lost: with the format it knows, the dir loads with the turn in it.
    (state / stateformat.NAME).write_bytes(b"%d\n" % stateformat.FORMAT)
    again = Serve(backend.url, state)
    processes.append(again)
    await again.start()
    async with http.get(f"{again.url}/v1/responses/{rid}") as r:
        assert r.status == 200
    assert await again.stop() == 0


async def test_a_marker_that_names_no_format_is_refused(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / stateformat.NAME).write_bytes(b"two\n")
    serve = Serve(backend.url, state)
    processes.append(serve)
    with pytest.raises(ServeExited) as exited:
        await serve.start()
    assert exited.value.code == 2, exited.value.output
    assert "does not name a format ('two')" in exited.value.output
    assert not (state / "journal").exists()


async def test_a_dir_written_before_the_marker_loads_and_is_marked(
    backend: FakeBackend,
    tmp_path: Path,
    processes: list[Serve],
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = tmp_path / "state"
    shutil.copytree(LEGACY, state)
    marker = state / stateformat.NAME
    assert main(["state", "stats", "--state-dir", str(state)]) == 0
    assert "format         1 (written before the marker)" in capsys.readouterr().out
    assert not marker.exists()  # stats changes nothing
    serve = Serve(backend.url, state)
    processes.append(serve)
    await serve.start()
    assert marker.read_bytes() == b"%d\n" % stateformat.FORMAT
    assert await serve.stop() == 0
    assert main(["state", "verify", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert f"format         {stateformat.FORMAT}\n" in out and "0 problems" in out
