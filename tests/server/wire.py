"""A raw-socket SBP peer for server tests: sends exact bytes, reads frames with a deadline."""

from __future__ import annotations

import socket
import time

from sbp_spark.protocol.frame import Frame, FrameDecoder, InvalidFrame
from sbp_spark.protocol.messages import decode_response, request_frame

EOF = "EOF"


class RawPeer:
    """One TCP connection speaking frames by hand. Frames not yet asked for are kept."""

    def __init__(self, address: tuple[str, int], timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.eof = False
        self.timeout = timeout
        self._next_id = 1

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, data) -> None:
        """Send bytes, or a list of buffers (as ``encode_frame`` returns)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = b"".join(bytes(b) for b in data)
        self.sock.sendall(data)

    def request(self, msg, payload=b"", stream_id: int | None = None) -> int:
        """Send a typed request; returns its stream_id."""
        if stream_id is None:
            stream_id = self._next_id
            self._next_id += 1
        self.send(request_frame(stream_id, msg, payload))
        return stream_id

    def _pump(self, deadline: float) -> bool:
        """Read once; False on EOF or when the deadline passed."""
        left = deadline - time.monotonic()
        if left <= 0 or self.eof:
            return False
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return False
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return False
        self.decoder.feed(data)
        for event in self.decoder.events():
            assert not isinstance(event, InvalidFrame), event
            self.frames.append(event)
        return True

    def next_frame(self, stream_id: int | None = None, timeout: float | None = None):
        """The next frame (for ``stream_id`` if given), or EOF, or None on timeout."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            for i, f in enumerate(self.frames):
                if stream_id is None or f.stream_id == stream_id:
                    return self.frames.pop(i)
            if not self._pump(deadline):
                return EOF if self.eof else None

    def response(self, stream_id: int, timeout: float | None = None) -> list[Frame]:
        """Every frame of one response sequence, up to and including END."""
        out = []
        while True:
            f = self.next_frame(stream_id, timeout)
            assert f not in (None, EOF), f"no END for stream {stream_id}, got {f!r} after {out}"
            out.append(f)
            if f.is_end:
                return out

    def call(self, msg, payload=b"", timeout: float | None = None):
        """Send ``msg`` and return (decoded header, payload bytes) of a one-frame answer."""
        sid = self.request(msg, payload)
        [frame] = self.response(sid, timeout)
        return decode_response(frame), bytes(frame.payload)

    def wait_eof(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while not self.eof and self._pump(deadline):
            pass
        return self.eof
