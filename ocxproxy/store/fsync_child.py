"""The journal's fsync helper: a tiny process that calls fdatasync for the proxy (syncer.py).

Run as `python -I -S fsync_child.py FD` with FD one end of a Unix socket pair; standard
library only, nothing of ocxproxy is imported. It says b"r" once ready, then loops: each
received file descriptor (SCM_RIGHTS) replaces the file it syncs; each b"s" byte asks for
one fdatasync of it, answered by one byte, 0 or the errno. Requests that arrived together
share one fdatasync (every write they cover was made before they were sent). It exits
when the proxy's end closes (the proxy stopped or died), never on a signal sent to the
proxy's process group: the proxy decides when it is done.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys


def serve(sock: socket.socket) -> None:
    fd = -1
    sock.sendall(b"r")
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 4096, 8)
        if not data:
            return
        for new in fds:
            if fd >= 0:
                os.close(fd)
            fd = new
        asked = data.count(b"s")
        if not asked:
            continue
        try:
            os.fdatasync(fd)
            code = 0
        except OSError as exc:
            code = min(exc.errno or errno.EIO, 255)
        sock.sendall(bytes((code,)) * asked)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    with sock, contextlib.suppress(OSError):  # OSError: the proxy's end is gone
        serve(sock)


if __name__ == "__main__":
    main()
