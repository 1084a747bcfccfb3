"""Scripted loopback SBP servers for tests where a real server cannot misbehave on demand."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence

from sbp_spark.protocol.constants import Flags, Opcode
from sbp_spark.protocol.frame import Frame, FrameDecoder, InvalidFrame, encode_frame

RESPONSE_END = Flags.RESPONSE | Flags.END


class Peer:
    """The server side of one accepted connection, driven by a test's handler."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = FrameDecoder()
        self.send_lock = threading.Lock()

    def read_frame(self, timeout: float = 10.0, pings: bool = False) -> Frame | None:
        """The next request frame, or None when the client closed the connection. A PING is
        answered here, as every server's network core does, and not returned (``pings``:
        returned like any request, for handlers that script the answer to a PING too)."""
        while True:
            event = self.decoder.next_event()
            if event is not None:
                assert not isinstance(event, InvalidFrame), event.error
                if (not pings and event.opcode == Opcode.PING
                        and not event.flags & Flags.RESPONSE):
                    self.reply(event, bytes(event.header), bytes(event.payload))
                    continue
                return event
            try:
                self.sock.settimeout(timeout)
                data = self.sock.recv(1 << 20)
            except OSError:
                return None
            if not data:
                return None
            self.decoder.feed(data)

    def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        with self.send_lock:
            self.sock.sendall(b"".join(bytes(b) for b in buffers))

    def reply(self, request: Frame, header: bytes = b"", payload: bytes = b"",
              flags: int = RESPONSE_END, opcode: int | None = None) -> None:
        self.send(encode_frame(request.opcode if opcode is None else opcode, flags,
                               request.stream_id, header, payload))

    def goaway(self) -> None:
        self.send(encode_frame(Opcode.GOAWAY, 0, 0))

    def close(self) -> None:
        self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the client may have closed first
        self.sock.close()


class FakeServer:
    """Accepts connections on 127.0.0.1 (free port) and runs ``handler(peer)`` for each one."""

    def __init__(self, handler: Callable[[Peer], None]) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.peers: list[Peer] = []
        self.errors: list[BaseException] = []
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    @property
    def connections(self) -> int:
        return len(self.peers)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            peer = Peer(sock)
            self.peers.append(peer)
            thread = threading.Thread(target=self._run, args=(peer,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self, peer: Peer) -> None:
        try:
            self.handler(peer)
        except BaseException as exc:  # kept in .errors so a broken script fails its test
            if not self._closing:  # sockets closed under a handler at the end are expected
                self.errors.append(exc)
        finally:
            peer.close()

    def close(self) -> None:
        self._closing = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass  # not connected-state on some platforms; close() below still stops it
        self.listener.close()
        for peer in list(self.peers):
            peer.close()
        for thread in self._threads:
            thread.join(5)
        self._accepter.join(5)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def echo_handler(peer: Peer) -> None:
    """Answers every request with one RESPONSE|END frame echoing its header and payload."""
    while (frame := peer.read_frame()) is not None:
        peer.reply(frame, bytes(frame.header), bytes(frame.payload))
