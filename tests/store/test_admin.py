"""`ocxproxy state stats|verify|gc`: read-only inspection, digest checks, safe cleanup."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ocxproxy.cli import main
from ocxproxy.store.local import files
from ocxproxy.store.local.journal import Journal
from tests.store.helpers import inline, journal_files, make_store, make_turn


@pytest.fixture
def state(tmp_path: Path) -> Path:
    async def fill() -> None:
        store = make_store(tmp_path, offload=inline)
        await store.start()
        parent = None
        for i in range(3):
            parent = store.put(make_turn(f"r{i}", f"turn {i}"), parent)
        await store.flush()  # a checkpoint, then one more turn in the journal after it
        await store.commit(store.put(make_turn("r3", "turn 3"), parent))
        await store.close()

    asyncio.run(fill())
    return tmp_path


def test_stats(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state", "stats", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert "records        4" in out and "segments       4 (" in out
    assert "responses      4 in their records' entries" in out
    assert "replayed       2 entries" in out and "torn tails     0" in out


def test_state_dir_from_the_config_file(
    state: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """`state` finds the directory `serve --config FILE` would use; flag and env win."""
    config = tmp_path_factory.mktemp("etc") / "ocxproxy.toml"
    config.write_text(f'state-dir = "{state}"\nport = 9000\n')
    assert main(["state", "stats", "--config", str(config)], environ={}) == 0
    assert "records        4" in capsys.readouterr().out
    assert main(["state", "stats"], environ={"OCXPROXY_CONFIG": str(config)}) == 0
    assert "records        4" in capsys.readouterr().out
    nowhere = str(state / "nowhere")
    assert main(["state", "stats", "--config", str(config), "--state-dir", nowhere]) == 1
    assert f"no state dir at {nowhere}" in capsys.readouterr().err
    config.write_text("state_dir = 'x'\n")
    assert main(["state", "stats", "--config", str(config)], environ={}) == 2
    assert "unknown key 'state_dir' (did you mean 'state-dir'?)" in capsys.readouterr().err


def test_state_dir_from_the_environment(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state", "stats"], environ={"OCXPROXY_STATE_DIR": str(state)}) == 0
    assert str(state) in capsys.readouterr().out


def test_verify_finds_corrupt_bytes_a_torn_tail_and_a_missing_file(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["state", "verify", "--state-dir", str(state)]) == 0
    assert "0 problems, 8 segments and responses checked" in capsys.readouterr().out
    paths = journal_files(state)
    first, last = paths[min(paths)], paths[max(p for p, f in paths.items() if f.stat().st_size)]
    seg = min(Journal(state).load(repair=False).segments.values(), key=lambda s: s.offset)
    data = bytearray(first.read_bytes())
    data[seg.offset + seg.length // 2] ^= 0xFF  # inside the first segment's compressed bytes
    first.write_bytes(bytes(data))
    last.write_bytes(last.read_bytes()[:-3])
    assert main(["state", "verify", "--state-dir", str(state)]) == 1
    out = capsys.readouterr().out
    assert "problem: corrupt:" in out and "problem: torn or corrupt journal" in out
    first.unlink()
    assert main(["state", "verify", "--state-dir", str(state)]) == 1
    assert "problem: missing: record r0" in capsys.readouterr().out


def test_gc_removes_unneeded_files_and_temps_and_refuses_while_locked(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stray = state / "journal" / "00000000.log"  # before the checkpoint, nothing live in it
    stray.write_bytes(b"x")
    temp = state / ".checkpoint.x.tmp"
    temp.write_bytes(b"{")
    kept = set(journal_files(state)) - {0}
    lock = files.DirLock(state)
    assert lock.acquire()
    try:
        assert main(["state", "gc", "--state-dir", str(state)]) == 1
        assert "in use by a running ocxproxy" in capsys.readouterr().err
    finally:
        lock.release()
    assert main(["state", "gc", "--state-dir", str(state)]) == 0
    assert "2 entries removed" in capsys.readouterr().out
    assert not stray.exists() and not temp.exists() and set(journal_files(state)) == kept
    assert main(["state", "verify", "--state-dir", str(state)]) == 0


def test_bad_usage_and_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["state", "frobnicate"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["state", "stats", "--state-dir", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip().startswith("ocxproxy: error: no state dir at")
