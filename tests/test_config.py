"""config.py: value parsers, upstream normalization, validation with one-line errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ocxproxy.config import (
    SETTINGS,
    Config,
    ConfigError,
    build_config,
    env_name,
    help_for,
    normalize_upstream,
    parse_bool,
    parse_bytes,
    parse_duration,
    parse_kv_cache_types,
    parse_port,
    parse_temperature,
    parse_upstreams,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("67108864", 67108864),
        ("64MiB", 64 * 1024**2),
        ("1GiB", 1024**3),
        ("1.5KiB", 1536),
        ("2kb", 2000),
        (" 3 MB ", 3_000_000),
        ("10b", 10),
        ("0", 0),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "", "-1", "1 parsecs", "MiB", "1e9", "1,000"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("250ms", 0.25),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("30d", 2592000.0),
        ("1.5S", 1.5),
    ],
)
def test_parse_duration(text: str, value: float) -> None:
    assert parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["soon", "", "-5s", "5 weeks", "h"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("", False),
    ],
)
def test_parse_bool(text: str, value: bool) -> None:
    assert parse_bool(text) is value


@pytest.mark.parametrize("text", ["maybe", "2", "truthy"])
def test_parse_bool_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool(text)


@pytest.mark.parametrize(
    ("text", "value"), [("f16", "f16/f16"), ("Q8_0/q4_0", "q8_0/q4_0"), ("f16/f16", "f16/f16")]
)
def test_parse_kv_cache_types(text: str, value: str) -> None:
    assert parse_kv_cache_types(text) == value


@pytest.mark.parametrize("text", ["q8", "f16/f16/f16", "", "q8_0/"])
def test_parse_kv_cache_types_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not KV cache types"):
        parse_kv_cache_types(text)


def test_kv_cache_types_come_from_the_environment_in_their_canonical_form() -> None:
    raw = build_config({"kv_cache_types": "Q8_0"}, sources={"kv_cache_types": "x"})
    assert raw.kv_cache_types == "q8_0/q8_0"
    with pytest.raises(ValueError, match="K/V in lower case"):
        Config(kv_cache_types="q8_0")


@pytest.mark.parametrize(("text", "value"), [("0", 0.0), ("0.7", 0.7), ("2", 2.0)])
def test_parse_temperature(text: str, value: float) -> None:
    assert parse_temperature(text) == value


@pytest.mark.parametrize("text", ["-0.1", "2.5", "warm", "", "nan"])
def test_parse_temperature_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_temperature(text)


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("8080", 8080), ("65535", 65535)])
def test_parse_port(text: str, value: int) -> None:
    assert parse_port(text) == value


@pytest.mark.parametrize("text", ["99999", "-1", "65536", "http", ""])
def test_parse_port_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_port(text)


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000", "http://h:8000"),
        ("http://h:8000/", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        (" https://gpu-box/v1 ", "https://gpu-box"),
        ("http://h:8000/api/v1", "http://h:8000/api"),
        ("http://h:8000/v10", "http://h:8000/v10"),
        ("HTTP://h:1", "http://h:1"),
    ],
)
def test_normalize_upstream(url: str, root: str) -> None:
    assert normalize_upstream(url) == root


@pytest.mark.parametrize(
    "url",
    [
        "ftp://x",
        "h:8000",
        "http://",
        "//h:8000",
        "http://h/v1?x=1",
        "http://h/#f",
        "http://h:99999",
        "http://h:port",
    ],
)
def test_normalize_upstream_rejects(url: str) -> None:
    with pytest.raises(ValueError):
        normalize_upstream(url)


def test_parse_upstreams_splits_commas_and_dedups_equivalents() -> None:
    urls = parse_upstreams(["http://a:1/v1,http://b:2", "http://a:1", " ,http://c:3/v1"])
    assert urls == ("http://a:1", "http://b:2", "http://c:3")


def test_build_config_parses_raw_strings() -> None:
    config = build_config(
        {
            "port": "0",
            "upstream": ["http://h:8000/v1"],
            "api_keys": ["k1,k2", "k3"],
            "max_resident_bytes": "1MiB",
            "ttl": "1h",
            "retain_unstored": "true",
            "state_dir": "/tmp/x",
            "log_level": "DEBUG",
            "host": None,  # unset: the default stays
        }
    )
    assert config.port == 0
    assert config.upstream == ("http://h:8000",)
    assert config.api_keys == ("k1", "k2", "k3")
    assert config.max_resident_bytes == 1024**2
    assert config.ttl == 3600.0
    assert config.retain_unstored is True
    assert str(config.state_dir) == "/tmp/x"
    assert config.log_level == "debug"
    assert config.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"max_resident_bytes": "lots"}, "--max-resident-bytes: not a size: 'lots'"),
        ({"upstream": ["ftp://x"]}, "--upstream: not an http(s) URL"),
        ({"port": "99999"}, "--port: port out of range: 99999"),
        ({"port": "eighty"}, "--port: not a port number: 'eighty'"),
        ({"ttl": "forever"}, "--ttl: not a duration: 'forever'"),
        ({"zdr": "perhaps"}, "--zdr: not a boolean: 'perhaps'"),
        ({"max_entries": "many"}, "--max-entries: not a whole number: 'many'"),
        ({"max_body_bytes": "0"}, "--max-body-bytes: must be more than 0, got 0"),
        ({"read_timeout": "0s"}, "--read-timeout: must be more than 0, got 0"),
        ({"log_level": "loud"}, "--log-level: unknown value 'loud' (debug, info, warning"),
        ({"max_connections": "-1"}, "--max-connections: must not be negative, got -1"),
        ({"durability": "sometimes"}, "--durability: unknown value 'sometimes' (ack, relaxed)"),
        ({"shared_store": "http://v:6379"}, "--shared-store: not a redis://"),
        ({"shared_prefix": "a b"}, "--shared-prefix: must be non-empty, without spaces"),
        ({"health_path": "health"}, "--health-path: must start with '/'"),
    ],
)
def test_build_config_fails_with_one_line_naming_the_flag(
    raw: dict[str, Any], message: str
) -> None:
    """One style for every bad value: `--flag: what is wrong`."""
    with pytest.raises(ConfigError) as info:
        build_config(raw)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_build_config_names_the_source_it_is_given() -> None:
    with pytest.raises(ConfigError, match=r"^OCXPROXY_MAX_ENTRIES: must be more than 0, got 0$"):
        build_config({"max_entries": "0"}, sources={"max_entries": "OCXPROXY_MAX_ENTRIES"})


def test_every_setting_has_help_env_and_default() -> None:
    defaults = Config()
    for name in SETTINGS:
        assert help_for(name)
        assert env_name(name) == "OCXPROXY_" + name.upper()
        assert hasattr(defaults, name)
    assert defaults.host == "127.0.0.1"  # loopback only by default (CONTRACT.md C5)
    assert defaults.retain_unstored is False


def test_config_is_frozen_and_with_validates() -> None:
    config = Config()
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
    assert dataclasses.replace(config, port=1).port == 1
    with pytest.raises(ValueError):
        dataclasses.replace(config, max_entries=0)


def test_fleet_settings_parse_and_validate() -> None:
    config = build_config(
        {
            "routing": "Round-Robin",
            "health_path": "/v1/models",
            "health_interval": "250ms",
            "max_concurrency": "0",
            "max_concurrency_per_backend": "8",
            "admission_timeout": "0",
        }
    )
    assert (config.routing, config.health_path, config.health_interval) == (
        "round-robin",
        "/v1/models",
        0.25,
    )
    assert (config.max_concurrency, config.max_concurrency_per_backend) == (0, 8)
    assert config.admission_timeout == 0.0
    for raw, fragment in [
        ({"routing": "random"}, "--routing: unknown value 'random'"),
        ({"health_path": "health"}, "--health-path"),
        ({"max_concurrency": "-1"}, "--max-concurrency"),
        ({"max_concurrency_per_backend": "lots"}, "--max-concurrency-per-backend"),
        ({"health_interval": "often"}, "--health-interval"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            build_config(raw)
