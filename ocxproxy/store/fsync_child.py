"""The journal's fsync helper: a tiny process that calls fdatasync for the proxy (syncer.py).

Run as `python -I -S fsync_child.py FD` with FD one end of a Unix socket pair; standard
library only, nothing of ocxproxy is imported. It says b"r" once ready, then loops: each
received file descriptor (SCM_RIGHTS) replaces the file it syncs; each request, b"s" and
a one-byte id, gets an fdatasync of that file in a thread of its own (the proxy may have
several commits in flight: concurrent syncs of one file do not wait for each other's
turn), answered by two bytes, the id and 0 or the errno. It exits when the proxy's end
closes (the proxy stopped or died), never on a signal sent to the proxy's process group:
the proxy decides when it is done.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

THREADS = 8  # syncs at once (the proxy has at most a few commits in flight)


def serve(sock: socket.socket) -> None:
    answer = threading.Lock()

    def sync(request: int, fd: int) -> None:
        try:
            os.fdatasync(fd)
            code = 0
        except OSError as exc:
            code = min(exc.errno or errno.EIO, 255)
        finally:
            os.close(fd)
        with answer, contextlib.suppress(OSError):
            sock.sendall(bytes((request, code)))

    fd = -1
    pending = b""
    sock.sendall(b"r")
    with ThreadPoolExecutor(THREADS) as pool:
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 4096, 8)
            if not data:
                return
            for new in fds:
                if fd >= 0:
                    os.close(fd)
                fd = new
            pending += data
            while len(pending) >= 2:
                request, pending = pending[1], pending[2:]
                try:
                    pool.submit(sync, request, os.dup(fd))  # its own: fd may be replaced
                except OSError as exc:
                    with answer:
                        sock.sendall(bytes((request, min(exc.errno or errno.EIO, 255))))


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    with sock, contextlib.suppress(OSError):  # OSError: the proxy's end is gone
        serve(sock)


if __name__ == "__main__":
    main()
