"""The journal's fsync helper: a tiny process that calls fdatasync for the proxy (syncer.py).

Run as `python -I -S fsync_child.py FD` with FD one end of a Unix socket pair; standard
library only, nothing of ocxproxy is imported. It says b"r" once ready, then loops: each
received file descriptor (SCM_RIGHTS) replaces the file it syncs; each request, b"s" and
a one-byte id, gets an fdatasync of that file, answered by two bytes, the id and 0 or the
errno. Requests received together share one fdatasync, in the thread that received them
while another thread waits for the next (the proxy may have several commits in flight:
concurrent syncs of one file do not wait for each other's turn; no thread hands work to
another, which cost a wake-up and a GIL hand-over per sync). It exits when the proxy's end
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

THREADS = 8  # syncs at once (the proxy has at most a few commits in flight)


def serve(sock: socket.socket) -> None:
    receiving = threading.Lock()  # one thread waits in recv at a time
    answering = threading.Lock()
    held = [-1, 0]  # the file synced now, and whether the proxy's end closed (under receiving)
    pending = [b""]  # a partial request (under receiving)

    def take() -> tuple[bytes, int] | None:
        """The next requests received (their ids) and a file to sync for them, or None
        once the proxy's end is closed. Holds `receiving`."""
        while not held[1]:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 4096, 8)
            except OSError:
                data, fds = b"", []
            for new in fds:
                if held[0] >= 0:
                    os.close(held[0])
                held[0] = new
            if not data:
                held[1] = 1
                return None
            data = pending[0] + data
            cut = len(data) - len(data) % 2
            pending[0] = data[cut:]
            if cut:
                try:
                    return data[1:cut:2], os.dup(held[0])  # its own: the file may be replaced
                except OSError as exc:
                    answer(data[1:cut:2], exc)
        return None

    def answer(requests: bytes, error: OSError | None) -> None:
        code = 0 if error is None else min(error.errno or errno.EIO, 255)
        with answering, contextlib.suppress(OSError):
            sock.sendall(bytes(b for request in requests for b in (request, code)))

    def work() -> None:
        # Leader and followers: the thread that received requests syncs for them, while
        # another waits for the next ones; one fdatasync answers every request received
        # together (each one's bytes were written before it was sent).
        while True:
            with receiving:
                taken = take()
            if taken is None:
                return
            requests, fd = taken
            error: OSError | None = None
            try:
                os.fdatasync(fd)
            except OSError as exc:
                error = exc
            finally:
                os.close(fd)
            answer(requests, error)

    sock.sendall(b"r")
    threads = [threading.Thread(target=work, daemon=True) for _ in range(THREADS - 1)]
    for thread in threads:
        thread.start()
    work()
    for thread in threads:
        thread.join()


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    with sock, contextlib.suppress(OSError):  # OSError: the proxy's end is gone
        serve(sock)


if __name__ == "__main__":
    main()
