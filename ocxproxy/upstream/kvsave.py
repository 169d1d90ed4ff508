"""Warm resume on llama.cpp (CONTRACT.md C12): a stored chain's KV state saved to disk
after its turn is acknowledged, and restored into the backend's slot before a
continuation the backend has lost (it restarted since), so the turn costs its tail.

The embedded backend runs with one slot (slot 0) and `--slot-save-path` set to this
directory (0700; llama.cpp writes the files with umask 077). External llama-servers may
share it (each started with `--slot-save-path` there and one slot): a save made on one
is restored on another the chain is routed to, when their fingerprints match. A save is
named by its chain's digest (SHA-256 of the scope and the chain's segment digests), never
by a response id; `index.json` keeps, per save: its fingerprint, tokens, bytes, when it
was last used, the backend and start it is known to be cached in, and the turns of the
chain it is the longest saved prefix of. A chain is saved again once it grew by `every` tokens;
the new save supersedes the older one. The directory's files stay within a byte budget
(the least recently used go first).

A restore is trusted only when the fingerprint matches exactly (model file size and
SHA-256, context size, KV cache types, chat template, backend build), and only once
verified: the continuation's cached tokens must cover what was restored; one that did
not take is not tried on that backend again (the save goes once no backend that could
use it is left), and that backend's restores are switched off after `FAILURES_TO_STOP`
in a row. A miss costs latency, never correctness: the full history is always sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from ocxproxy.metrics import Metrics
from ocxproxy.upstream.http1 import Http1Client, Http1Error

log = logging.getLogger("ocxproxy.upstream")

SLOT: Final = 0  # the embedded backend's only slot
INDEX: Final = "index.json"
DIGESTS: Final = "model-digests.json"  # a model file's SHA-256, by path, size and mtime
SUFFIX: Final = ".kv"
PART: Final = ".part"  # a save being written: removed at start
SLACK: Final = 32  # tokens a save or a restore may differ from what was expected by
FAILURES_TO_STOP: Final = 3  # restores in a row that did not take before they stop
ACTION_TIMEOUT: Final = 300.0  # a save of a long chain on a slow disk
KV_TYPES: Final = "f16/f16"  # the embedded backend's cache types (llama.cpp's default)


@dataclass(slots=True)
class Save:
    """One saved KV state: a prefix of a chain."""

    name: str  # file name in the directory
    fingerprint: str
    tokens: int  # what llama.cpp saved (n_saved)
    size: int  # bytes on disk
    used: float  # wall time it was last saved or restored
    responses: list[str]  # the chain's turns whose longest saved prefix it is
    boot: str = ""  # the backend and start whose cache holds it ("": none running now)
    # The backends (urls) a restore of it did not take on, since the proxy started: it is
    # not tried there again, and goes when every backend that could use it is among them.
    failed: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Slots:
    """One llama.cpp backend that saves into the directory, and its slot actions."""

    url: str
    boot: Callable[[], str]  # its current start's identity
    fingerprint: str = ""
    restoring: bool = True  # off after repeated restores that did not take
    failures: int = 0  # restores in a row that did not take
    # An external llama-server, whose start is known only by the health probe's downs:
    # its slot's task id is read before a continuation whose save it should hold
    # (`restarted`). `task`: the last it showed, in the start `task_start`.
    tasks: bool = False
    task: int | None = None
    task_start: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one slot action at a time

    def start(self) -> str:
        """Where a save's state is cached: this backend, in its current start."""
        return f"{self.url} {self.boot()}"


@dataclass(slots=True)
class Outcome:
    """What a restore did, for the turn's verification (`KvSaves.verify`)."""

    save: Save
    tokens: int  # n_restored
    slots: Slots  # the backend it was restored on


@dataclass(slots=True)
class KvSaves:
    """The saves in one directory, of the llama.cpp backends that write there (the
    embedded one, or the --upstream servers of --kv-save-dir)."""

    directory: Path
    budget: int  # bytes the directory's saves may occupy
    every: int  # a chain is saved again once it grew by this many tokens
    http: Http1Client
    metrics: Metrics
    backends: dict[str, Slots] = field(default_factory=dict)  # by url (set by `attach`)
    by_name: dict[str, Save] = field(default_factory=dict)
    by_response: dict[str, Save] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    version: int = 0  # of the index, as changed on the loop
    written: int = 0  # the version on disk
    writing: threading.Lock = field(default_factory=threading.Lock)

    # -- start, stop

    async def open(self) -> None:
        """Make the directory (0700) and load the index: saves whose file is gone are
        forgotten, save files no save names (a save cut short) are removed."""
        loaded = await asyncio.to_thread(self._load)
        for save in loaded:
            self._add(save)
        self.metrics.kv_saved_bytes.set_function(lambda: sum(s.size for s in self.by_name.values()))

    async def attach(
        self,
        url: str,
        boot: Callable[[], str],
        model: Path | None,
        *,
        external: bool = False,
        kv_types: str = KV_TYPES,
    ) -> None:
        """The backend at `url` (started, healthy) runs `model` (None: the file its
        `/props` names, when this machine can read it) with `kv_types` (K/V: llama-server
        reports none); `boot()` names its current start. Its fingerprint is made from its
        `/props`, the model file and those types. An `external`
        server's slot task ids are read from its `/slots` to notice a restart the health
        probe missed, when it answers that."""
        props = await self._ask(url, "GET", "/props", None) or {}
        if model is None and isinstance(props.get("model_path"), str):
            model = Path(props["model_path"])
        slots = self.backends.get(url) or Slots(url, boot)
        slots.boot = boot
        slots.fingerprint = await asyncio.to_thread(
            fingerprint_of, props, model, self.directory, kv_types
        )
        if external:
            answered, slots.task = await self._slot_task(url)
            slots.tasks, slots.task_start = answered, slots.start()
            if not answered:
                log.warning(
                    "warm resume on %s: it does not answer GET /slots, so a restart between "
                    "two health probes goes unnoticed (its chains then compute their history "
                    "again once)",
                    url,
                )
        self.backends[url] = slots

    async def supported(self, url: str) -> str | None:
        """Whether the llama.cpp server at `url` takes slot actions into one slot: None
        when it does, else why not. Asks a restore of a file that does not exist: a
        server started without `--slot-save-path` refuses the action itself."""
        props = await self._ask(url, "GET", "/props", None)
        if props is None:
            return "it has no /props (not llama.cpp's server?)"
        if props.get("total_slots", 1) != 1:
            return f"it has {props.get('total_slots')} slots (warm resume needs --parallel 1)"
        body = orjson.dumps({"filename": "ocxproxy-probe" + SUFFIX})
        status, answer = await self._status(url, "POST", f"/slots/{SLOT}?action=restore", body)
        if status == 400 and b"restore" in answer.lower():
            return None  # it looked for the file: slot actions are on
        return "it was not started with --slot-save-path"

    async def close(self) -> None:
        """Let saves under way finish (a cut one leaves a .part file, removed at start)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=30)
        await asyncio.to_thread(self._write_index, self._rows())

    # -- the request path

    def saved_for(self, response_id: str, url: str) -> tuple[Save, Slots] | None:
        """The longest saved prefix of the chain ending at `response_id`, when the cache
        of the backend at `url` does not hold it (it restarted since, or the chain was
        served elsewhere): None when nothing is to be restored there."""
        save, slots = self.by_response.get(response_id), self.backends.get(url)
        if save is None or slots is None or save.boot == slots.start() or url in save.failed:
            return None
        return save, slots

    def unsure(self, response_id: str, url: str) -> bool:
        """Whether the chain ending at `response_id` has a save the external server at
        `url` should hold in its cache, as far as the health probe knows: worth
        `restarted`'s read before the continuation is sent."""
        save, slots = self.by_response.get(response_id), self.backends.get(url)
        return (
            save is not None
            and slots is not None
            and slots.tasks
            and slots.restoring
            and save.boot == slots.start()
            and url not in save.failed
        )

    async def restarted(self, url: str) -> bool:
        """Whether the server at `url` was started again since its current start began,
        unseen by the health probe (llama-server exposes no start identity): its slot
        shows no task, though a continuation's save is known to be in it (a turn or a
        restore ran there), or a task id below one seen before (each process numbers its
        tasks from 0). One GET /slots; False when it did not answer, or when a restart
        was noticed meanwhile."""
        slots = self.backends[url]
        start = slots.start()
        answered, task = await self._slot_task(url)
        if not answered or slots.start() != start:
            return False
        known = slots.task if slots.task_start == start else None  # (another start's ids)
        fresh = task is None or (known is not None and task < known)
        slots.task, slots.task_start = task, start
        if fresh:
            log.warning(
                "%s was started again since its last health probe (its slot's task ids "
                "began anew): its chains' KV saves are restored",
                url,
            )
        return fresh

    async def _slot_task(self, url: str) -> tuple[bool, int | None]:
        """Whether `url` answered GET /slots, and its slot's last task id (None: it has
        run none)."""
        for _ in range(2):  # once more: the first may have met the previous process's socket
            status, data = await self._status(url, "GET", "/slots", None)
            if status:
                break
        try:
            listing = orjson.loads(data) if status == 200 else None
        except orjson.JSONDecodeError:
            listing = None
        if not isinstance(listing, list) or not listing or not isinstance(listing[0], dict):
            return False, None
        task = listing[0].get("id_task")
        return True, task if isinstance(task, int) and not isinstance(task, bool) else None

    async def restore(self, save: Save, slots: Slots) -> Outcome | None:
        """Load `save` into the slot of `slots`' backend; None when it refused (counted)."""
        started = time.monotonic()
        answer = await self._action(slots, "restore", save.name)
        if answer is None:  # once more: the first may have met the previous process's socket
            answer = await self._action(slots, "restore", save.name)
        restored = answer.get("n_restored") if answer is not None else None
        if not isinstance(restored, int) or restored <= 0:
            self.metrics.kv_restores.labels(outcome="error").inc()
            log.warning("a KV restore on %s was refused; the turn computes it again", slots.url)
            return None
        self.metrics.kv_restore_seconds.labels().observe(time.monotonic() - started)
        save.used = time.time()
        return Outcome(save, restored, slots)

    def verify(self, outcome: Outcome, cached: int) -> bool:
        """Whether the restore took: the turn's cached tokens cover what was restored.
        One that did not is not tried on that backend again, and dropped once no backend
        that could use it is left; after FAILURES_TO_STOP in a row on a backend, its
        restores stop."""
        save, slots = outcome.save, outcome.slots
        if cached + SLACK >= outcome.tokens:
            slots.failures = 0
            save.boot = slots.start()
            self.metrics.kv_restores.labels(outcome="ok").inc()
            return True
        self.metrics.kv_restores.labels(outcome="failed").inc()
        save.failed.add(slots.url)
        if all(
            other.url in save.failed or other.fingerprint != save.fingerprint
            for other in self.backends.values()
        ):
            self.drop(save)
        slots.failures += 1
        if slots.failures >= FAILURES_TO_STOP and slots.restoring:
            slots.restoring = False
            log.warning(
                "KV restores on %s did not take %d times in a row (the backend reported "
                "no cache use after a successful restore); restores are off until the "
                "proxy restarts. Saves go on. Backend build fingerprint %s",
                slots.url,
                slots.failures,
                slots.fingerprint[:16],
            )
        return False

    def mismatched(self, save: Save, slots: Slots) -> bool:
        """A save made for another model, context, template or build than `slots`'
        backend runs: counted; dropped when no backend that saves here runs that one."""
        if save.fingerprint == slots.fingerprint:
            return False
        self.metrics.kv_restores.labels(outcome="fingerprint_mismatch").inc()
        if all(save.fingerprint != other.fingerprint for other in self.backends.values()):
            self.drop(save)
        return True

    def after_turn(
        self,
        response_id: str,
        parent_id: str | None,
        scope: str,
        tokens: int,
        segments: Callable[[], Iterable[str]],
        url: str,
    ) -> None:
        """A durable turn was acknowledged, `tokens` long (input and output), served by
        the backend at `url` (one that saves here, else nothing is done): saved off the
        reply path when its chain grew by `every` tokens since the chain's last save, else
        the turn joins that save's chain. A conversation's turns come as the conversation
        (`response_id` and `parent_id` its id). `segments`: the chain's segment digests,
        oldest first."""
        slots = self.backends.get(url)
        if slots is None:
            return
        previous = self.by_response.get(parent_id) if parent_id is not None else None
        joins = previous is not None and url not in previous.failed  # (else: saved anew)
        if previous is not None and joins and tokens - previous.tokens < self.every:
            if response_id != parent_id:  # (a conversation's turns are the conversation's)
                previous.responses.append(response_id)
                self.by_response[response_id] = previous
            return
        if tokens < self.every:
            return
        task = asyncio.get_running_loop().create_task(
            self._save(slots, scope, segments, response_id, tokens, previous), name="kv-save"
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def forget(self, response_id: str) -> None:
        """A response was deleted: a save only it reached goes with it."""
        save = self.by_response.pop(response_id, None)
        if save is None:
            return
        with contextlib.suppress(ValueError):
            save.responses.remove(response_id)
        if not save.responses:
            self.drop(save)

    def drop(self, save: Save) -> None:
        """Forget a save and remove its file (in a thread, off the loop)."""
        if self.by_name.get(save.name) is not save:
            return
        del self.by_name[save.name]
        for response_id in save.responses:
            if self.by_response.get(response_id) is save:
                del self.by_response[response_id]
        self._spawn(asyncio.to_thread(self._remove, save.name, self._rows()))

    # -- saving

    async def _save(
        self,
        slots: Slots,
        scope: str,
        segments: Callable[[], Iterable[str]],
        response_id: str,
        tokens: int,
        previous: Save | None,
    ) -> None:
        name = chain_digest(scope, segments()) + SUFFIX  # after the reply, not before
        started = time.monotonic()
        answer = await self._action(slots, "save", name + PART)
        saved = answer.get("n_saved") if answer is not None else None
        if not isinstance(saved, int) or abs(saved - tokens) > SLACK:
            # Refused, or the slot held another prompt by then: not this chain's state.
            self.metrics.kv_saves.labels(outcome="error" if saved is None else "stale").inc()
            await asyncio.to_thread(self._unlink, name + PART)
            return
        try:
            size = await asyncio.to_thread(self._commit_file, name)
        except OSError as exc:
            log.warning("a KV save could not be kept: %s", exc)
            self.metrics.kv_saves.labels(outcome="error").inc()
            return
        self.metrics.kv_saves.labels(outcome="saved").inc()
        self.metrics.kv_save_bytes.inc(size)
        self.metrics.kv_save_seconds.labels().observe(time.monotonic() - started)
        old = self.by_name.get(name)
        if old is not None:  # the same chain saved again (a retried turn)
            self.drop(old)
        if previous is not None:  # superseded by this longer prefix of its chain
            self.drop(previous)
        self._add(
            Save(name, slots.fingerprint, saved, size, time.time(), [response_id], slots.start())
        )
        self._evict()
        await asyncio.to_thread(self._write_index, self._rows())

    def _evict(self) -> None:
        total = sum(save.size for save in self.by_name.values())
        for save in sorted(self.by_name.values(), key=lambda s: s.used):
            if total <= self.budget:
                return
            total -= save.size
            self.metrics.kv_evictions.inc()
            self.drop(save)

    async def _action(self, slots: Slots, action: str, filename: str) -> dict[str, Any] | None:
        body = orjson.dumps({"filename": filename})
        async with slots.lock:
            return await self._ask(slots.url, "POST", f"/slots/{SLOT}?action={action}", body)

    async def _ask(
        self, url: str, method: str, path: str, body: bytes | None
    ) -> dict[str, Any] | None:
        status, data = await self._status(url, method, path, body)
        if status != 200:
            log.debug("%s %s answered %d: %s", method, path, status, data[:200])
            return None
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        return answer if isinstance(answer, dict) else None

    async def _status(
        self, url: str, method: str, path: str, body: bytes | None
    ) -> tuple[int, bytes]:
        """The answer's status and body (0 when there was none)."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            async with asyncio.timeout(ACTION_TIMEOUT):
                response = await self.http.request(method, url, path, headers, body)
                try:
                    data = await response.read()
                except BaseException:
                    response.close()
                    raise
                response.release()
        except (Http1Error, TimeoutError, OSError) as exc:
            log.debug("%s %s failed: %s", method, path, exc)
            return 0, b""
        return response.status, data

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _add(self, save: Save) -> None:
        self.by_name[save.name] = save
        for response_id in save.responses:
            self.by_response[response_id] = save

    # -- files (in a thread)

    def _load(self) -> list[Save]:
        if not self.directory.is_dir():  # an external server's is the operator's to set
            self.directory.mkdir(mode=0o700, parents=True)
            self.directory.chmod(0o700)
        try:
            rows = orjson.loads((self.directory / INDEX).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            rows = []
        saves = []
        for row in rows if isinstance(rows, list) else []:
            with contextlib.suppress(TypeError, ValueError):
                save = Save(**{**row, "boot": ""})
                if (self.directory / save.name).is_file():
                    saves.append(save)
        named = {save.name for save in saves}
        for path in self.directory.iterdir():  # saves cut short, or no longer indexed
            if path.name.endswith((SUFFIX, PART)) and path.name not in named:
                with contextlib.suppress(OSError):
                    path.unlink()
        return saves

    def _rows(self) -> tuple[int, list[dict[str, Any]]]:
        """The index as it is now, numbered: threads write it in any order, the newest
        stays."""
        self.version += 1
        return self.version, [_row(save) for save in self.by_name.values()]

    def _remove(self, name: str, rows: tuple[int, list[dict[str, Any]]]) -> None:
        self._unlink(name)
        self._write_index(rows)

    def _write_index(self, rows: tuple[int, list[dict[str, Any]]]) -> None:
        version, data = rows
        with self.writing:
            if version <= self.written:
                return
            part = self.directory / (INDEX + PART)
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(orjson.dumps(data))
            part.replace(self.directory / INDEX)
            self.written = version

    def _commit_file(self, name: str) -> int:
        part = self.directory / (name + PART)
        with contextlib.suppress(PermissionError):  # an external server's own file
            part.chmod(0o600)
        part.replace(self.directory / name)
        return (self.directory / name).stat().st_size

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(OSError):
            (self.directory / name).unlink()


def _row(save: Save) -> dict[str, Any]:
    """A save as the index keeps it: what holds it in a cache, and where its restores did
    not take, last only while the proxy runs."""
    row = asdict(save)
    row["boot"] = ""
    del row["failed"]
    return row


def chain_digest(scope: str, segments: Iterable[str]) -> str:
    """A save's name: the chain's identity under its scope, not a response id."""
    digest = hashlib.sha256(scope.encode())
    for key in segments:
        digest.update(key.encode())
    return digest.hexdigest()


def default_budget(directory: Path) -> int:
    """A tenth of the free disk where the saves go, at most 16 GiB."""
    try:
        stats = os.statvfs(directory if directory.exists() else directory.parent)
    except OSError:
        return 1024**3
    return min(stats.f_bavail * stats.f_frsize // 10, 16 * 1024**3)


def fingerprint_of(
    props: dict[str, Any], model: Path | None, directory: Path, kv_types: str = KV_TYPES
) -> str:
    """Everything that changes the KV state: the model file (size and SHA-256, hashed
    once per file version and kept in the directory), the context size, the cache types
    (`kv_types`, K/V), the chat template and the backend's build. Runs in a thread."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    try:
        build = importlib.metadata.version("xllamacpp")
    except importlib.metadata.PackageNotFoundError:
        build = "unknown"
    parts = {
        "model": model_digest(model, directory) if model is not None else None,
        "n_ctx": n_ctx,
        "kv": kv_types,
        "template": props.get("chat_template"),
        "build": [props.get("build_info"), build],
    }
    return hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()


def model_digest(model: Path, directory: Path) -> str:
    """The model file's size and SHA-256; its path when this machine cannot read it (an
    external server's: its `/props` names it)."""
    try:
        stat = model.stat()
    except OSError:
        return f"path:{model}"
    key = f"{model.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    known: dict[str, str] = {}
    with contextlib.suppress(OSError, orjson.JSONDecodeError, AttributeError):
        known = dict(orjson.loads((directory / DIGESTS).read_bytes()))
    if key not in known:
        digest = hashlib.sha256()
        with model.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        known[key] = f"{stat.st_size}:{digest.hexdigest()}"
        part = directory / (DIGESTS + PART)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(known))
        part.replace(directory / DIGESTS)
    return known[key]
