"""`ocxproxy state stats|verify|gc`: read-only inspection, digest checks, safe cleanup."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ocxproxy.cli import main
from ocxproxy.store import files
from tests.store.helpers import inline, make_store, make_turn, spill_files


@pytest.fixture
def state(tmp_path: Path) -> Path:
    async def fill() -> None:
        store = make_store(tmp_path, offload=inline)
        await store.start()
        parent = None
        for i in range(3):
            parent = store.put(make_turn(f"r{i}", f"turn {i}"), parent)
        await store.close()

    asyncio.run(fill())
    return tmp_path


def test_stats(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state", "stats", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert "records        3" in out and "disk tier      6 files" in out
    assert "orphans        0" in out


def test_state_dir_from_the_environment(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state", "stats"], environ={"OCXPROXY_STATE_DIR": str(state)}) == 0
    assert str(state) in capsys.readouterr().out


def test_verify_finds_a_corrupt_and_a_missing_file(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["state", "verify", "--state-dir", str(state)]) == 0
    assert "0 problems, 6 files checked" in capsys.readouterr().out
    paths = sorted(spill_files(state).values())
    paths[0].write_bytes(paths[0].read_bytes()[:-2] + b"??")
    paths[1].unlink()
    assert main(["state", "verify", "--state-dir", str(state)]) == 1
    out = capsys.readouterr().out
    assert "problem: corrupt:" in out and "problem: missing:" in out and "2 problems" in out


def test_gc_removes_orphans_and_temps_and_refuses_while_locked(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = state / "spill" / "ab" / ("ab" + "1" * 62 + ".zst")
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"x")
    temp = state / ".state.json.x.tmp"
    temp.write_bytes(b"{")
    lock = files.DirLock(state)
    assert lock.acquire()
    try:
        assert main(["state", "gc", "--state-dir", str(state)]) == 1
        assert "in use by a running ocxproxy" in capsys.readouterr().err
    finally:
        lock.release()
    assert main(["state", "gc", "--state-dir", str(state)]) == 0
    assert "2 entries removed" in capsys.readouterr().out
    assert not orphan.exists() and not temp.exists() and len(spill_files(state)) == 6


def test_bad_usage_and_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["state", "frobnicate"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["state", "stats", "--state-dir", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip().startswith("ocxproxy: error: no state dir at")
