"""The journal's writes and fdatasyncs, done by a helper process (fsync_child.py) rather
than on the event loop and a thread.

Why a process: a Python thread back from a blocking call must take the GIL from the event
loop, which under load holds it until the switch interval forces a hand-over. A commit
through a thread pays that two or three times; measured with the journal on tmpfs (so the
fsync itself is free), 16 closed-loop clients under load: 2.5-3.8 ms a commit in a thread,
~1 ms through the helper, and 0.02 context switches a turn instead of 1.4-1.7. The helper
has its own GIL: the loop sends the commit's bytes with a short head (b"w", an id, where
they go), and reads the answer (the id and 0 or the errno) when the socket is readable.
The helper writes them too: a pwrite into the page cache, cheap as a rule, waited up to
~280 ms on this VM's busy disk (dirty-page throttling, a page under writeback), with the
event loop stopped when the loop did it.

Several commits may be in flight: the helper is reached through LANES sockets, each
served by a thread of its own, and a commit goes down a lane with nothing in flight (the
committer has at most as many commits in flight as there are lanes). A lane's thread
waits in recv, writes and syncs what came, answers, and waits again: no thread wakes
another (one thread receiving for all and handing each commit to another cost ~70 us of
the helper's CPU a commit more here, ~230 against ~160 us, in lock and GIL hand-overs).
What a socket does not take at once waits in that lane's buffer, sent when it is
writable, in order.

`FsyncChild.spawn` starts the helper (blocking: run it in a thread); None when it cannot
be started, and the committer writes and syncs in a thread. When the helper dies, every
commit waiting on it, and every later one, raises `ChildGone`: the committer then writes
and syncs them in a thread (the same bytes at the same place: writing again is safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("ocxproxy.store")

PROGRAM = Path(__file__).with_name("fsync_child.py")
READY_TIMEOUT = 10.0  # seconds for the helper to start
EXIT_TIMEOUT = 5.0  # seconds for it to exit once told to
HEAD = struct.Struct(">cBQI")  # b"w", id, offset, length (fsync_child.py unpacks it)
LANES = 4  # sockets (and threads) to the helper, and so the committer's MAX_FLIGHTS


class ChildGone(Exception):
    """The helper process is gone: sync in a thread instead."""


class Lane:
    """One socket to the helper, and its thread there."""

    __slots__ = ("answers", "busy", "out", "sent", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: int | None = None  # the key of the file its thread writes to now
        self.busy = 0  # requests sent down it and not answered yet
        self.answers = b""  # a partial answer
        self.out = bytearray()  # requests the socket did not take yet


class FsyncChild:
    def __init__(self, socks: list[socket.socket], proc: subprocess.Popen[bytes]) -> None:
        self.lanes = [Lane(sock) for sock in socks]
        self.proc = proc
        self.gone = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[int, asyncio.Future[None]] = {}  # by request id
        self._next = 0
        self.answered: Callable[[], None] | None = None  # after answers were read

    def __repr__(self) -> str:
        return f"<FsyncChild pid={self.proc.pid} waiting={len(self._waiting)}>"

    @classmethod
    def spawn(cls, lanes: int = LANES) -> FsyncChild | None:
        """Start the helper and wait until it is ready (blocking); None when it cannot."""
        if not sys.executable:  # an embedded interpreter: no python to run it with
            return None
        pairs = [socket.socketpair() for _ in range(lanes)]
        mine = [a for a, _ in pairs]
        theirs = [b for _, b in pairs]
        try:
            fds = [str(b.fileno()) for b in theirs]
            argv = [sys.executable, "-I", "-S", str(PROGRAM), *fds]
            proc = subprocess.Popen(
                argv, pass_fds=[b.fileno() for b in theirs], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
        except (OSError, ValueError) as exc:
            for sock in mine:
                sock.close()
            log.warning("journal fsync helper not started (%s): syncing in a thread", exc)
            return None
        finally:
            for sock in theirs:
                sock.close()
        ready = True
        for sock in mine:
            sock.settimeout(READY_TIMEOUT)
            try:
                ready = ready and sock.recv(1) == b"r"
            except OSError:
                ready = False
            sock.setblocking(False)
        if not ready:
            for sock in mine:
                sock.close()
            _reap(proc)
            log.warning("journal fsync helper did not start: syncing in a thread")
            return None
        return cls(mine, proc)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for lane in self.lanes:
            loop.add_reader(lane.sock.fileno(), self._readable, lane)

    def write(self, fd: int, key: int, data: bytes, offset: int) -> asyncio.Future[None]:
        """pwrite `data` at `offset` of `fd` (the file `key` names: fd numbers are reused),
        then fdatasync it, by the helper, concurrently with the others in flight (at most
        255). The future raises the OSError the helper met, or ChildGone."""
        if self.gone or self._loop is None:
            raise ChildGone
        request = self._next
        self._next = (request + 1) % 256
        lane = min(self.lanes, key=_busy)  # (the first idle one: the others stay asleep)
        try:
            if key != lane.sent:
                # Every lane's thread gets the new file at once: none keeps an old one open
                # (a removed journal file's space is freed only once no one holds it). Only
                # with nothing in flight: a thread may receive a request and the file sent
                # after it together, and would write the request to the new file.
                if any(other.out or other.busy for other in self.lanes):
                    raise OSError("a new file while requests are in flight")
                for other in self.lanes:
                    if other.sent != key:
                        socket.send_fds(other.sock, [b"f"], [fd])
                        other.sent = key
            self._send(lane, HEAD.pack(b"w", request, offset, len(data)), data)
        except OSError:
            self._lost()
            raise ChildGone from None
        lane.busy += 1
        future = self._loop.create_future()
        self._waiting[request] = future
        return future

    def _send(self, lane: Lane, head: bytes, data: bytes) -> None:
        if not lane.out:
            try:
                sent = lane.sock.sendmsg([head, data])
            except BlockingIOError:
                sent = 0
            if sent == len(head) + len(data):
                return
            assert self._loop is not None
            self._loop.add_writer(lane.sock.fileno(), self._writable, lane)
            lane.out += (head + data)[sent:]
        else:
            lane.out += head
            lane.out += data

    def _writable(self, lane: Lane) -> None:
        try:
            sent = lane.sock.send(lane.out)
        except BlockingIOError:
            return
        except OSError:
            self._lost()
            return
        del lane.out[:sent]
        if not lane.out and self._loop is not None:
            self._loop.remove_writer(lane.sock.fileno())

    def _readable(self, lane: Lane) -> None:
        try:
            data = lane.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._lost()
            return
        answers = lane.answers + data if lane.answers else data
        cut = len(answers) - len(answers) % 2
        lane.answers = answers[cut:]
        lane.busy -= cut // 2
        for at in range(0, cut, 2):
            future = self._waiting.pop(answers[at], None)
            code = answers[at + 1]
            if future is None or future.done():  # its commit was cancelled (a stop)
                continue
            if code:
                future.set_exception(OSError(code, os.strerror(code)))
            else:
                future.set_result(None)
        if self.answered is not None:  # the committer lands them now, not a pass later
            self.answered()

    def _lost(self) -> None:
        if self.gone:
            return
        log.warning("journal fsync helper (pid %d) is gone: syncing in a thread", self.proc.pid)
        self._close_sockets()
        self._fail_waiting()

    def _fail_waiting(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(ChildGone())

    def _close_sockets(self) -> None:
        self.gone = True
        for lane in self.lanes:
            if self._loop is not None:
                self._loop.remove_reader(lane.sock.fileno())
                self._loop.remove_writer(lane.sock.fileno())
            lane.out.clear()
            lane.sock.close()

    def close(self) -> None:
        """Tell the helper to exit (it reads the end of the sockets); `wait` for it after."""
        if not self.gone:
            self._close_sockets()
        self._fail_waiting()

    def wait(self) -> None:
        """Blocking: until the helper has exited (killed when it does not)."""
        _reap(self.proc)


def _busy(lane: Lane) -> int:
    return lane.busy


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(EXIT_TIMEOUT)
