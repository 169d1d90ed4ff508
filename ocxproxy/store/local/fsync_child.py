"""The journal's write helper: a tiny process that writes and fdatasyncs commits for the
proxy (syncer.py), so no write to the journal file blocks the proxy's event loop (a pwrite
into the page cache waited up to ~280 ms there while the disk was busy).

Run as `python -I -S fsync_child.py FD...` with each FD one end of a Unix socket pair (a
lane); standard library only, nothing of ocxproxy is imported. It says b"r" down each
lane once ready. Each lane has a thread of its own, which loops: a file descriptor
(SCM_RIGHTS, sent with a lone b"f") replaces the file it writes; each request, b"w", a
one-byte id, the offset (8 bytes) and length (4 bytes) of its data, then the data, is
written there (pwrite), and then the file fdatasynced; it is answered down the same lane
by two bytes, the id and 0 or the errno. Requests received together are written in order
and share one fdatasync. The proxy sends a commit down a lane with nothing in flight, so
commits in flight at once are synced at once (concurrent syncs of one file do not wait
for each other's turn), and no thread wakes another (a hand-over costs a wake-up and a
GIL hand-over per sync). It exits when the proxy's ends close (the proxy stopped or died),
never on a signal sent to the proxy's process group: the proxy decides when it is done.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import signal
import socket
import struct
import sys
import threading

HEAD = struct.Struct(">cBQI")  # b"w", id, offset, length (syncer.py packs it)
RECEIVE = 1 << 18  # bytes read at once
INT = array.array("i").itemsize  # a file descriptor's size in SCM_RIGHTS data
FDS = socket.CMSG_SPACE(8 * INT)  # room for the file descriptors received at once
F = ord("f")


def lane(sock: socket.socket) -> None:
    """Serve one lane until the proxy's end of it closes."""
    held = -1  # the file written to now
    pending = b""  # a partial request
    # Received into, again and again: a new buffer of RECEIVE bytes for each receive
    # would cost three more system calls (mmap, mremap, munmap).
    buffer = bytearray(RECEIVE)
    view = memoryview(buffer)
    try:
        while True:
            try:
                got, ancillary, _, _ = sock.recvmsg_into([buffer], FDS)
            except OSError:
                got, ancillary = 0, []
            for level, kind, fds in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    for new in array.array("i", fds[: len(fds) - len(fds) % INT]):
                        if held >= 0:
                            os.close(held)
                        held = new
            if not got:
                return
            data = pending + view[:got] if pending else view[:got].tobytes()
            requests, at = [], 0
            while at < len(data):
                if data[at] == F:  # (its fd came with it)
                    at += 1
                    continue
                if len(data) - at < HEAD.size:
                    break
                _, request, offset, length = HEAD.unpack_from(data, at)
                end = at + HEAD.size + length
                if end > len(data):
                    break
                requests.append((request, offset, data[at + HEAD.size : end]))
                at = end
            pending = data[at:]
            if not requests:
                continue
            error: OSError | None = None
            try:
                for _, offset, chunk in requests:
                    written = memoryview(chunk)
                    while written:
                        n = os.pwrite(held, written, offset)
                        written, offset = written[n:], offset + n
                os.fdatasync(held)
            except OSError as exc:
                error = exc
            code = 0 if error is None else min(error.errno or errno.EIO, 255)
            with contextlib.suppress(OSError):
                sock.sendall(bytes(b for r in requests for b in (r[0], code)))
    finally:
        if held >= 0:
            os.close(held)


def serve(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.sendall(b"r")
    threads = [threading.Thread(target=lane, args=(s,), daemon=True) for s in socks[1:]]
    for thread in threads:
        thread.start()
    lane(socks[0])
    for thread in threads:
        thread.join()


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    socks = [socket.socket(fileno=int(fd)) for fd in sys.argv[1:]]
    with contextlib.suppress(OSError):  # OSError: the proxy's end is gone
        serve(socks)
    for sock in socks:
        sock.close()


if __name__ == "__main__":
    main()
