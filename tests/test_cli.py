"""cli.py: flags and OCXPROXY_* → Config → server.run; exit 2 with one line on a bad value."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from ocxproxy import server
from ocxproxy.cli import main
from ocxproxy.config import Config
from tests.fakes.backend import FakeBackend

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """Configs main() would have served (server.run replaced)."""
    configs: list[Config] = []
    monkeypatch.setattr(server, "run", configs.append)
    return configs


def test_serve_help_names_flags_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"], environ={})
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in (
        "--upstream",
        "--max-resident-bytes",
        "OCXPROXY_MAX_RESIDENT_BYTES",
        "--retain-unstored",
    ):
        assert text in out


@pytest.mark.parametrize(
    ("argv", "environ", "fragment"),
    [
        (["--max-resident-bytes", "lots"], {}, "--max-resident-bytes"),
        (["--upstream", "ftp://x"], {}, "--upstream"),
        (["--port", "99999"], {}, "--port"),
        (["--ttl", "forever"], {}, "--ttl"),
        ([], {"OCXPROXY_PORT": "99999"}, "OCXPROXY_PORT:"),
        ([], {"OCXPROXY_UPSTREAM": "ftp://x"}, "OCXPROXY_UPSTREAM:"),
        ([], {"OCXPROXY_ZDR": "perhaps"}, "OCXPROXY_ZDR:"),
    ],
)
def test_bad_value_exits_2_with_one_line(
    argv: list[str],
    environ: dict[str, str],
    fragment: str,
    served: list[Config],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", *argv], environ=environ) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("ocxproxy: error:")
    assert fragment in err
    assert served == []


@pytest.mark.parametrize("argv", [["serve", "--no-such-flag"], ["serve", "--port"], [], ["bogus"]])
def test_usage_error_exits_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv, environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("ocxproxy: error:")


def test_env_is_read_and_flags_win(served: list[Config]) -> None:
    environ = {
        "OCXPROXY_UPSTREAM": "http://a:8000/v1,http://b:8000",
        "OCXPROXY_PORT": "9000",
        "OCXPROXY_MAX_RESIDENT_BYTES": "1MiB",
        "OCXPROXY_RETAIN_UNSTORED": "yes",
        "OCXPROXY_API_KEYS": "k1,k2",
        "OCXPROXY_UPSTREAM_API_KEY": "sk-up",
    }
    assert main(["serve", "--port", "9001"], environ=environ) == 0
    (config,) = served
    assert config.upstream == ("http://a:8000", "http://b:8000")
    assert config.port == 9001
    assert config.max_resident_bytes == 1024**2
    assert config.retain_unstored is True
    assert config.api_keys == ("k1", "k2")
    assert config.upstream_api_key == "sk-up"


def test_upstream_with_and_without_v1_are_the_same(served: list[Config]) -> None:
    assert main(["serve", "--upstream", "http://h:8000/v1"], environ={}) == 0
    assert main(["serve", "--upstream", "http://h:8000"], environ={}) == 0
    assert (
        main(
            ["serve", "--upstream", "http://h:8000/v1", "--upstream", "http://h:8000/"], environ={}
        )
        == 0
    )
    assert [c.upstream for c in served] == [("http://h:8000",)] * 3


def test_bool_flags_take_no_value(served: list[Config]) -> None:
    assert main(["serve", "--zdr", "--retain-unstored"], environ={}) == 0
    assert (served[0].zdr, served[0].retain_unstored) == (True, True)


async def _run(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ocxproxy",
        *args,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_subprocess_bad_flag_exits_2() -> None:
    process = await _run("serve", "--max-resident-bytes", "lots", env={})
    async with asyncio.timeout(20):
        out, err = await process.communicate()
    assert process.returncode == 2
    assert out == b""
    assert err.count(b"\n") == 1
    assert b"--max-resident-bytes" in err


async def test_subprocess_serves_from_env_and_stops_on_sigterm(
    backend: FakeBackend, tmp_path: Path
) -> None:
    env = {
        "OCXPROXY_UPSTREAM": backend.url + "/v1",
        "OCXPROXY_PORT": "0",
        "OCXPROXY_STATE_DIR": str(tmp_path),
    }
    process = await _run("serve", env=env)
    try:
        async with asyncio.timeout(20):
            assert process.stdout is not None
            line = (await process.stdout.readline()).decode()
        assert line.startswith("ocxproxy listening on http://127.0.0.1:"), line
        base = line.split()[-1]
        async with (
            aiohttp.ClientSession() as http,
            http.post(base + "/responses", json={"model": "m", "input": "hi"}) as resp,
        ):
            assert resp.status == 200
            body = await resp.json()
        assert body["output"][0]["content"][0]["text"] == "echo#1: hi"
        assert len(backend.responses_seen) == 1
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await process.wait()
        assert process.returncode == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
