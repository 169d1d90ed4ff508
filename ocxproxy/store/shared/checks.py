"""Start-up checks of a shared store's server against the durability profile.

`ack` (strict): the server must persist every write before answering it: AOF on with
`appendfsync always`. `relaxed`: AOF with `everysec` is accepted, AOF off is a warning.
An evicting `maxmemory-policy` is refused in both: every key has a TTL, so a server under
memory pressure would silently drop history (noeviction fails the write instead, which
the proxy reports). Redis >= 7.0 or Valkey (the scripts use PXAT and PEXPIREAT GT). A
server that frees expired keys in its main thread is a warning: an item-index bucket
holds every item of a scope that expires in one eighth of the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ocxproxy.config import ConfigError
from ocxproxy.store.shared.wire import STALL, ReplyError, Wire, open_wire

log = logging.getLogger("ocxproxy.store.shared")

WAIT_TIMEOUT_MS = 1000  # WAIT/WAITAOF's bound on the replicas' acknowledgement


class SharedStoreRefused(ConfigError):
    """The shared store cannot hold acknowledged turns as the profile promises."""


async def connect(
    url: str, durability: str, wait_replicas: int, patience: float
) -> tuple[Wire, tuple[Any, ...]]:
    """A connection to the server at `url`, checked (tried again for `patience` seconds
    while it cannot be reached), and the command that waits for replicas (see
    check_server)."""
    deadline = time.monotonic() + patience
    while True:
        wire: Wire | None = None
        try:
            wire = await open_wire(url)
            async with asyncio.timeout(STALL):
                return wire, await check_server(wire, durability, wait_replicas)
        except (ReplyError, OSError) as exc:
            if wire is not None:
                wire.close()
            if time.monotonic() >= deadline:
                reason = str(exc) or f"no answer within {STALL:g} s"
                raise SharedStoreRefused(f"shared store {url} unreachable: {reason}") from None
            await asyncio.sleep(0.2)
        except BaseException:
            if wire is not None:
                wire.close()
            raise


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _info(wire: Wire, section: str) -> dict[str, str]:
    """INFO's `field:value` lines."""
    lines = _text(await wire.ask("INFO", section)).splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line and line[:1] != "#")


async def check_server(wire: Wire, durability: str, wait_replicas: int) -> tuple[Any, ...]:
    """Check the server (ReplyError/OSError when it cannot be asked); returns the command
    that waits for `wait_replicas` replicas after a write (empty: none asked)."""
    info = await _info(wire, "server")
    version = _text(info.get("valkey_version") or info.get("redis_version") or "0")
    major = int(version.split(".")[0] or 0)
    if "valkey_version" not in info and major < 7:
        raise SharedStoreRefused(f"shared store: Redis {version} is too old (7.0 or later)")
    try:
        raw = await wire.ask("CONFIG", "GET", "*")
        config = {_text(k): _text(v) for k, v in zip(raw[::2], raw[1::2], strict=True)}
    except ReplyError as exc:  # CONFIG renamed or forbidden (managed services)
        if durability == "ack":
            raise SharedStoreRefused(
                f"shared store: cannot read its configuration ({exc}); --durability ack "
                "needs to verify appendonly yes and appendfsync always"
            ) from None
        log.warning("shared store: cannot read its configuration (%s); not verified", exc)
        config = {}
    policy = config.get("maxmemory-policy", "noeviction")
    if policy != "noeviction":
        raise SharedStoreRefused(
            f"shared store: maxmemory-policy is {policy}: the server would evict stored "
            "turns silently; set it to noeviction"
        )
    aof, fsync = config.get("appendonly"), config.get("appendfsync")
    if durability == "ack" and (aof != "yes" or fsync != "always"):
        raise SharedStoreRefused(
            f"shared store: --durability ack needs appendonly yes and appendfsync always "
            f"(the server has appendonly {aof}, appendfsync {fsync}); or use --durability relaxed"
        )
    if config and aof != "yes":
        log.warning("shared store: appendonly is off: a server restart loses stored turns")
    elif config and fsync == "no":
        log.warning("shared store: appendfsync no: a server crash may lose recent turns")
    if config.get("lazyfree-lazy-expire") == "no":  # Redis <= 7.x's default; Valkey's is yes
        log.warning(
            "shared store: lazyfree-lazy-expire is no: when an item-index bucket expires, the "
            "server frees it in its only thread (about 1 s per million items, every client "
            "waiting); set lazyfree-lazy-expire yes"
        )
    if wait_replicas <= 0:
        return ()
    replication = await _info(wire, "replication")
    connected = int(replication.get("connected_slaves", 0))
    if connected < wait_replicas:
        log.warning(
            "shared store: %d replicas connected, %d asked for: commits fail until they are",
            connected,
            wait_replicas,
        )
    if durability == "ack":
        try:  # Redis 7.2+, Valkey: also fsynced on the replicas
            await wire.ask("WAITAOF", 0, 0, 0)
        except ReplyError:
            pass  # Redis 7.0: WAIT (replicated, maybe not yet fsynced there)
        else:
            return ("WAITAOF", 1, wait_replicas, WAIT_TIMEOUT_MS)
    return ("WAIT", wait_replicas, WAIT_TIMEOUT_MS)
