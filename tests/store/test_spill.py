"""Spill files: digest-named, zstd, atomic; every bad file is a typed StoreFailure."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store import files, spill
from ocxproxy.store.spill import SpillDir
from tests.store.helpers import HYPOTHESIS


@pytest.fixture
def spill_dir(tmp_path: Path) -> SpillDir:
    d = SpillDir(tmp_path / "spill")
    d.prepare()
    return d


def key_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_round_trip_layout_and_modes(spill_dir: SpillDir) -> None:
    data = b'{"role":"user","content":"hi"}' * 20
    key = key_of(data)
    (size,) = spill_dir.write_many([(key, data)])
    path = spill_dir.path(key)
    assert path == spill_dir.root / key[:2] / f"{key}.zst"
    assert isinstance(size, int) and path.stat().st_size == size < len(data)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(spill_dir.root.stat().st_mode) == 0o700
    assert zstandard.ZstdDecompressor().decompress(path.read_bytes()) == data
    assert spill_dir.read(key, len(data)) == data
    assert spill_dir.scan().files == {key: size}
    assert spill_dir.remove_many([key, key]) == 1
    with pytest.raises(StoreFailure) as info:
        spill_dir.read(key, len(data))
    assert info.value.reason == FailureReason.MISSING


def corrupt_cases(data: bytes) -> dict[str, bytes]:
    good = zstandard.ZstdCompressor().compress(data)
    other = zstandard.ZstdCompressor().compress(data[:-1] + b"!")
    return {
        "garbage": b"not zstd at all",
        "truncated": good[: len(good) // 2],
        "other content": other,
        "empty": b"",
        "wrong declared size": zstandard.ZstdCompressor().compress(data + b"x"),
    }


@pytest.mark.parametrize("case", list(corrupt_cases(b"x" * 100)))
def test_a_bad_file_is_corrupt(spill_dir: SpillDir, case: str) -> None:
    data = b'{"a":"' + b"y" * 200 + b'"}'
    key = key_of(data)
    spill_dir.write_many([(key, data)])
    spill_dir.path(key).write_bytes(corrupt_cases(data)[case])
    with pytest.raises(StoreFailure) as info:
        spill_dir.read(key, len(data))
    assert info.value.reason == FailureReason.CORRUPT


def test_a_symlink_is_never_followed(spill_dir: SpillDir, tmp_path: Path) -> None:
    data = b'"secret"'
    key = key_of(data)
    target = tmp_path / "elsewhere.zst"
    target.write_bytes(zstandard.ZstdCompressor().compress(data))
    spill_dir.path(key).parent.mkdir(mode=0o700)
    spill_dir.path(key).symlink_to(target)
    with pytest.raises(StoreFailure) as info:
        spill_dir.read(key, len(data))
    assert info.value.reason == FailureReason.CORRUPT
    scan = spill_dir.scan()
    assert scan.files == {} and scan.unsafe == [spill_dir.path(key)]
    # writing replaces the link itself; the target is untouched
    spill_dir.write_many([(key, data)])
    assert not spill_dir.path(key).is_symlink()
    assert target.read_bytes() == zstandard.ZstdCompressor().compress(data)


def test_a_fifo_is_not_opened(spill_dir: SpillDir) -> None:
    data = b'"x"'
    key = key_of(data)
    spill_dir.path(key).parent.mkdir(mode=0o700)
    os.mkfifo(spill_dir.path(key))
    with pytest.raises(StoreFailure) as info:
        spill_dir.read(key, len(data))
    assert info.value.reason == FailureReason.CORRUPT


def test_an_oversized_file_is_not_read(spill_dir: SpillDir) -> None:
    data = b'"x"'
    key = key_of(data)
    spill_dir.write_many([(key, data)])
    spill_dir.path(key).write_bytes(b"\0" * (spill.compressed_limit(len(data)) + 1))
    with pytest.raises(StoreFailure) as info:
        spill_dir.read(key, len(data))
    assert info.value.reason == FailureReason.CORRUPT


def test_disk_full_is_a_typed_write_failure_and_leaves_no_temp(
    spill_dir: SpillDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "write_all", full)
    data = b'"payload"'
    (result,) = spill_dir.write_many([(key_of(data), data)])
    assert isinstance(result, StoreFailure)
    assert result.reason == FailureReason.WRITE_FAILED and "ENOSPC" in result.detail
    assert list(spill_dir.root.rglob("*")) == [spill_dir.path(key_of(data)).parent]


def test_read_error_is_read_failed(spill_dir: SpillDir, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b'"payload"'
    key = key_of(data)
    spill_dir.write_many([(key, data)])

    def broken(path: Path, limit: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(files, "read_regular", broken)
    with pytest.raises(StoreFailure) as info:
        spill_dir.read(key, len(data))
    assert info.value.reason == FailureReason.READ_FAILED


def test_scan_sorts_out_temps_and_strays(spill_dir: SpillDir) -> None:
    data = b'"ok"'
    key = key_of(data)
    spill_dir.write_many([(key, data)])
    sub = spill_dir.path(key).parent
    (sub / f".{key}.zst.abc.tmp").write_bytes(b"half")
    (sub / "notes.txt").write_bytes(b"?")
    (spill_dir.root / "zz-not-a-shard").write_bytes(b"?")
    scan = spill_dir.scan()
    assert list(scan.files) == [key]
    assert [p.name for p in scan.temps] == [f".{key}.zst.abc.tmp"]
    assert sorted(p.name for p in scan.unsafe) == ["notes.txt", "zz-not-a-shard"]


@HYPOTHESIS
@given(blob=st.binary(max_size=300), size=st.integers(0, 400))
def test_decode_of_arbitrary_bytes_raises_only_store_failure(blob: bytes, size: int) -> None:
    key = key_of(b"whatever")
    try:
        spill.decode(key, size, blob)
    except StoreFailure as failure:
        assert failure.reason == FailureReason.CORRUPT
