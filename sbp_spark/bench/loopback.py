"""The raw loopback ceiling: plain TCP copies between the bench process and the server process.

No framing, no checksums, no protocol: the best any client can do between the same two processes
on this machine. The sending side calls ``sendall`` with 1 MiB buffers and the receiving side
``recv_into`` a reused buffer in 256 KiB pieces (the fastest pattern measured on loopback).

A request on a new connection is 9 bytes: ``b"W"``, ``b"R"`` or ``b"F"`` and a u64 byte count.
``W``: the client sends that many bytes and the server answers one byte once it has them all.
``R``: the server sends that many bytes.
``F``: a big-endian i32 follows, the fsync interval in ms (-1: never fsync; 0: fsync back to
back). The server appends that many bytes to a new file in its directory with 1 MiB ``pwritev``
calls while a second thread fsyncs the file at that interval (the way a range server's
group commit does), fsyncs once more at the end, deletes the file and answers the seconds it
took as a big-endian double: the storage ceiling of an APPEND acknowledged under the same
durability, in the server process.
``P``: the u64 is a count of round trips: that many times the client sends ``SMALL_BYTES``
bytes and the server answers one byte once it has them (the floor of one small request's round
trip between the two processes).
``S``: the u64 is a count: the server appends ``SMALL_BYTES`` bytes to a new file and fsyncs
it, that many times, and answers the median and 99th percentile time of one such durable
append as two big-endian doubles (the floor of a small APPEND acknowledged durably).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

SEND_CHUNK = 1024 * 1024
RECV_CHUNK = 256 * 1024
_REQUEST = struct.Struct(">cQ")
_SECONDS = struct.Struct(">d")
_INTERVAL = struct.Struct(">i")
_TWO_SECONDS = struct.Struct(">dd")
NO_FSYNC = -1
# The size of one small request (the latency figures' batch).
SMALL_BYTES = 1024


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        piece = sock.recv(n - len(out))
        if not piece:
            raise ConnectionError(f"loopback peer closed after {len(out)} of {n} bytes")
        out += piece
    return bytes(out)


def _drain(sock: socket.socket, total: int, buf: bytearray) -> None:
    view = memoryview(buf)
    left = total
    while left:
        n = sock.recv_into(view, min(left, len(buf)))
        if not n:
            raise ConnectionError(f"loopback peer closed with {left} of {total} bytes to go")
        left -= n


def _send(sock: socket.socket, total: int, chunk: bytes) -> None:
    view = memoryview(chunk)
    left = total
    while left:
        n = min(left, len(chunk))
        sock.sendall(view[:n])
        left -= n


def file_append_seconds(directory: str, total: int, chunk: bytes,
                        fsync_interval_ms: int = NO_FSYNC) -> float:
    """Seconds to append ``total`` bytes to a new file in ``directory``, one ``pwritev`` of
    ``chunk`` at a time, while a second thread fsyncs it every ``fsync_interval_ms``
    (``NO_FSYNC``: never; 0: back to back), then once more at the end; the file is removed.
    The storage ceiling of an APPEND acknowledged under the same durability."""
    fd, path = tempfile.mkstemp(prefix="bench-ceiling-", dir=directory)
    done = threading.Event()

    def sync_loop() -> None:
        while not done.wait(fsync_interval_ms / 1000):
            os.fsync(fd)

    syncer = threading.Thread(target=sync_loop, name="bench-ceiling-fsync", daemon=True)
    try:
        view = memoryview(chunk)
        start = time.perf_counter()
        if fsync_interval_ms != NO_FSYNC:
            syncer.start()
        pos = 0
        while pos < total:
            n = min(total - pos, len(chunk))
            pos += os.pwritev(fd, [view[:n]], pos)
        done.set()
        if fsync_interval_ms != NO_FSYNC:
            syncer.join()
            os.fsync(fd)
        return time.perf_counter() - start
    finally:
        done.set()
        if syncer.is_alive():
            syncer.join()
        os.close(fd)
        os.unlink(path)


def accept_process(argv_for_port: Callable[[int], list[str]],
                   timeout: float = 60.0) -> tuple[socket.socket, subprocess.Popen]:
    """Start the process ``argv_for_port(port)`` and accept its one connection to ``port``
    (a fresh listener on 127.0.0.1); the process is killed if it never connects."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        process = subprocess.Popen(argv_for_port(listener.getsockname()[1]))
        listener.settimeout(timeout)
        try:
            sock, _ = listener.accept()
        except BaseException:
            process.kill()
            process.wait()
            raise
    sock.settimeout(None)
    return sock, process


def durable_small_appends(directory: str, count: int) -> tuple[float, float]:
    """Median and 99th percentile seconds of appending ``SMALL_BYTES`` to a file in
    ``directory`` and fsyncing it, over ``count`` appends; the file is removed."""
    from .timing import percentile

    fd, path = tempfile.mkstemp(prefix="bench-fsync-", dir=directory)
    data = os.urandom(SMALL_BYTES)
    times = []
    try:
        for _ in range(count):
            start = time.perf_counter()
            os.write(fd, data)
            os.fsync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return percentile(times, 50), percentile(times, 99)


class LoopbackServer:
    """The server half; runs in the server process (threads, one per connection).

    ``directory`` is where the storage ceiling writes its scratch file (the cluster's disk).
    """

    def __init__(self, host: str = "127.0.0.1", directory: str | None = None) -> None:
        self._directory = directory or tempfile.gettempdir()
        self._sock = socket.create_server((host, 0))
        host, port = self._sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        # Random like the APPEND bench's batches: a repeating pattern would let a compressing
        # or deduplicating filesystem (btrfs, ZFS) write next to nothing and inflate the
        # storage ceiling.
        self._chunk = os.urandom(SEND_CHUNK)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="loopback-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray(RECV_CHUNK)
        with conn:
            try:
                while True:
                    head = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
                    if len(head) < _REQUEST.size:
                        return
                    op, total = _REQUEST.unpack(head)
                    if op == b"W":
                        _drain(conn, total, buf)
                        conn.sendall(b"k")
                    elif op == b"R":
                        _send(conn, total, self._chunk)
                    elif op == b"F":
                        (interval,) = _INTERVAL.unpack(_recv_exact(conn, _INTERVAL.size))
                        conn.sendall(_SECONDS.pack(file_append_seconds(self._directory, total,
                                                                self._chunk, interval)))
                    elif op == b"P":
                        for _ in range(total):
                            _recv_exact(conn, SMALL_BYTES)
                            conn.sendall(b"k")
                    elif op == b"S":
                        conn.sendall(_TWO_SECONDS.pack(
                            *durable_small_appends(self._directory, total)))
                    else:
                        return
            except OSError:
                return

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class LoopbackClient:
    """The client half: one connection to a ``LoopbackServer``."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._chunk = bytes(SEND_CHUNK)
        self._buf = bytearray(RECV_CHUNK)

    def send(self, total: int) -> float:
        """Seconds to push ``total`` bytes to the server (until it has them all)."""
        start = time.perf_counter()
        self._sock.sendall(_REQUEST.pack(b"W", total))
        _send(self._sock, total, self._chunk)
        if _recv_exact(self._sock, 1) != b"k":
            raise ConnectionError("loopback server answered a write with an unexpected byte")
        return time.perf_counter() - start

    def receive(self, total: int) -> float:
        """Seconds to pull ``total`` bytes from the server."""
        start = time.perf_counter()
        self._sock.sendall(_REQUEST.pack(b"R", total))
        _drain(self._sock, total, self._buf)
        return time.perf_counter() - start

    def file_append(self, total: int, fsync_interval_ms: int = NO_FSYNC) -> float:
        """Seconds the server process took to append ``total`` bytes to a file, fsyncing it
        every ``fsync_interval_ms`` (``NO_FSYNC``: page cache only) and once at the end."""
        self._sock.sendall(_REQUEST.pack(b"F", total) + _INTERVAL.pack(fsync_interval_ms))
        return _SECONDS.unpack(_recv_exact(self._sock, _SECONDS.size))[0]

    def round_trips(self, count: int) -> list[float]:
        """Seconds of each of ``count`` round trips of a ``SMALL_BYTES`` message and a one
        byte answer."""
        data = os.urandom(SMALL_BYTES)
        self._sock.sendall(_REQUEST.pack(b"P", count))
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self._sock.sendall(data)
            if _recv_exact(self._sock, 1) != b"k":
                raise ConnectionError("loopback server answered a round trip unexpectedly")
            times.append(time.perf_counter() - start)
        return times

    def durable_small_appends(self, count: int) -> tuple[float, float]:
        """Median and 99th percentile seconds of a ``SMALL_BYTES`` append fsynced in the server
        process (``count`` of them)."""
        self._sock.sendall(_REQUEST.pack(b"S", count))
        return _TWO_SECONDS.unpack(_recv_exact(self._sock, _TWO_SECONDS.size))

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> LoopbackClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
