"""Config: every setting once, with its default, group, parser, check and help text.

`--max-disk-bytes` ↔ `OCXPROXY_MAX_DISK_BYTES` ↔ `max-disk-bytes` in a `--config` TOML file
↔ `Config.max_disk_bytes`. A setting is one `setting(...)` field of Config: the command
line, the environment, the config file, `serve --help` and the checks all come from it.
Parsing and validation happen here, once, at start-up; a bad value raises ConfigError with
one line that names where the value came from (the flag, the variable or the file's key).
Nothing here has side effects.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

ENV_PREFIX = "OCXPROXY_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"  # the --config file; not a setting (a file cannot name one)
# File descriptors kept out of the default --max-connections: the listening sockets, the
# store's files, the shared store's connections, logs, an embedded backend's pipes.
RESERVED_FDS = 64
# The resident tier's default budgets (--max-resident-bytes): in front of the state dir's
# journal, which holds every turn, it only spares the chains in use a read back; any other
# store (--zdr's, a WebSocket connection's, a shared store's cache) gets the larger one.
JOURNALED_RESIDENT_BYTES = 32 * 1024**2
RESIDENT_BYTES = 64 * 1024**2
DIALECTS = ("responses", "chat")  # what a backend speaks; the first is the default

# `serve --help` shows the settings in these groups, in this order.
GENERAL = "general"
BACKENDS = "backends"
STORE = "store"
SHARED = "shared tier"
LIMITS = "limits"
SECURITY = "security"
OBSERVABILITY = "observability"
GROUPS = (GENERAL, BACKENDS, STORE, SHARED, LIMITS, SECURITY, OBSERVABILITY)


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


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None


def parse_temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not 0 <= value <= 2:  # the Responses API's range
        raise ValueError(f"temperature out of range: {value:g} (0-2)")
    return value


def parse_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"not a port number: {text!r} (0-65535)") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port} (0-65535)")
    return port


def format_bytes(value: int) -> str:
    """64MiB, 1GiB: the largest binary unit that divides `value`, for --help."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def format_duration(value: float) -> str:
    """30d, 10m, 500ms: the largest unit that divides `value`, for --help."""
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if value and value % seconds == 0:
            return f"{int(value // seconds)}{unit}"
    return f"{value * 1000:g}ms" if value else "0"


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
    base = _endpoint_base(path)
    if base is not None:
        raise ValueError(
            f"{url} is an endpoint, not a base URL: the base URL is "
            f"{parts.scheme}://{parts.netloc}{base} (the proxy adds /responses and the rest)"
        )
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


_ENDPOINTS = ("/responses", "/chat/completions", "/completions", "/models", "/embeddings")


def _endpoint_base(path: str) -> str | None:
    """The base URL's path when `path` names an API endpoint (`/v1/responses`, also under
    a prefix, `/gpu/v1/chat/completions`), else None (a backend may sit under any prefix)."""
    head, v1, _ = path.partition("/v1/")
    if v1:
        return head + "/v1"
    for endpoint in _ENDPOINTS:
        if path.endswith(endpoint):
            return path.removesuffix(endpoint) + "/v1"
    return None


def split_list(values: Sequence[str]) -> tuple[str, ...]:
    """A list setting's values: each may itself be a comma list (as in the environment)."""
    return tuple(item.strip() for value in values for item in value.split(",") if item.strip())


def parse_upstreams(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(normalize_upstream(url) for url in split_list(values)))


def _parse_dialects(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(dialect.lower() for dialect in split_list(values))


def fd_limit() -> int | None:
    """The process's soft RLIMIT_NOFILE; None when there is none (or no such limit here)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def connections_for_fds() -> int:
    """The default --max-connections: what the file-descriptor limit leaves room for, each
    client connection in flight holding a backend connection too: (limit - RESERVED_FDS) / 2.
    0 (no bound) when the process has no limit."""
    limit = fd_limit()
    return 0 if limit is None else max(1, (limit - RESERVED_FDS) // 2)


# llama.cpp's KV cache types (llama-server's --cache-type-k/--cache-type-v); f16 its default.
KV_CACHE_TYPES: Final = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def parse_kv_cache_types(text: str) -> str:
    """`K/V`, or one type for both: `K/V` in lower case."""
    types = text.strip().lower().split("/")
    if len(types) == 1:
        types *= 2
    if len(types) != 2 or any(kind not in KV_CACHE_TYPES for kind in types):
        raise ValueError(
            f"not KV cache types: {text!r} (K/V, each one of {', '.join(KV_CACHE_TYPES)})"
        )
    return "/".join(types)


def _kv_cache_types(value: str) -> None:
    if parse_kv_cache_types(value) != value:
        raise ValueError(f"must be K/V in lower case, e.g. q8_0/q8_0: {value!r}")


# Checks of one value: raise ValueError with what is wrong (the caller names the setting).


def positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be more than 0, got {value:g}")


def _positive_if_set(value: float | None) -> None:
    if value is not None:
        positive(value)


def not_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"must not be negative, got {value:g}")


class Choices:
    """A check that the value (or, for a list setting, each value) is one of `choices`."""

    def __init__(self, *choices: str) -> None:
        self.choices = choices

    def __call__(self, value: str | tuple[str, ...]) -> None:
        for item in (value,) if isinstance(value, str) else value:
            if item not in self.choices:
                raise ValueError(f"unknown value {item!r} ({', '.join(self.choices)})")


def _redis_url(value: str | None) -> None:
    if value is not None and urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"not a redis://, rediss:// or unix:// URL: {value!r}")


def _key_prefix(value: str) -> None:
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"must be non-empty, without spaces: {value!r}")


def _absolute_path(value: str) -> None:
    if not value.startswith("/"):
        raise ValueError(f"must start with '/': {value!r}")


def setting(
    default: Any,
    help: str,
    *,
    group: str,
    parse: Callable[[Any], Any] | None = None,
    check: Callable[[Any], None] | None = None,
    metavar: str | None = None,
    hidden: bool = False,
) -> Any:
    """One setting of Config. Its kind follows its default: a bool is a flag without a
    value (true/false in the environment and the file); a tuple is a list (the flag
    repeats, the environment takes a comma list, the file an array). `parse` turns the
    text (for a list: the texts) into the value (default: the text itself, parse_bool for
    a flag); `check` raises ValueError on a value out of bounds. A callable default is
    called for each Config."""
    if parse is None:
        parse = parse_bool if isinstance(default, bool) else str
    metadata = {
        "help": help,
        "group": group,
        "parse": parse,
        "check": check,
        "metavar": metavar,
        "hidden": hidden,
    }
    if callable(default):  # worked out when a Config is made (from the process's limits)
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Config:
    # To add a setting, add one field here with setting(...); nothing else is needed.
    host: str = setting("127.0.0.1", "address to listen on", group=GENERAL)
    port: int = setting(
        8080, "port to listen on (0 picks a free one)", group=GENERAL, parse=parse_port
    )
    upstream: tuple[str, ...] = setting(
        (),
        "backend base URL, e.g. http://gpu-box:8000/v1 (repeatable; "
        "default: the embedded llama.cpp backend when installed)",
        group=BACKENDS,
        parse=parse_upstreams,
        metavar="URL",
    )
    upstream_dialect: tuple[str, ...] = setting(
        (),
        "API each --upstream speaks: responses (default) or chat (Chat Completions "
        "only, e.g. TGI; translated). One value applies to every backend; several "
        "(repeated or comma-separated) pair up with the --upstream URLs in order",
        group=BACKENDS,
        parse=_parse_dialects,
        check=Choices(*DIALECTS),
        metavar="DIALECT",
    )
    state_dir: Path | None = setting(
        None,
        "where durable state lives (default: user state dir)",
        group=STORE,
        parse=Path,
        metavar="DIR",
    )
    max_resident_bytes: int | None = setting(
        None,
        "memory budget for stored turns (default: 32MiB in front of the state dir, whose "
        "journal holds them all; 64MiB where it is the store: under --zdr, keeping "
        "store:false turns, or as a shared store's cache)",
        group=STORE,
        parse=parse_bytes,
        check=_positive_if_set,
    )
    max_disk_bytes: int = setting(
        1024**3,
        "disk budget: what the state dir may occupy",
        group=STORE,
        parse=parse_bytes,
        check=positive,
    )
    large_segment_bytes: int = setting(
        8 * 1024,
        "a turn's stored items this large compressed go to a file of their own (named by "
        "their SHA-256), which the journal's compaction never copies",
        group=STORE,
        parse=parse_bytes,
        check=positive,
    )
    max_entries: int = setting(
        100_000, "most stored responses kept", group=STORE, parse=parse_int, check=positive
    )
    ttl: float = setting(
        30 * 86400.0,
        "how long a stored response lives",
        group=STORE,
        parse=parse_duration,
        check=positive,
    )
    retain_unstored: bool = setting(
        False,
        "keep store:false turns in memory (never disk) so HTTP can chain them",
        group=STORE,
    )
    zdr: bool = setting(False, "zero data retention: write nothing to disk", group=STORE)
    durability: str = setting(
        "ack",
        "ack: a stored turn is answered only once it is fsynced to the journal "
        "(survives kill -9 and power loss); relaxed: answered at once, written within "
        "2s plus up to two journal writes, which kill -9 or power loss can lose (for "
        "disks that cannot fsync fast)",
        group=STORE,
        parse=str.lower,
        check=Choices("ack", "relaxed"),
    )
    snapshot_delay: float = setting(
        2.0,
        "with --durability relaxed: time between journal writes",
        group=STORE,
        parse=parse_duration,
        check=not_negative,
        hidden=True,
    )
    shared_store: str | None = setting(
        None,
        "run several replicas on one Valkey/Redis server: redis://host:6379/0, "
        "rediss://..., unix:///path/to.sock (needs ocxproxy[shared]; --durability is "
        "checked against the server's persistence)",
        group=SHARED,
        check=_redis_url,
        metavar="URL",
    )
    shared_prefix: str = setting(
        "ocx:",
        "what every key of the shared store starts with",
        group=SHARED,
        check=_key_prefix,
        metavar="PREFIX",
    )
    shared_max_bytes: int = setting(
        1024**3,
        "byte budget of the shared store; past it the chains extended longest ago are "
        "evicted (0: no budget, the server's maxmemory decides)",
        group=SHARED,
        parse=parse_bytes,
        check=not_negative,
    )
    shared_wait_replicas: int = setting(
        0,
        "with --shared-store: a turn is answered once this many of the server's "
        "replicas have it too (WAIT/WAITAOF)",
        group=SHARED,
        parse=parse_int,
        check=not_negative,
    )
    max_background: int = setting(
        16,
        "most background responses running at once; the rest wait queued (0: no bound)",
        group=LIMITS,
        parse=parse_int,
        check=not_negative,
    )
    background_queue: int = setting(
        256,
        "most background responses waiting to run, 429 beyond",
        group=LIMITS,
        parse=parse_int,
        check=not_negative,
    )
    background_log_bytes: int = setting(
        64 * 1024**2,
        "memory for background responses' event logs (streams kept to be resumed, at "
        "least 10 minutes after their end within this budget)",
        group=LIMITS,
        parse=parse_bytes,
        check=positive,
    )
    ws_max_age: float = setting(
        3600.0,
        "WebSocket connection lifetime",
        group=LIMITS,
        parse=parse_duration,
        check=positive,
    )
    max_body_bytes: int = setting(
        32 * 1024**2,
        "largest request body accepted (413 beyond)",
        group=LIMITS,
        parse=parse_bytes,
        check=positive,
    )
    head_timeout: float = setting(
        30.0,
        "longest a client may take to send a request's head (408 beyond)",
        group=LIMITS,
        parse=parse_duration,
        check=positive,
    )
    body_timeout: float = setting(
        60.0,
        "longest silence from a client mid-body (408 beyond)",
        group=LIMITS,
        parse=parse_duration,
        check=positive,
    )
    shutdown_timeout: float = setting(
        30.0,
        "at SIGTERM, how long requests and WebSocket turns in flight may take to finish; "
        "past it they end with a server_shutting_down error",
        group=LIMITS,
        parse=parse_duration,
        check=not_negative,
    )
    keepalive_timeout: float = setting(
        75.0,
        "how long an idle client connection stays open",
        group=LIMITS,
        parse=parse_duration,
        check=positive,
    )
    max_connections: int = setting(
        connections_for_fds,
        "most open client connections, 503 and close beyond (0: no bound); the default "
        "is (file-descriptor limit - 64) / 2, e.g. 480 under ulimit -n 1024",
        group=LIMITS,
        parse=parse_int,
        check=not_negative,
    )
    max_concurrency: int = setting(
        256,
        "most backend requests in flight overall, 429 beyond (0: no bound)",
        group=LIMITS,
        parse=parse_int,
        check=not_negative,
    )
    max_concurrency_per_backend: int = setting(
        64,
        "most requests in flight to one backend (0: no bound)",
        group=LIMITS,
        parse=parse_int,
        check=not_negative,
    )
    admission_timeout: float = setting(
        1.0,
        "longest wait for a free backend slot before 429",
        group=LIMITS,
        parse=parse_duration,
        check=not_negative,
    )
    connect_timeout: float = setting(
        10.0, "backend connect timeout", group=BACKENDS, parse=parse_duration, check=positive
    )
    read_timeout: float = setting(
        600.0,
        "longest silence from a backend mid-response",
        group=BACKENDS,
        parse=parse_duration,
        check=positive,
    )
    routing: str = setting(
        "affinity",
        "how backends are chosen: affinity (a chain or prompt_cache_key stays on its "
        "backend) or round-robin (ignores affinity; for comparison)",
        group=BACKENDS,
        parse=str.lower,
        check=Choices("affinity", "round-robin"),
    )
    health_path: str = setting(
        "/health",
        "backend path probed for health (2xx-4xx: up; a 404 also needs GET /v1/models 200)",
        group=BACKENDS,
        check=_absolute_path,
        metavar="PATH",
    )
    health_interval: float = setting(
        5.0,
        "time between health probes of each backend (0: off)",
        group=BACKENDS,
        parse=parse_duration,
        check=not_negative,
    )
    context_window: int = setting(
        0,
        "the backends' context window in tokens (0: learn it from each backend's /props "
        "or /v1/models)",
        group=BACKENDS,
        parse=parse_int,
        check=not_negative,
        metavar="TOKENS",
    )
    compaction_prewarm: bool = setting(
        False,
        "after a compaction, send the compacted window to the backend (one output token), "
        "off the reply path, so the turn after it finds its prefix cached",
        group=BACKENDS,
    )
    forward_unknown_ids: bool = setting(
        False,
        "forward ids the proxy does not know (previous_response_id, GET/DELETE/cancel of a "
        "response) to the backend, for stateful backends",
        group=BACKENDS,
    )
    local_model: Path | None = setting(
        None, "GGUF model for the embedded backend", group=BACKENDS, parse=Path, metavar="FILE"
    )
    local_temperature: float | None = setting(
        None,
        "the embedded backend's sampling temperature for a request that sets none (0: the "
        "likeliest token every time, so a request gets the same answer each time it is sent; "
        "default: llama.cpp's 0.8)",
        group=BACKENDS,
        parse=parse_temperature,
        metavar="T",
    )
    kv_save: str = setting(
        "auto",
        "warm resume: save a stored chain's KV state after its turn and restore it after a "
        "backend restart (auto: on the embedded backend, unless --zdr; off)",
        group=BACKENDS,
        parse=str.lower,
        check=Choices("auto", "off"),
    )
    kv_save_bytes: int = setting(
        0,
        "disk budget of the KV saves, least recently used out first (0: a tenth of the "
        "free disk, at most 16 GiB)",
        group=BACKENDS,
        parse=parse_bytes,
        check=not_negative,
    )
    kv_save_dir: Path | None = setting(
        None,
        "warm resume on an external llama-server: the directory it saves slots to (its "
        "--slot-save-path, as this machine sees it); with one --upstream started with "
        "--slot-save-path and --parallel 1, the proxy saves and restores its chains and "
        "keeps that directory within --kv-save-bytes",
        group=BACKENDS,
        parse=Path,
        metavar="DIR",
    )
    kv_cache_types: str = setting(
        "f16/f16",
        "the KV cache types of the --kv-save-dir llama-servers, as their --cache-type-k "
        "and --cache-type-v (K/V; llama-server does not report them): a save is restored "
        "only on a server of the same types (default: llama.cpp's own)",
        group=BACKENDS,
        parse=parse_kv_cache_types,
        check=_kv_cache_types,
        metavar="K/V",
    )
    rewarm_budget: int = setting(
        0,
        "after a backend with no KV save API started again or came back up, replay its "
        "most recent chains' prefixes (a one-token answer each, newest first, never "
        "before a real turn) up to this many tokens (0: off), e.g. 65536",
        group=BACKENDS,
        parse=parse_int,
        check=not_negative,
        metavar="TOKENS",
    )
    kv_save_every: int = setting(
        1024,
        "a chain's KV state is saved again once it grew by this many tokens",
        group=BACKENDS,
        parse=parse_int,
        check=positive,
        metavar="TOKENS",
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "the model name responses and /v1/models show (repeatable: the first is the name, "
        "the others aliases a request may use; default: the backend's own, or the embedded "
        "model file's name without its path)",
        group=BACKENDS,
        parse=split_list,
        metavar="NAME",
    )
    api_keys: tuple[str, ...] = setting(
        (),
        "if set, clients must present one of these keys (repeatable)",
        group=SECURITY,
        parse=split_list,
        metavar="KEY",
    )
    upstream_api_key: str | None = setting(
        None,
        "bearer token sent to backends instead of the client's",
        group=SECURITY,
        metavar="KEY",
    )
    compaction_key: str | None = setting(
        None,
        "secret that seals compaction items (any string; 64 hex digits are the key itself). "
        "Default: a key generated into the state dir on first start (in memory only under "
        "--zdr). Replicas on one --shared-store must all be given the same one",
        group=SECURITY,
        metavar="SECRET",
    )
    log_level: str = setting(
        "info",
        "how much the proxy logs (on stderr)",
        group=OBSERVABILITY,
        parse=str.lower,
        check=Choices("debug", "info", "warning", "error"),
    )
    access_log: str = setting(
        "off",
        "one line per request on stdout",
        group=OBSERVABILITY,
        parse=str.lower,
        check=Choices("off", "text", "json"),
    )

    def resident_bytes(self, *, journaled: bool) -> int:
        """--max-resident-bytes, or its default: in front of the state dir's journal the
        resident tier only spares a read back (a chain in use stays resident either way);
        a memory-only store's is the store itself."""
        if self.max_resident_bytes is not None:
            return self.max_resident_bytes
        return JOURNALED_RESIDENT_BYTES if journaled else RESIDENT_BYTES

    def __post_init__(self) -> None:
        for name in SETTINGS:
            try:
                check_value(name, getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{flag_name(name)}: {exc}") from None
        if self.shared_store is not None and self.zdr:
            raise ValueError("--zdr keeps nothing outside the process: no --shared-store")
        if len(self.upstream_dialect) > 1 and len(self.upstream_dialect) != len(self.upstream):
            raise ValueError(
                f"--upstream-dialect: {len(self.upstream_dialect)} dialects for "
                f"{len(self.upstream)} --upstream URLs: give one for all, or one per URL"
            )

    def dialect_of(self, url: str) -> str:
        """The API the backend at `url` (a normalized root) speaks."""
        dialects = self.upstream_dialect
        if len(dialects) == 1:
            return dialects[0]
        if dialects and url in self.upstream:
            return dialects[self.upstream.index(url)]
        return DIALECTS[0]


SETTINGS = tuple(f.name for f in dataclasses.fields(Config))
_FIELDS = Config.__dataclass_fields__


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def flag_name(setting: str) -> str:
    return "--" + key_name(setting)


def key_name(setting: str) -> str:
    """The setting's key in a config file: the flag's name without its dashes."""
    return setting.replace("_", "-")


def help_for(setting: str) -> str:
    return str(_FIELDS[setting].metadata["help"])


def group_of(setting: str) -> str:
    return str(_FIELDS[setting].metadata["group"])


def is_hidden(setting: str) -> bool:
    return bool(_FIELDS[setting].metadata["hidden"])


def kind_of(setting: str) -> str:
    """flag (a bool: no value on the command line), list (repeatable) or value."""
    default = _default(setting)
    return (
        "flag" if isinstance(default, bool) else "list" if isinstance(default, tuple) else "value"
    )


_METAVARS: dict[Callable[[Any], Any], str] = {
    parse_bytes: "SIZE",
    parse_duration: "DURATION",
    parse_int: "N",
    parse_port: "PORT",
}


def metavar_for(setting: str) -> str:
    """The value's name in --help: SIZE, DURATION, N, the choices, or the last word."""
    metadata = _FIELDS[setting].metadata
    if metadata["metavar"]:
        return str(metadata["metavar"])
    if isinstance(metadata["check"], Choices):
        return "|".join(metadata["check"].choices)
    return _METAVARS.get(metadata["parse"], setting.split("_")[-1].upper())


def _default(setting: str) -> Any:
    spec = _FIELDS[setting]
    factory = spec.default_factory
    return spec.default if factory is dataclasses.MISSING else factory()


def default_text(setting: str) -> str | None:
    """The default as --help shows it (64MiB, 30d), or None when there is nothing to show."""
    default: Any = _default(setting)
    if default is None or isinstance(default, bool) or default == ():
        return None
    parse = _FIELDS[setting].metadata["parse"]
    if parse is parse_bytes:
        return format_bytes(default)
    if parse is parse_duration:
        return format_duration(default)
    return str(default)


def check_value(setting: str, value: Any) -> None:
    check = _FIELDS[setting].metadata["check"]
    if check is not None:
        check(value)


def parse_value(setting: str, raw: Any) -> Any:
    """A setting's value from its text (flag, environment, file); for a list setting a
    list of texts. A value that is not text (Config's own type) is taken as it is."""
    kind = kind_of(setting)
    if (kind == "list" and isinstance(raw, list)) or (kind != "list" and isinstance(raw, str)):
        return _FIELDS[setting].metadata["parse"](raw)
    return raw


def build_config(raw: Mapping[str, Any], *, sources: Mapping[str, str] | None = None) -> Config:
    """Raw values (see parse_value; None: unset) → a validated Config, or ConfigError whose
    one line starts with where the bad value came from: `sources[name]` (an environment
    variable, a file's key), else the flag."""
    sources = sources or {}
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None:
            continue
        try:
            values[name] = parse_value(name, value)
            check_value(name, values[name])
        except ValueError as exc:
            raise ConfigError(f"{sources.get(name, flag_name(name))}: {exc}") from None
    try:
        return Config(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def read_config_file(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """A TOML file of settings → (raw values by setting, where each came from). Keys are
    the flags' names without their dashes (`max-disk-bytes = "1GiB"`); values are strings,
    numbers (a size in bytes, a duration in seconds), booleans, and arrays for the
    repeatable settings. An unknown key, or a value of the wrong type, is a ConfigError."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    keys = {key_name(name): name for name in SETTINGS}
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, value in data.items():
        if key not in keys:
            near = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
        name = keys[key]
        sources[name] = f"{path}: {key}"
        raw[name] = _from_toml(name, value, sources[name])
    return raw, sources


def _from_toml(name: str, value: Any, source: str) -> Any:
    """A TOML value as the text a flag would have given."""
    kind = kind_of(name)
    if kind == "list" and isinstance(value, list):
        if all(isinstance(item, str) for item in value):
            return value
    elif kind == "list" and isinstance(value, str):
        return [value]
    elif isinstance(value, bool):
        if kind == "flag":
            return "true" if value else "false"
    elif isinstance(value, str):
        return value
    elif isinstance(value, int | float) and kind == "value":
        return str(value)
    wanted = {"flag": "true or false", "list": "an array of strings"}.get(
        kind, "a string or a number"
    )
    raise ConfigError(f"{source}: expected {wanted}, got {value!r}")


def idle_settings(config: Config, sources: Mapping[str, str]) -> list[str]:
    """One line for each setting that does nothing beside the others: the embedded
    backend's (`--local-*`) with --upstream; --kv-save-dir without one (the embedded
    backend keeps its saves in the state dir); --kv-cache-types without --kv-save-dir
    upstream (the embedded backend's types are its own). Each names where it came from
    (`sources`, as build_config takes them)."""
    external_saves = bool(config.upstream) and config.kv_save_dir is not None
    idle = {
        name: "it sets the embedded backend, which runs only when no --upstream is given"
        for name in SETTINGS
        if name.startswith("local_") and config.upstream
    }
    if not config.upstream:
        idle["kv_save_dir"] = (
            "it is an --upstream llama-server's slot directory; the embedded backend "
            "keeps its KV saves in the state dir"
        )
    if not external_saves:
        idle["kv_cache_types"] = "it describes the llama-servers of --kv-save-dir with --upstream"
    return [
        f"{sources.get(name, flag_name(name))}: ignored: {why}"
        for name, why in idle.items()
        if getattr(config, name) != _default(name)
    ]


def unknown_env_names(environ: Mapping[str, str], known: Sequence[str] = ()) -> list[str]:
    """One line for each OCXPROXY_* variable that is no setting's (nor in `known`), naming
    the setting's variable closest to it, if one is close: most likely a typo."""
    names = {name.upper(): env_name(name) for name in SETTINGS}
    names["CONFIG"] = CONFIG_ENV
    lines = []
    for variable in sorted(environ):
        if variable.startswith(ENV_PREFIX) and variable not in known:
            suffix = variable.removeprefix(ENV_PREFIX)
            if suffix in names:
                continue
            near = difflib.get_close_matches(suffix, names, n=1)
            hint = f" (did you mean {names[near[0]]}?)" if near else ""
            lines.append(f"unknown environment variable {variable}{hint}")
    return lines
