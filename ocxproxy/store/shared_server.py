"""The shared tier's connection to its Valkey/Redis server: every round trip, timed per
operation; the scripts (loaded again when the server lost them); WAIT/WAITAOF pipelined
with a write; and availability: any Redis or OS error is StorageUnavailable (503) and the
server is unavailable until a round trip, or the probe's PING every second, succeeds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.errors import FailureReason, StorageUnavailable, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.store import shared_layout as layout
from ocxproxy.store.shared_checks import SharedStoreRefused, connect

log = logging.getLogger("ocxproxy.store.shared")

PROBE_EVERY = 1.0  # seconds between probes while the server is unreachable
UNAVAILABLE = (
    "The proxy's shared store is unavailable: nothing was forwarded or stored. Retry later."
)
_SOURCES = {"begin": layout.BEGIN, "item": layout.ITEM, "commit": layout.COMMIT}


class Server:
    def __init__(self, url: str, metrics: Metrics, *, wait_replicas: int = 0) -> None:
        self.url = url
        self.metrics = metrics
        self.wait_replicas = wait_replicas
        self.available = True
        self._redis: aioredis.Redis | None = None
        self._shas: dict[str, str] = {}
        self._wait: tuple[Any, ...] = ()  # the command that waits for replicas, if asked
        self._probe: asyncio.Task[None] | None = None

    async def start(self, durability: str, patience: float) -> None:
        """Connect, check the server against the durability profile (SharedStoreRefused
        when it does not fit, or cannot be reached within `patience` seconds), load the
        scripts, and start the probe."""
        if self._redis is not None:
            return
        client, self._wait = await connect(self.url, durability, self.wait_replicas, patience)
        try:
            await self._load(client)
        except (RedisError, OSError) as exc:
            await client.aclose()
            raise SharedStoreRefused(f"shared store {self.url}: {exc}") from None
        self._redis = client
        self.available = True
        self._probe = spawn(self._watch(), name="shared-store-probe")
        log.info("shared store %s ready (%s)", self.url, durability)

    async def close(self) -> None:
        if self._probe is not None:
            await cancel_and_wait(self._probe)
            self._probe = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def _watch(self) -> None:
        """While the server is unreachable, a PING every second; the first answer makes
        the store available again (no restart needed)."""
        while True:
            await asyncio.sleep(PROBE_EVERY)
            if self.available:
                continue
            with contextlib.suppress(StorageUnavailable):
                await self.call("ping", lambda r: r.ping())

    async def call(self, op: str, run: Callable[[aioredis.Redis], Awaitable[Any]]) -> Any:
        """One round trip, timed and counted; a server that cannot answer is
        StorageUnavailable, and the store is unavailable until one answers."""
        client = self._redis
        if client is None:
            raise StorageUnavailable(UNAVAILABLE)
        started = time.perf_counter()
        try:
            try:
                result = await run(client)
            except RedisConnectionError:
                # Idle connections from before a server restart fail on first use: drop
                # them all and try once more (every operation may run twice: COMMIT
                # recognizes a record it already wrote).
                await client.connection_pool.disconnect(inuse_connections=False)
                result = await run(client)
        except ResponseError as exc:
            if str(exc).startswith(layout.LOST):
                raise StoreFailure(FailureReason.MISSING, "chain") from None
            self._down(op, exc)
            raise StorageUnavailable(UNAVAILABLE) from None
        except (RedisError, OSError) as exc:
            self._down(op, exc)
            raise StorageUnavailable(UNAVAILABLE) from None
        self.metrics.shared_seconds.labels(op).observe(time.perf_counter() - started)
        if not self.available:
            log.warning("shared store answers again: available")
            self.available = True
        return result

    def _down(self, op: str, exc: Exception) -> None:
        self.metrics.shared_seconds.labels(op).observe(0.0)
        if self.available:
            log.warning("shared store %s failed (%s): unavailable", op, exc)
        self.available = False

    async def script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """A read-only script (begin, item)."""

        async def run(client: aioredis.Redis) -> Any:
            try:
                return await client.evalsha(self._shas[name], len(keys), *keys, *args)
            except NoScriptError:  # the server restarted without them (not persisted)
                await self._load(client)
                return await client.evalsha(self._shas[name], len(keys), *keys, *args)

        return await self.call(name, run)

    async def write(self, op: str, command: Callable[[], tuple[Any, ...]]) -> Any:
        """One write, and with --shared-wait-replicas the WAIT/WAITAOF for it on the same
        connection, pipelined: one round trip. Too few replicas acknowledging is a failed
        write (it may have happened on the primary; it is not acknowledged)."""

        async def run(client: aioredis.Redis) -> Any:
            for attempt in (1, 2):
                try:
                    if not self._wait:
                        return await client.execute_command(*command())  # type: ignore[no-untyped-call]
                    async with client.pipeline(transaction=False) as pipe:
                        pipe.execute_command(*command())
                        pipe.execute_command(*self._wait)
                        result, acked = await pipe.execute()
                    acked = acked[-1] if isinstance(acked, list) else acked
                    if acked < self.wait_replicas:
                        raise StoreFailure(
                            FailureReason.WRITE_FAILED, f"{acked} replicas acknowledged"
                        )
                    return result
                except NoScriptError:  # the server restarted, or was flushed
                    if attempt == 2:
                        raise
                    await self._load(client)
            return None

        return await self.call(op, run)

    def commit_command(self, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        return ("EVALSHA", self._shas["commit"], len(keys), *keys, *args)

    async def _load(self, client: aioredis.Redis) -> None:
        for name, source in _SOURCES.items():
            self._shas[name] = await client.script_load(source)
