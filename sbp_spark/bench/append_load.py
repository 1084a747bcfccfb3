"""A closed-loop APPEND load on one range server, and the CPU time a process spent.

``AppendLoad`` plays many independent writers with as little client work as possible, so the
figures are the server's: every stream keeps one APPEND of one batch in flight, and its next
APPEND leaves as soon as the answer arrives. The frames are built once (the same batch, stream
and request id every time) and one thread drives every connection with ``select``; streams
are spread over the connections round robin.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sbp_spark.client.connection import parse_address
from sbp_spark.protocol.frame import Frame, FrameDecoder
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    decode_response,
    request_frame,
)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# How long the end of a run waits for the answers still in flight.
DRAIN_TIMEOUT_S = 30.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far (Linux, /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    # After the command name: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


@dataclass
class LoadResult:
    """What one run of the load did: acknowledgements, failures, the time it took."""

    acks: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def acks_per_s(self) -> float:
        return self.acks / self.seconds if self.seconds else 0.0


class _Conn:
    """One connection of the load: its socket, decoder and the request frame of each slot."""

    def __init__(self, address: str, frames: dict[int, bytes]) -> None:
        self.sock = socket.create_connection(parse_address(address), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self.decoder = FrameDecoder()
        self.frames = frames  # request id -> the whole frame that request id always sends

    def send(self, request_ids: Sequence[int]) -> None:
        self.sock.sendall(b"".join(self.frames[rid] for rid in request_ids))

    def close(self) -> None:
        self.sock.close()


class AppendLoad:
    """Closed-loop writers: one APPEND of ``batch`` in flight per stream of ``stream_ids``,
    over ``connections`` connections to the range server at ``address`` (which must be the
    primary of each stream's open range)."""

    def __init__(self, address: str, stream_ids: Sequence[int], batch: bytes,
                 connections: int = 1, timeout_ms: int = 30_000) -> None:
        if not stream_ids:
            raise ValueError("AppendLoad needs at least one stream")
        if connections < 1:
            raise ValueError(f"connections={connections} must be >= 1")
        per_conn: list[dict[int, bytes]] = [{} for _ in range(min(connections, len(stream_ids)))]
        for i, sid in enumerate(stream_ids):
            frames = per_conn[i % len(per_conn)]
            rid = len(frames) + 1
            request = AppendRequest(timeout_ms=timeout_ms,
                                    append_requests=[AppendEntry(sid, 0, len(batch))])
            frames[rid] = b"".join(bytes(b) for b in request_frame(rid, request, [batch]))
        self._conns = [_Conn(address, frames) for frames in per_conn]

    def close(self) -> None:
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> AppendLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, seconds: float) -> LoadResult:
        """Offer the load for ``seconds``, then wait for the answers in flight."""
        result = LoadResult()
        selector = selectors.DefaultSelector()
        for conn in self._conns:
            selector.register(conn.sock, selectors.EVENT_READ, conn)
        start = time.perf_counter()
        stop_at = start + seconds
        outstanding = 0
        for conn in self._conns:
            conn.send(list(conn.frames))
            outstanding += len(conn.frames)
        try:
            while outstanding:
                now = time.perf_counter()
                sending = now < stop_at
                if not sending and now > stop_at + DRAIN_TIMEOUT_S:
                    result.errors.append(f"{outstanding} answers missing {DRAIN_TIMEOUT_S} s "
                                         f"after the load stopped")
                    break
                for key, _ in selector.select(timeout=0.5):
                    answered = self._receive(key.data, result)
                    outstanding -= len(answered)
                    if sending and answered:
                        key.data.send(answered)
                        outstanding += len(answered)
        finally:
            selector.close()
        result.seconds = min(time.perf_counter(), stop_at) - start
        return result

    @staticmethod
    def _receive(conn: _Conn, result: LoadResult) -> list[int]:
        """Read what ``conn`` has; the request ids answered."""
        buf = conn.decoder.get_buffer()
        n = conn.sock.recv_into(buf)
        if n == 0:
            raise ConnectionError("the range server closed a load connection")
        conn.decoder.buffer_updated(n)
        answered = []
        while (frame := conn.decoder.next_event()) is not None:
            rid = frame.stream_id
            msg = decode_response(frame) if isinstance(frame, Frame) else frame.error
            problem = None
            if not isinstance(msg, AppendResponse):
                problem = f"answered {msg!r}"
            elif not msg.status.ok:
                problem = msg.status.message
            elif not msg.append_responses or not msg.append_responses[0].status.ok:
                problem = msg.append_responses[0].status.message if msg.append_responses \
                    else "no result"
            if problem is None:
                result.acks += 1
            elif len(result.errors) < 10:
                result.errors.append(problem)
            answered.append(rid)
        return answered
