"""Socket calls shared by the client's connections and the server's network core."""

from __future__ import annotations

import math
import os
import socket
import struct
from collections.abc import Sequence
from typing import Protocol

Buffer = bytes | bytearray | memoryview


class MessageSocket(Protocol):
    """What ``send_buffers`` needs of a socket: a plain one or a ``TlsSocket``."""

    def sendmsg(self, buffers: Sequence[Buffer], /) -> int: ...


def _iov_max() -> int:
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        value = -1
    # sendmsg refuses more buffers than IOV_MAX in one call; 16 is the POSIX minimum.
    return value if value > 0 else 16


IOV_MAX = _iov_max()


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def send_buffers(sock: MessageSocket, buffers: Sequence[Buffer]) -> None:
    """Write every buffer with ``sendmsg``, at most ``IOV_MAX`` at a time, resuming after
    partial sends, without joining them (no copy)."""
    bufs = [b for b in buffers if _nbytes(b)]
    i, count = 0, len(bufs)
    while i < count:
        sent = sock.sendmsg(bufs[i:i + IOV_MAX])
        # Skip the buffers sent whole; keep the unsent tail of a partly sent one.
        while sent:
            size = _nbytes(bufs[i])
            if sent >= size:
                sent -= size
                i += 1
            else:
                bufs[i] = memoryview(bufs[i]).cast("B")[sent:]
                sent = 0


def _timeval(seconds: float) -> bytes:
    if not math.isfinite(seconds):
        return struct.pack("@ll", 0, 0)  # no limit
    seconds = max(seconds, 1e-6)  # 0 would mean no limit
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))


def set_kernel_timeouts(sock: socket.socket, receive_s: float, send_s: float) -> None:
    """Make ``sock`` blocking, with its waits bounded by the kernel (SO_RCVTIMEO and
    SO_SNDTIMEO) instead of Python's socket timeout, which polls before every call: that poll
    cost about 7% of the reader's CPU on a FETCH stream. A wait that runs out raises
    ``BlockingIOError``; a send that made some progress returns what it sent."""
    sock.settimeout(None)
    set_receive_timeout(sock, receive_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_s))


def set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound a blocking receive on ``sock`` to ``seconds`` (SO_RCVTIMEO, see
    ``set_kernel_timeouts``)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
