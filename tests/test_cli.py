"""cli.py: flags and OCXPROXY_* → Config → server.run; exit 2 with one line on a bad value."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from ocxproxy import server
from ocxproxy.cli import main
from ocxproxy.config import GROUPS, SETTINGS, Config, env_name, group_of
from tests.fakes.backend import FakeBackend

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """Configs main() would have served (server.run replaced)."""
    configs: list[Config] = []
    monkeypatch.setattr(server, "run", configs.append)
    return configs


def _serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"], environ={})
    assert info.value.code == 0
    return capsys.readouterr().out


def test_serve_help_names_flags_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    out = _serve_help(capsys)
    for name in SETTINGS:
        if name != "snapshot_delay":  # hidden: a test knob
            assert f"--{name.replace('_', '-')}" in out
            assert env_name(name) in " ".join(out.split())  # may wrap mid-line
    assert "--snapshot-delay" not in out


def test_serve_help_is_grouped_with_defaults_and_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _serve_help(capsys)
    heading = re.compile(r"^([a-z][a-z ]*):$", re.M)
    titles = heading.findall(out)
    assert titles == ["options", *GROUPS]
    assert GROUPS == (
        "general", "backends", "store", "shared tier", "limits", "security", "observability"
    )  # fmt: skip
    sections = dict(zip(titles, heading.split(out)[2::2], strict=True))
    assert "--upstream URL" in sections["backends"]
    assert "--max-disk-bytes SIZE" in sections["store"]
    assert "--shared-store URL" in sections["shared tier"]
    assert "--max-body-bytes SIZE" in sections["limits"]
    assert "--api-keys KEY" in sections["security"]
    assert "--access-log off|text|json" in sections["observability"]
    flat = " ".join(out.split())
    for shown in (
        "(default: 32MiB in front of the state dir, whose journal holds them all; 64MiB "
        "where it is the store: under --zdr, keeping store:false turns, or as a shared "
        "store's cache) "
        "[OCXPROXY_MAX_RESIDENT_BYTES]",
        "(default: 30d) [OCXPROXY_TTL]",
        "(default: 10m) [OCXPROXY_READ_TIMEOUT]",
        "(default: 8080) [OCXPROXY_PORT]",
        "--ttl DURATION",
        "SIZE is bytes, or a number with a unit",
        "DURATION is seconds, or a number with a unit",
    ):
        assert shown in flat


def test_every_group_has_a_setting_and_every_setting_a_group() -> None:
    assert {group_of(name) for name in SETTINGS} == set(GROUPS)


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
        (["--port", "abc"], {}, "--port: not a port number: 'abc'"),
        ([], {"OCXPROXY_PORT": "abc"}, "OCXPROXY_PORT: not a port number: 'abc'"),
        ([], {"OCXPROXY_MAX_ENTRIES": "0"}, "OCXPROXY_MAX_ENTRIES: must be more than 0"),
        (["--max-entries", "0"], {}, "--max-entries: must be more than 0"),
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
    assert err.startswith(f"ocxproxy: error: {fragment}")
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


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--port"], "ocxproxy: error: --port: expected one argument"),
        (["--max-disk-size", "1GiB"], "ocxproxy: error: unrecognized arguments: --max-disk-size"),
    ],
)
def test_usage_errors_name_the_flag(
    argv: list[str], start: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", *argv], environ={})
    err = capsys.readouterr().err
    assert err.startswith(start)
    if "unrecognized" in start:
        assert "(did you mean --max-disk-bytes?)" in err


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


def test_a_no_flag_turns_off_what_the_file_or_env_turned_on(
    served: list[Config], tmp_path: Path
) -> None:
    path = _toml(tmp_path, "retain-unstored = true\nforward-unknown-ids = true\n")
    environ = {"OCXPROXY_ZDR": "true"}
    argv = ["serve", "--config", path, "--no-retain-unstored", "--no-zdr"]
    assert main(argv, environ=environ) == 0
    assert (served[0].retain_unstored, served[0].zdr) == (False, False)
    assert served[0].forward_unknown_ids is True


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ocxproxy.toml"
    path.write_text(text)
    return str(path)


def test_config_file_sets_values_and_flags_and_env_override_it(
    served: list[Config], tmp_path: Path
) -> None:
    path = _toml(
        tmp_path,
        """
port = 9000
host = "0.0.0.0"
upstream = ["http://a:8000/v1", "http://b:8000"]
max-resident-bytes = "1MiB"
max-disk-bytes = 2097152
ttl = 90
read-timeout = "2m"
retain-unstored = true
api-keys = "k1,k2"
access-log = "json"
""",
    )
    environ = {"OCXPROXY_PORT": "9001", "OCXPROXY_TTL": "1h"}
    assert main(["serve", "--config", path, "--host", "127.0.0.2"], environ=environ) == 0
    assert main(["serve"], environ={"OCXPROXY_CONFIG": path}) == 0
    first, second = served
    assert (first.port, first.ttl, first.host) == (9001, 3600.0, "127.0.0.2")  # env, flag win
    assert (second.port, second.ttl, second.host) == (9000, 90.0, "0.0.0.0")
    for config in served:
        assert config.upstream == ("http://a:8000", "http://b:8000")
        assert (config.max_resident_bytes, config.max_disk_bytes) == (1024**2, 2 * 1024**2)
        assert config.read_timeout == 120.0
        assert config.retain_unstored is True
        assert config.api_keys == ("k1", "k2")
        assert config.access_log == "json"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_disk_bytes = 1", "unknown key 'max_disk_bytes' (did you mean 'max-disk-bytes'?)"),
        ("colour = 'blue'", "unknown key 'colour'"),
        ("max-disk-bytes = 'lots'", "max-disk-bytes: not a size: 'lots'"),
        ("port = 'abc'", "port: not a port number: 'abc'"),
        ("zdr = 'maybe'", "zdr: not a boolean: 'maybe'"),
        ("zdr = 1", "zdr: expected true or false, got 1"),
        ("port = true", "port: expected a string or a number, got True"),
        ("upstream = [1]", "upstream: expected an array of strings, got [1]"),
        ("[serve]\nport = 1", "unknown key 'serve'"),
        ("port = ", "not valid TOML"),
    ],
)
def test_config_file_errors_name_file_and_key(
    text: str,
    message: str,
    served: list[Config],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _toml(tmp_path, text)
    assert main(["serve", "--config", path], environ={}) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ocxproxy: error: {path}: ")
    assert message in err
    assert err.count("\n") == 1
    assert served == []


def test_missing_config_file_is_an_error(
    served: list[Config], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--config", str(tmp_path / "nope.toml")], environ={}) == 2
    err = capsys.readouterr().err
    assert err.startswith("ocxproxy: error: --config: cannot read ")
    assert "No such file" in err
    assert served == []


def test_example_config_file_loads(served: list[Config], tmp_path: Path) -> None:
    """docs/ocxproxy.example.toml loads as it is, and with its commented-out settings in."""
    example = ROOT / "docs" / "ocxproxy.example.toml"
    assert main(["serve", "--config", str(example)], environ={}) == 0
    lines = example.read_text().splitlines()
    uncommented = [re.sub(r"^# (?=[a-z-]+ = )", "", line) for line in lines]
    assert sum(a != b for a, b in zip(lines, uncommented, strict=True)) >= 5
    assert main(["serve", "--config", _toml(tmp_path, "\n".join(uncommented))], environ={}) == 0
    assert served[0] != Config()


def test_unknown_env_var_warns_with_the_closest_name(
    served: list[Config], capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {
        "OCXPROXY_MAX_DISK": "1GiB",
        "OCXPROXY_PORT": "9000",
        "OCXPROXY_FROBNICATE": "1",
        "OCXPROXY_REQUIRE_LLAMA": "1",  # the test suite's own: no warning
        "OCXPROXY_CONFIG_FILE": "x",
    }
    assert main(["serve"], environ=environ) == 0
    assert served[0].port == 9000
    assert capsys.readouterr().err.splitlines() == [
        "ocxproxy: warning: unknown environment variable OCXPROXY_CONFIG_FILE "
        "(did you mean OCXPROXY_CONFIG?)",
        "ocxproxy: warning: unknown environment variable OCXPROXY_FROBNICATE",
        "ocxproxy: warning: unknown environment variable OCXPROXY_MAX_DISK "
        "(did you mean OCXPROXY_MAX_DISK_BYTES?)",
    ]


def test_known_env_vars_give_no_warning(
    served: list[Config], capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {"OCXPROXY_PORT": "1", "OCXPROXY_ZDR": "1", "OCXPROXY_VENV": "/tmp/venv"}
    assert main(["serve"], environ=environ) == 0
    assert capsys.readouterr().err == ""
    assert served[0].zdr is True


IDLE = "ignored: it sets the embedded backend, which runs only when no --upstream is given"


def test_embedded_backend_settings_beside_an_upstream_warn_where_they_came_from(
    served: list[Config], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--local-* settings do nothing with --upstream: the start goes on (one may be left
    in the environment or a shared config file), each named in a warning line."""
    upstream = ["--upstream", "http://gpu:8000/v1"]
    config_file = _toml(tmp_path, 'local-model = "/models/a.gguf"')
    environ = {"OCXPROXY_LOCAL_TEMPERATURE": "0"}
    assert main(["serve", "--config", config_file, *upstream], environ=environ) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"ocxproxy: warning: {config_file}: local-model: {IDLE}",
        f"ocxproxy: warning: OCXPROXY_LOCAL_TEMPERATURE: {IDLE}",
    ]
    assert main(["serve", "--local-temperature", "0.5", *upstream], environ={}) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"ocxproxy: warning: --local-temperature: {IDLE}"
    ]
    # Without --upstream they are the embedded backend's; none set: nothing to say.
    assert main(["serve", "--local-temperature", "0.5"], environ={}) == 0
    assert main(["serve", *upstream], environ={}) == 0
    assert capsys.readouterr().err == ""
    assert [config.local_temperature for config in served] == [0.0, 0.5, 0.5, None]


def test_warm_resume_settings_that_do_nothing_warn(
    served: list[Config], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--kv-save-dir is an --upstream llama-server's; --kv-cache-types describes those:
    each alone does nothing, and says so at start."""
    upstream = ["--upstream", "http://gpu:8000/v1"]
    slots = str(tmp_path)
    assert main(["serve", "--kv-save-dir", slots, "--kv-cache-types", "q8_0/q8_0"], environ={}) == 0
    assert capsys.readouterr().err.splitlines() == [
        "ocxproxy: warning: --kv-save-dir: ignored: it is an --upstream llama-server's "
        "slot directory; the embedded backend keeps its KV saves in the state dir",
        "ocxproxy: warning: --kv-cache-types: ignored: it describes the llama-servers of "
        "--kv-save-dir with --upstream",
    ]
    environ = {"OCXPROXY_KV_CACHE_TYPES": "q8_0/q8_0"}
    assert main(["serve", *upstream], environ=environ) == 0
    assert capsys.readouterr().err.splitlines() == [
        "ocxproxy: warning: OCXPROXY_KV_CACHE_TYPES: ignored: it describes the "
        "llama-servers of --kv-save-dir with --upstream"
    ]
    # Both beside an upstream: warm resume on it, nothing to say.
    assert main(["serve", *upstream, "--kv-save-dir", slots], environ=environ) == 0
    assert capsys.readouterr().err == ""
    assert [config.kv_cache_types for config in served] == ["q8_0/q8_0"] * 3


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


async def _serve_until_listening(
    *args: str, env: dict[str, str]
) -> tuple[asyncio.subprocess.Process, str]:
    """Start `serve`, return it and its listening line."""
    process = await _run("serve", *args, env={"PYTHONUNBUFFERED": "1", **env})
    assert process.stdout is not None
    try:
        async with asyncio.timeout(20):
            line = (await process.stdout.readline()).decode()
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return process, line


async def _stop(process: asyncio.subprocess.Process) -> str:
    """SIGTERM, and what the process wrote on stderr."""
    process.send_signal(signal.SIGTERM)
    async with asyncio.timeout(20):
        _, err = await process.communicate()
    return err.decode()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_ipv6_listen_url_has_brackets_and_works(
    backend: FakeBackend, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    if not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    args = ("--host", "::1", "--port", "0", "--upstream", backend.url, "--state-dir", str(tmp_path))
    process, line = await _serve_until_listening(*args, env={})
    try:
        found = re.fullmatch(r"ocxproxy listening on (http://\[::1\]:\d+/v1)\n", line)
        assert found, line
        async with http.post(found[1] + "/responses", json={"model": "m", "input": "hi"}) as resp:
            assert resp.status == 200
    finally:
        err = await _stop(process)
    assert "beyond loopback" not in err


@pytest.mark.parametrize("keys", [False, True])
async def test_listening_beyond_loopback_without_keys_warns(
    keys: bool, backend: FakeBackend, tmp_path: Path
) -> None:
    env = {"OCXPROXY_API_KEYS": "sk-a"} if keys else {}
    args = ("--host", "0.0.0.0", "--port", "0", "--upstream", backend.url)
    process, line = await _serve_until_listening(*args, "--state-dir", str(tmp_path), env=env)
    err = await _stop(process)
    assert line.startswith("ocxproxy listening on http://0.0.0.0:"), line
    warnings = [w for w in err.splitlines() if "beyond loopback" in w]
    if keys:
        assert warnings == []
    else:
        (warning,) = warnings
        assert "WARNING" in warning and "listening on 0.0.0.0" in warning
        assert "--api-keys" in warning
