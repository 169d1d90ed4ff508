"""Config: every setting once, with its default, its parser and its help text.

`--max-disk-bytes` ↔ `OCXPROXY_MAX_DISK_BYTES` ↔ `Config.max_disk_bytes`. Parsing and
validation happen here, once, at start-up; a bad value raises ConfigError with one line.
Nothing here has side effects.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ENV_PREFIX = "OCXPROXY_"
DIALECTS = ("responses", "chat")  # what a backend speaks; the first is the default


class ConfigError(ValueError):
    """A setting has a bad value; the message is one line for the operator."""


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 67108864, 64MiB, 1GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90, 90s, 15m, 2h, 30d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    return port


def normalize_upstream(url: str) -> str:
    """`http://h:8000/v1` and `http://h:8000` name the same backend root (CONTRACT.md C6)."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"upstream URL takes no query or fragment: {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port out of range or not a number
    except ValueError:
        raise ValueError(f"bad port in upstream URL: {url!r}") from None
    path = parts.path
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def parse_upstreams(values: Sequence[str]) -> tuple[str, ...]:
    urls: list[str] = []
    for value in values:
        urls.extend(normalize_upstream(v) for v in value.split(",") if v.strip())
    return tuple(dict.fromkeys(urls))


def _positive(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value <= 0:
            raise ValueError(f"{name} must be positive")

    return check


@dataclass(frozen=True, slots=True)
class Config:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8080, metadata={"help": "port to listen on (0 picks a free one)"})
    upstream: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "backend base URL, e.g. http://gpu-box:8000/v1 (repeatable; "
            "default: the embedded llama.cpp backend when installed)"
        },
    )
    upstream_dialect: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "API each --upstream speaks: responses (default) or chat (Chat Completions "
            "only, e.g. TGI; translated). One value applies to every backend; several "
            "(repeated or comma-separated) pair up with the --upstream URLs in order",
            "metavar": "DIALECT",
        },
    )
    state_dir: Path | None = field(
        default=None, metadata={"help": "where durable state lives (default: user state dir)"}
    )
    max_resident_bytes: int = field(
        default=64 * 1024**2, metadata={"help": "memory budget for stored turns (e.g. 64MiB)"}
    )
    max_disk_bytes: int = field(
        default=1024**3,
        metadata={"help": "disk budget: what the state dir may occupy (e.g. 1GiB)"},
    )
    max_entries: int = field(default=100_000, metadata={"help": "most stored responses kept"})
    ttl: float = field(
        default=30 * 86400.0, metadata={"help": "how long a stored response lives (e.g. 30d)"}
    )
    retain_unstored: bool = field(
        default=False,
        metadata={"help": "keep store:false turns in memory (never disk) so HTTP can chain them"},
    )
    zdr: bool = field(
        default=False, metadata={"help": "zero data retention: write nothing to disk"}
    )
    durability: str = field(
        default="ack",
        metadata={
            "help": "ack: a stored turn is answered only once it is fsynced to the journal "
            "(survives kill -9 and power loss); relaxed: answered at once, written within "
            "~2s (for disks that cannot fsync fast)",
            "metavar": "ack|relaxed",
        },
    )
    shared_store: str | None = field(
        default=None,
        metadata={
            "help": "run several replicas on one Valkey/Redis server: redis://host:6379/0, "
            "rediss://..., unix:///path/to.sock (needs ocxproxy[shared]; --durability is "
            "checked against the server's persistence)",
            "metavar": "URL",
        },
    )
    shared_prefix: str = field(
        default="ocx:", metadata={"help": "what every key of the shared store starts with"}
    )
    shared_max_bytes: int = field(
        default=1024**3,
        metadata={
            "help": "byte budget of the shared store (e.g. 1GiB); past it the chains "
            "extended longest ago are evicted (0: no budget, the server's maxmemory decides)"
        },
    )
    shared_wait_replicas: int = field(
        default=0,
        metadata={
            "help": "with --shared-store: a turn is answered once this many of the server's "
            "replicas have it too (WAIT/WAITAOF)",
            "metavar": "N",
        },
    )
    ws_max_age: float = field(
        default=3600.0, metadata={"help": "WebSocket connection lifetime (e.g. 60m)"}
    )
    max_body_bytes: int = field(
        default=32 * 1024**2, metadata={"help": "largest request body accepted (413 beyond)"}
    )
    head_timeout: float = field(
        default=30.0,
        metadata={"help": "longest a client may take to send a request's head (408 beyond)"},
    )
    body_timeout: float = field(
        default=60.0,
        metadata={"help": "longest silence from a client mid-body (408 beyond)"},
    )
    keepalive_timeout: float = field(
        default=75.0, metadata={"help": "how long an idle client connection stays open"}
    )
    max_connections: int = field(
        default=512,
        metadata={"help": "most open client connections, 503 and close beyond (0: no bound)"},
    )
    connect_timeout: float = field(default=10.0, metadata={"help": "backend connect timeout"})
    read_timeout: float = field(
        default=600.0, metadata={"help": "longest silence from a backend mid-response"}
    )
    routing: str = field(
        default="affinity",
        metadata={
            "help": "how backends are chosen: affinity (a chain or prompt_cache_key stays on "
            "its backend) or round-robin (ignores affinity; for comparison)"
        },
    )
    health_path: str = field(
        default="/health", metadata={"help": "backend path probed for health (2xx-4xx: up)"}
    )
    health_interval: float = field(
        default=5.0, metadata={"help": "time between health probes of each backend (0: off)"}
    )
    max_concurrency: int = field(
        default=256,
        metadata={"help": "most backend requests in flight overall, 429 beyond (0: no bound)"},
    )
    max_concurrency_per_backend: int = field(
        default=64,
        metadata={
            "help": "most requests in flight to one backend (0: no bound)",
            "metavar": "N",
        },
    )
    admission_timeout: float = field(
        default=1.0,
        metadata={"help": "longest wait for a free backend slot before 429 (e.g. 500ms)"},
    )
    upstream_api_key: str | None = field(
        default=None,
        metadata={"help": "bearer token sent to backends instead of the client's"},
    )
    api_keys: tuple[str, ...] = field(
        default=(), metadata={"help": "if set, clients must present one of these keys"}
    )
    forward_unknown_ids: bool = field(
        default=False,
        metadata={"help": "forward unknown previous_response_ids (for stateful backends)"},
    )
    local_model: Path | None = field(
        default=None, metadata={"help": "GGUF model for the embedded backend"}
    )
    snapshot_delay: float = field(
        default=2.0, metadata={"help": "with --durability relaxed: time between journal writes"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    access_log: str = field(
        default="off",
        metadata={"help": "one line per request on stdout: off, text or json", "metavar": "STYLE"},
    )

    def __post_init__(self) -> None:
        for name in (
            "max_resident_bytes",
            "max_disk_bytes",
            "max_entries",
            "ttl",
            "ws_max_age",
            "max_body_bytes",
            "connect_timeout",
            "read_timeout",
            "head_timeout",
            "body_timeout",
            "keepalive_timeout",
        ):
            _positive(name)(getattr(self, name))
        if self.snapshot_delay < 0:
            raise ValueError("snapshot_delay must not be negative")
        for name in (
            "health_interval",
            "max_concurrency",
            "max_concurrency_per_backend",
            "admission_timeout",
            "max_connections",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.durability not in ("ack", "relaxed"):
            raise ValueError(f"unknown durability {self.durability!r} (ack or relaxed)")
        if self.shared_store is not None:
            scheme = urlsplit(self.shared_store).scheme
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError(
                    f"--shared-store: not a redis://, rediss:// or unix:// URL: "
                    f"{self.shared_store!r}"
                )
            if self.zdr:
                raise ValueError("--zdr keeps nothing outside the process: no --shared-store")
        if not self.shared_prefix or any(c.isspace() for c in self.shared_prefix):
            raise ValueError(f"shared_prefix must be non-empty, no spaces: {self.shared_prefix!r}")
        if self.shared_wait_replicas < 0 or self.shared_max_bytes < 0:
            raise ValueError("shared_wait_replicas and shared_max_bytes must not be negative")
        if self.routing not in ("affinity", "round-robin"):
            raise ValueError(f"unknown routing {self.routing!r} (affinity or round-robin)")
        if not self.health_path.startswith("/"):
            raise ValueError(f"health_path must start with '/': {self.health_path!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"unknown log level {self.log_level!r}")
        if self.access_log not in ("off", "text", "json"):
            raise ValueError(f"unknown access log style {self.access_log!r} (off, text or json)")
        for dialect in self.upstream_dialect:
            if dialect not in DIALECTS:
                raise ValueError(f"unknown upstream dialect {dialect!r} (responses or chat)")
        if len(self.upstream_dialect) > 1 and len(self.upstream_dialect) != len(self.upstream):
            raise ValueError(
                f"{len(self.upstream_dialect)} upstream dialects for {len(self.upstream)} "
                "upstream URLs: give one dialect for all, or one per URL"
            )

    def dialect_of(self, url: str) -> str:
        """The API the backend at `url` (a normalized root) speaks."""
        dialects = self.upstream_dialect
        if len(dialects) == 1:
            return dialects[0]
        if dialects and url in self.upstream:
            return dialects[self.upstream.index(url)]
        return DIALECTS[0]


_PARSERS: dict[str, Callable[[str], Any]] = {
    "port": parse_port,
    "max_resident_bytes": parse_bytes,
    "max_disk_bytes": parse_bytes,
    "max_body_bytes": parse_bytes,
    "max_entries": int,
    "ttl": parse_duration,
    "ws_max_age": parse_duration,
    "connect_timeout": parse_duration,
    "read_timeout": parse_duration,
    "head_timeout": parse_duration,
    "body_timeout": parse_duration,
    "keepalive_timeout": parse_duration,
    "max_connections": int,
    "snapshot_delay": parse_duration,
    "retain_unstored": parse_bool,
    "zdr": parse_bool,
    "forward_unknown_ids": parse_bool,
    "state_dir": Path,
    "local_model": Path,
    "log_level": str.lower,
    "access_log": str.lower,
    "routing": str.lower,
    "durability": str.lower,
    "health_interval": parse_duration,
    "admission_timeout": parse_duration,
    "max_concurrency": int,
    "max_concurrency_per_backend": int,
    "shared_wait_replicas": int,
    "shared_max_bytes": parse_bytes,
}
SETTINGS = tuple(f.name for f in dataclasses.fields(Config))
LIST_SETTINGS = ("upstream", "upstream_dialect", "api_keys")
BOOL_SETTINGS = ("retain_unstored", "zdr", "forward_unknown_ids")


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def help_for(setting: str) -> str:
    return str(Config.__dataclass_fields__[setting].metadata["help"])


def metavar_for(setting: str) -> str | None:
    """The value's name in --help when the setting's last word would mislead."""
    metavar = Config.__dataclass_fields__[setting].metadata.get("metavar")
    return None if metavar is None else str(metavar)


def build_config(raw: Mapping[str, Any], *, from_env: Collection[str] = ()) -> Config:
    """Raw strings (flags, else environment) → a validated Config, or ConfigError naming
    the flag, or the environment variable for the settings in `from_env`."""
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None:
            continue
        try:
            if name == "upstream":
                values[name] = parse_upstreams(value)
            elif name == "api_keys":
                values[name] = tuple(k for v in value for k in v.split(",") if k.strip())
            elif name == "upstream_dialect":
                values[name] = tuple(
                    d.strip().lower() for v in value for d in v.split(",") if d.strip()
                )
            elif isinstance(value, str) and name in _PARSERS:
                values[name] = _PARSERS[name](value)
            else:
                values[name] = value
        except ValueError as exc:
            source = env_name(name) if name in from_env else "--" + name.replace("_", "-")
            raise ConfigError(f"{source}: {exc}") from None
    try:
        return Config(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
