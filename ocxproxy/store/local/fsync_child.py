"""The journal's write helper: a tiny process that writes and fdatasyncs commits for the
proxy (syncer.py), so no write to the journal file blocks the proxy's event loop (a pwrite
into the page cache waited up to ~280 ms there while the disk was busy).

Run as `python -I -S fsync_child.py FD` with FD one end of a Unix socket pair; standard
library only, nothing of ocxproxy is imported. It says b"r" once ready, then loops: a
file descriptor (SCM_RIGHTS, sent with a lone b"f") replaces the file it writes; each
request, b"w", a one-byte id, the offset (8 bytes) and length (4 bytes) of its data, then
the data, is written there (pwrite), and then the file fdatasynced; it is answered by two
bytes, the id and 0 or the errno. Requests received together are written in order and
share one fdatasync, in the thread that received them while another thread waits for the
next (the proxy may have several commits in flight: concurrent syncs of one file do not
wait for each other's turn; no thread hands work to another, which cost a wake-up and a
GIL hand-over per sync). It exits when the proxy's end closes (the proxy stopped or
died), never on a signal sent to the proxy's process group: the proxy decides when it is
done.
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

THREADS = 8  # syncs at once (the proxy has at most a few commits in flight)
HEAD = struct.Struct(">cBQI")  # b"w", id, offset, length (syncer.py packs it)
RECEIVE = 1 << 18  # bytes read at once
INT = array.array("i").itemsize  # a file descriptor's size in SCM_RIGHTS data
FDS = socket.CMSG_SPACE(8 * INT)  # room for the file descriptors received at once
F = ord("f")


def serve(sock: socket.socket) -> None:
    receiving = threading.Lock()  # one thread waits in recv at a time
    answering = threading.Lock()
    held = [-1, 0]  # the file synced now, and whether the proxy's end closed (under receiving)
    pending = [b""]  # a partial request (under receiving)
    # Received into, again and again (under receiving): a new buffer of RECEIVE bytes for
    # each receive would cost the helper three more system calls (mmap, mremap, munmap).
    buffer = bytearray(RECEIVE)
    view = memoryview(buffer)

    def take() -> tuple[list[tuple[int, int, bytes]], int] | None:
        """The next whole requests received (id, offset, data) and a file to write them
        to, or None once the proxy's end is closed. Holds `receiving`."""
        while not held[1]:
            try:
                got, ancillary, _, _ = sock.recvmsg_into([buffer], FDS)
            except OSError:
                got, ancillary = 0, []
            for level, kind, fds in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    for new in array.array("i", fds[: len(fds) - len(fds) % INT]):
                        if held[0] >= 0:
                            os.close(held[0])
                        held[0] = new
            if not got:
                held[1] = 1
                return None
            data = pending[0] + view[:got] if pending[0] else view[:got].tobytes()
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
            pending[0] = data[at:]
            if requests:
                try:
                    return requests, os.dup(held[0])  # its own: the file may be replaced
                except OSError as exc:
                    answer(bytes(r[0] for r in requests), exc)
        return None

    def answer(requests: bytes, error: OSError | None) -> None:
        code = 0 if error is None else min(error.errno or errno.EIO, 255)
        with answering, contextlib.suppress(OSError):
            sock.sendall(bytes(b for request in requests for b in (request, code)))

    def work() -> None:
        # Leader and followers: the thread that received requests writes and syncs them,
        # while another waits for the next ones; one fdatasync answers every request
        # received together.
        while True:
            with receiving:
                taken = take()
            if taken is None:
                return
            requests, fd = taken
            error: OSError | None = None
            try:
                for _, offset, data in requests:
                    view = memoryview(data)
                    while view:
                        n = os.pwrite(fd, view, offset)
                        view, offset = view[n:], offset + n
                os.fdatasync(fd)
            except OSError as exc:
                error = exc
            finally:
                os.close(fd)
            answer(bytes(r[0] for r in requests), error)

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
