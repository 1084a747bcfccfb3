"""A delay line for TCP: the slow link of ``Network.shape`` (the kernel here has no netem).

Runs inside a node's namespace. An nftables rule there redirects the node's new TCP connections
to chosen peers to this proxy; it reads where each was going (``SO_ORIGINAL_DST``), connects
there itself (its own connections carry a firewall mark, so they are not redirected again), and
relays both directions through a model of a slow link:

* every byte arrives ``--one-way-ms`` after it was sent (half the added round trip);
* with ``--rate-mbit``, bytes leave at most at that rate, per direction, shared by every
  connection through the proxy (one link, not one per connection): a byte starts crossing once
  the link has sent the ones before it, and arrives a serialisation time plus the delay later;
* at most ``--window-bytes`` per connection and direction are unacknowledged: sent, and not
  yet both delivered and acknowledged (an acknowledgement takes the one-way delay to come
  back, so a byte holds its place for a whole round trip, as in TCP's window). Beyond that
  the proxy stops reading, so TCP pushes back on the sender as a full window would. The
  default, 4 MiB, is about what Linux's receive-buffer autotuning allows a connection: at
  most window / round trip per connection (84 MB/s at +50 ms).

Both sides of the proxy are local and fast, so what the peers see is the modelled link. The
proxy writes its listening port to ``--ready-file`` once it accepts connections.

    python -m integration.netlab.delay --one-way-ms 25 --rate-mbit 100 --ready-file F
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import threading
import time
from collections import deque
from pathlib import Path

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
RECEIVE_BYTES = 64 * 1024
# With a rate cap, bytes are scheduled in pieces this large: 16 KiB cross a 100 Mbit/s link
# in 1.3 ms, fine enough that a reply does not wait behind a whole receive buffer.
PACED_PIECE = 16 * 1024
DEFAULT_WINDOW_BYTES = 4 * 1024 * 1024


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (host, port)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    (port,) = struct.unpack_from("!H", raw, 2)
    return socket.inet_ntoa(raw[4:8]), port


class Wire:
    """One direction of the modelled link, shared by every connection that crosses it: when
    each piece of bytes handed to it arrives at the far end."""

    def __init__(self, one_way_s: float, rate_bps: float | None) -> None:
        self.one_way_s = one_way_s
        self.rate_bps = rate_bps
        self._free = 0.0  # when the link has sent everything scheduled so far
        self._lock = threading.Lock()

    def schedule(self, data: bytes, now: float) -> list[tuple[float, bytes]]:
        """(arrival time, piece) for ``data`` handed to the link at ``now``."""
        if not self.rate_bps:
            return [(now + self.one_way_s, data)]
        out = []
        with self._lock:
            for pos in range(0, len(data), PACED_PIECE):
                piece = data[pos:pos + PACED_PIECE]
                sent = max(now, self._free) + len(piece) * 8 / self.rate_bps
                self._free = sent
                out.append((sent + self.one_way_s, piece))
        return out


class Line:
    """One direction of one connection: bytes read from ``src`` are written to ``dst`` when
    the modelled link (``wire``) delivers them."""

    def __init__(self, src: socket.socket, dst: socket.socket, wire: Wire, window: int,
                 on_close) -> None:
        self.src, self.dst = src, dst
        self.wire = wire
        self.window = window
        self.on_close = on_close
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0  # bytes read and not acknowledged yet (the window in use)
        # (when the acknowledgement arrives, bytes) of what was delivered, in order
        self.acks: deque[tuple[float, int]] = deque()
        self.eof = False
        self.dead = False
        self.cond = threading.Condition()

    def start(self) -> None:
        for target in (self._read, self._write):
            threading.Thread(target=target, daemon=True).start()

    def stop(self) -> None:
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(RECEIVE_BYTES)
                with self.cond:
                    if not data:
                        self.eof = True
                        self.cond.notify_all()
                        return
                    self.queue.extend(self.wire.schedule(data, time.monotonic()))
                    self.queued += len(data)
                    self.cond.notify_all()
                    while not self.dead and self._window_full():
                        wait = self.acks[0][0] - time.monotonic() if self.acks else None
                        self.cond.wait(wait)
                    if self.dead:
                        return
        except OSError:
            self.on_close()

    def _window_full(self) -> bool:
        """Whether the window is in use up to its size, once acknowledgements due by now
        have freed their bytes (call holding ``cond``)."""
        now = time.monotonic()
        while self.acks and self.acks[0][0] <= now:
            self.queued -= self.acks.popleft()[1]
        return self.queued >= self.window

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.eof and not self.dead:
                        self.cond.wait()
                    if self.dead:
                        return
                    if not self.queue:  # the sender closed and everything was delivered
                        self.dst.shutdown(socket.SHUT_WR)
                        return
                    due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(data)
                with self.cond:
                    self.queue.popleft()
                    self.acks.append((time.monotonic() + self.wire.one_way_s, len(data)))
                    self.cond.notify_all()
        except OSError:
            self.on_close()


def relay(client: socket.socket, mark: int, outbound: Wire, inbound: Wire, window: int
          ) -> None:
    """Connect ``client`` to where it was going, through two ``Line``s: what it sends crosses
    ``outbound``, what it receives ``inbound``."""
    try:
        target = original_destination(client)
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        upstream.connect(target)
    except OSError:
        client.close()
        return
    for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    closed = threading.Event()
    lines: list[Line] = []

    def close_both() -> None:
        if closed.is_set():
            return
        closed.set()
        for line in lines:
            line.stop()
        for sock in (client, upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the peer went first

    lines.append(Line(client, upstream, outbound, window, close_both))
    lines.append(Line(upstream, client, inbound, window, close_both))
    for line in lines:
        line.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one-way-ms", type=float, required=True)
    parser.add_argument("--rate-mbit", type=float, default=None)
    parser.add_argument("--window-bytes", type=int, default=DEFAULT_WINDOW_BYTES)
    parser.add_argument("--mark", type=int, required=True)
    parser.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.one_way_ms < 0 or (args.rate_mbit is not None and args.rate_mbit <= 0) \
            or args.window_bytes < RECEIVE_BYTES:
        parser.error(f"--one-way-ms must be >= 0, --rate-mbit > 0, --window-bytes >= "
                     f"{RECEIVE_BYTES}")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(128)
    tmp = args.ready_file.with_name(f".{args.ready_file.name}.{os.getpid()}")
    tmp.write_text(f"{listener.getsockname()[1]}\n")
    os.replace(tmp, args.ready_file)
    rate = args.rate_mbit * 1e6 if args.rate_mbit else None
    outbound = Wire(args.one_way_ms / 1000.0, rate)
    inbound = Wire(args.one_way_ms / 1000.0, rate)
    while True:
        client, _ = listener.accept()
        relay(client, args.mark, outbound, inbound, args.window_bytes)


if __name__ == "__main__":
    raise SystemExit(main())
