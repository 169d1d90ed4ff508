"""The shared tier's connection to its Valkey/Redis server: every round trip, timed per
operation; the scripts (loaded again when the server lost them); WAIT/WAITAOF pipelined
with a write; and availability: any Redis or OS error is StorageUnavailable (503) and the
server is unavailable until a round trip, or the probe's PING, succeeds. The probe PINGs
every second that saw no answer (an idle replica too), so a server that went away is
noticed within PROBE_EVERY + PING_TIMEOUT even when no turn runs.

Every command, the start-up checks' too, goes over one lean pipelined connection
(wire.py), the tier's only client."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.errors import FailureReason, StorageUnavailable, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.store.shared import layout
from ocxproxy.store.shared.checks import SharedStoreRefused, connect
from ocxproxy.store.shared.wire import ReplyError, Wire, open_wire, pack

log = logging.getLogger("ocxproxy.store.shared")

PROBE_EVERY = 1.0  # seconds between probes (skipped while round trips are answered)
PING_TIMEOUT = 2.0  # a PING unanswered this long: the server is unavailable
UNAVAILABLE = (
    "The proxy's shared store is unavailable: nothing was forwarded or stored. Retry later."
)
_SOURCES = {
    "begin": layout.BEGIN,
    "item": layout.ITEM,
    "commit": layout.COMMIT,
    "keep_lost": layout.KEEP_LOST,
}
# A script's SHA1 is its name on the server: known here, whether or not it is loaded there.
_SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in _SOURCES.items()}


def register_scripts(sources: dict[str, str]) -> None:
    """Scripts other modules of the shared tier run by name with `script` or `write`
    (conversations.py's), loaded with these."""
    _SOURCES.update(sources)
    _SHAS.update({name: hashlib.sha1(s.encode()).hexdigest() for name, s in sources.items()})


class Server:
    def __init__(self, url: str, metrics: Metrics, *, wait_replicas: int = 0) -> None:
        self.url = url
        self.metrics = metrics
        self.wait_replicas = wait_replicas
        self.available = True
        self._started = False
        self._wire: Wire | None = None
        self._opening = asyncio.Lock()
        self._wait = b""  # the command that waits for replicas, packed, if asked
        self._probe: asyncio.Task[None] | None = None
        self._timers: dict[str, Any] = {}
        self._answered = 0.0  # when a round trip last succeeded (time.monotonic())

    async def start(self, durability: str, patience: float) -> None:
        """Connect, check the server against the durability profile (SharedStoreRefused
        when it does not fit, or cannot be reached within `patience` seconds), load the
        scripts, and start the probe."""
        if self._started:
            return
        wire, wait = await connect(self.url, durability, self.wait_replicas, patience)
        try:
            await self._load(wire)
        except (ReplyError, OSError) as exc:
            wire.close()
            raise SharedStoreRefused(f"shared store {self.url}: {exc}") from None
        self._wire = wire
        self._wait = pack(*wait) if wait else b""
        self._started = True
        self.available = True
        self._probe = spawn(self._watch(), name="shared-store-probe")
        log.info("shared store %s ready (%s)", self.url, durability)

    async def close(self) -> None:
        if self._probe is not None:
            await cancel_and_wait(self._probe)
            self._probe = None
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        self._started = False

    async def _watch(self) -> None:
        """Every second: cut a connection the server stopped answering on (commands
        waiting STALL seconds); then, on an idle connection that saw no answer within the
        second, a PING. A PING that fails, or gets no answer within PING_TIMEOUT, makes
        the store unavailable (an idle replica notices a server that went away); its first
        answer makes it available again (no restart needed)."""
        while True:
            await asyncio.sleep(PROBE_EVERY)
            now = time.monotonic()
            wire = self._wire
            if wire is not None and wire.stalled(now):
                wire.close(TimeoutError("shared store stopped answering"))
            if self.available and (
                now - self._answered < PROBE_EVERY or (wire is not None and wire.busy)
            ):
                continue  # answers come, or commands wait on them (a WAIT): not idle
            try:
                async with asyncio.timeout(PING_TIMEOUT):  # (not wait_for: see probing)
                    await self.command("ping", "PING")
            except StorageUnavailable:
                pass  # marked unavailable already
            except TimeoutError:
                self._down("ping", TimeoutError(f"no answer to PING within {PING_TIMEOUT:g} s"))

    # -- the lean connection: a turn's round trips ---------------------------------------

    async def _connection(self) -> Wire:
        async with self._opening:  # one opening at a time; the others wait and share it
            wire = self._wire
            if wire is None or wire.lost is not None:
                if not self._started:
                    raise ConnectionError("shared store closed")
                wire = self._wire = await open_wire(self.url)
            return wire

    async def _exchange(self, packed: bytes, answers: int) -> list[Any]:
        wire = self._wire
        if wire is None or wire.lost is not None:
            wire = await self._connection()
        futures = wire.send(packed, answers)
        if answers == 1:
            return [await futures[0]]
        return list(await asyncio.gather(*futures))  # (each failure retrieved)

    async def round_trip(self, op: str, packed: bytes, answers: int = 1) -> list[Any]:
        """Packed commands, one round trip, timed; their answers (ReplyError values
        included). A server that cannot answer is StorageUnavailable, and the store is
        unavailable until one answers."""
        if not self._started:
            raise StorageUnavailable(UNAVAILABLE)
        started = time.perf_counter()
        try:
            try:
                replies = await self._exchange(packed, answers)
            except ConnectionError:
                # A connection from before a server restart fails on first use: once more
                # on a new one (every operation may run twice: COMMIT recognizes a record
                # it already wrote).
                replies = await self._exchange(packed, answers)
        except (OSError, ReplyError) as exc:  # ReplyError: AUTH/SELECT refused
            self._down(op, exc)
            raise StorageUnavailable(UNAVAILABLE) from None
        self._observe(op, time.perf_counter() - started)
        return replies

    async def command(self, op: str, *args: bytes | str | int) -> Any:
        """One command's answer (MGET, HGET, DEL, PING ...)."""
        (reply,) = await self.round_trip(op, pack(*args))
        return self._checked(op, reply)

    def _checked(self, op: str, reply: Any) -> Any:
        if isinstance(reply, ReplyError):
            if str(reply).startswith(layout.LOST):
                raise StoreFailure(FailureReason.MISSING, "chain")
            self._down(op, reply)
            raise StorageUnavailable(UNAVAILABLE)
        return reply

    async def script(self, name: str, keys: Sequence[bytes | str], args: Sequence[Any]) -> Any:
        """A read-only script (begin, item)."""
        packed = pack("EVALSHA", _SHAS[name], len(keys), *keys, *args)
        (reply,) = await self.round_trip(name, packed)
        if _lost_scripts(reply):  # the server restarted without them (not persisted)
            await self._reload(name)
            (reply,) = await self.round_trip(name, packed)
        return self._checked(name, reply)

    async def write(self, op: str, command: Callable[[], tuple[Any, ...]]) -> Any:
        """One write, and with --shared-wait-replicas the WAIT/WAITAOF for it on the same
        connection, pipelined: one round trip. Too few replicas acknowledging is a failed
        write (it may have happened on the primary; it is not acknowledged)."""
        packed = pack(*command()) + self._wait
        answers = 2 if self._wait else 1
        replies = await self.round_trip(op, packed, answers)
        if _lost_scripts(replies[0]):  # the server restarted, or was flushed
            await self._reload(op)
            replies = await self.round_trip(op, packed, answers)
        result = self._checked(op, replies[0])
        if self._wait:
            acked = self._checked(op, replies[1])
            acked = acked[-1] if isinstance(acked, list) else acked
            if acked < self.wait_replicas:
                raise StoreFailure(FailureReason.WRITE_FAILED, f"{acked} replicas acknowledged")
        return result

    async def probing(self, op: str, call: Awaitable[Any]) -> Any:
        """The answer of a periodic task's round trip (background leases, every second):
        sent on an idle connection it is a probe too, since the probe's own PING would
        wait behind it: no answer within PING_TIMEOUT makes the server unavailable."""
        wire = self._wire
        if wire is not None and wire.busy:  # behind other commands: the stall check's
            return await call
        try:
            # Not asyncio.wait_for: on Python 3.11 a cancel that comes as `call` ends is
            # lost (wait_for returns its result, or raises its error, instead), and the
            # loop that asked, which goes on after a failed round, never stops.
            async with asyncio.timeout(PING_TIMEOUT):
                return await call
        except TimeoutError:
            self._down(op, TimeoutError(f"no answer within {PING_TIMEOUT:g} s"))
            raise StorageUnavailable(UNAVAILABLE) from None

    def commit_command(self, keys: Sequence[bytes | str], args: Sequence[Any]) -> tuple[Any, ...]:
        return self.script_command("commit", keys, args)

    def script_command(
        self, name: str, keys: Sequence[bytes | str], args: Sequence[Any]
    ) -> tuple[Any, ...]:
        """A script run by name, as `write` sends it."""
        return ("EVALSHA", _SHAS[name], len(keys), *keys, *args)

    async def _reload(self, op: str) -> None:
        try:
            await self._load(await self._connection())
        except (OSError, ReplyError) as exc:
            self._down(op, exc)
            raise StorageUnavailable(UNAVAILABLE) from None

    @staticmethod
    async def _load(wire: Wire) -> None:
        for name, source in _SOURCES.items():
            if (await wire.ask("SCRIPT", "LOAD", source)).decode() != _SHAS[name]:
                raise ReplyError(f"script {name} loaded under another SHA1")

    # -- availability and timing -----------------------------------------------------------

    def _observe(self, op: str, seconds: float) -> None:
        timer = self._timers.get(op)
        if timer is None:
            timer = self._timers[op] = self.metrics.shared_seconds.labels(op)
        timer.observe(seconds)
        self._answered = time.monotonic()
        if not self.available:
            log.warning("shared store answers again: available")
            self.available = True

    def _down(self, op: str, exc: Exception) -> None:
        self.metrics.shared_seconds.labels(op).observe(0.0)
        if self.available:
            log.warning("shared store %s failed (%s): unavailable", op, exc)
        self.available = False


def _lost_scripts(reply: Any) -> bool:
    return isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT")
