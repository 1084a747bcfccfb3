"""TCP proxies between a client and a real server, for failures a network causes: forward both
ways, and let a subclass decide what each chunk from either side becomes."""

from __future__ import annotations

import contextlib
import socket
import threading

from sbp_spark.client import SbpClient
from sbp_spark.protocol.constants import Opcode


class ForwardingProxy:
    """Listens on 127.0.0.1 and forwards every connection to ``target`` both ways. Subclasses
    override ``forward``; ``close`` stops it and closes what it holds."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.pairs: list[int] = []  # one entry per connection accepted, its number
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def forward(self, pair: int, answers: bool, data: bytes) -> bytes | None:
        """What is passed on of ``data`` (from the server when ``answers``) on connection
        number ``pair``: b"" drops it, None drops it and ends the connection. All by default."""
        return data

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            pair = len(self.pairs)
            self.pairs.append(pair)
            self._sockets += [client, server]
            for src, dst, answers in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pipe, args=(src, dst, pair, answers),
                                 daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, pair: int, answers: bool) -> None:
        with contextlib.suppress(OSError):  # the other direction closed the pair first
            while data := src.recv(1 << 16):
                passed = self.forward(pair, answers, data)
                if passed is None:
                    break
                dst.sendall(passed)
        for s in (src, dst):
            with contextlib.suppress(OSError):  # already closed
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()
        for sock in self._sockets:
            sock.close()


def _opcode_at(data: bytes) -> int | None:
    """The opcode of the frame ``data`` starts with (None if too short to tell)."""
    return int.from_bytes(data[5:7], "big") if len(data) >= 7 else None


class AnswerLosingProxy(ForwardingProxy):
    """Once armed, the next answer from the server is swallowed and that connection closed:
    the server carried the request out, the client never hears of it. Answers to PING (which
    the PD client may send before a request) are passed on: the request's answer is lost."""

    def __init__(self, target: str) -> None:
        self.armed = threading.Event()
        self.lost = threading.Event()
        super().__init__(target)

    def forward(self, pair: int, answers: bool, data: bytes) -> bytes | None:
        if answers and self.armed.is_set() and _opcode_at(data) != Opcode.PING:
            self.armed.clear()
            self.lost.set()
            return None
        return data


class SilencingProxy(ForwardingProxy):
    """``silence()`` makes the connections open so far drop everything while staying open, as
    a network that lost them would; new connections work."""

    def __init__(self, target: str) -> None:
        self.silenced: set[int] = set()
        super().__init__(target)

    def silence(self) -> None:
        self.silenced.update(self.pairs)

    def forward(self, pair: int, answers: bool, data: bytes) -> bytes | None:
        return b"" if pair in self.silenced else data


class ProxiedClient(SbpClient):
    """Talks to one range server through a proxy (the PD still names its real address)."""

    proxy: ForwardingProxy
    proxy_for: str

    def range_server(self, address: str):
        return super().range_server(self.proxy.address if address == self.proxy_for
                                    else address)


class DeafeningProxy(ForwardingProxy):
    """``deafen()`` makes every connection, open or opened later, drop what the server sends
    while passing on what the client sends: a link broken in one direction, as when only the
    server's answers to this client are lost. The server stores what it is sent."""

    def __init__(self, target: str) -> None:
        self.deaf = threading.Event()
        super().__init__(target)

    def deafen(self) -> None:
        self.deaf.set()

    def forward(self, pair: int, answers: bool, data: bytes) -> bytes | None:
        return b"" if answers and self.deaf.is_set() else data
