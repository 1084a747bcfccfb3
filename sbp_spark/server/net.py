"""Threaded TCP server core shared by the placement driver and the range server.

Blocking sockets and threads: ``recv_into``, ``sendmsg`` and ``os.sendfile`` release the GIL, and
an asyncio version of this core measured no faster. One thread accepts; each connection
gets one reader thread that feeds a :class:`~sbp_spark.protocol.frame.FrameDecoder` straight from
the socket and dispatches every request frame to a :class:`RequestHandler`.

Using it::

    class Echo(RequestHandler):
        role = "echo server"
        routes = {Opcode.DESCRIBE_RANGES: Route(DescribeRangesRequest, "_describe")}

        def handle(self, ctx: RequestContext) -> None:
            request_cls, serve = self.route(ctx)
            serve(ctx, request_cls.from_flatbuffers(ctx.header))

        def _describe(self, ctx, request) -> None:
            ctx.reply(DescribeRangesResponse(...))

    with FrameServer(Echo(), NetConfig(port=0)) as server:
        print(server.address_str)           # "127.0.0.1:40123"

Request life cycle:

* A request is *in flight* from the moment its frame is decoded until a frame with END is sent
  on its stream_id (``ctx.reply(..., end=True)``, ``ctx.system_error(...)``, or any
  ``ctx.send`` of a frame whose flags carry END). While a connection has
  ``max_inflight_per_connection`` requests in flight its reader stops reading (backpressure:
  the peer's sends block in TCP). Likewise, while the whole server holds more than
  ``max_inflight_bytes`` of request frames (in flight or partly received), readers wait at
  frame boundaries.
* ``handle`` runs inline on the reader thread for quick opcodes, on the bounded worker pool for
  ``long_opcodes`` (long polls, calls to other servers) so the reader keeps reading, and for
  ``ordered_opcodes`` on the connection's own handler thread, one request after the other in
  arrival order: the reader then receives (and checksums) the next frame while the handler
  thread stores and answers the previous one.
* If ``handle`` returns without ending the request, the core answers SYSTEM_ERROR UNKNOWN,
  unless the handler called ``ctx.defer()``: then the request stays in flight until some
  thread ends it later (e.g. an append acknowledged after the next fsync).
* An exception from ``handle`` becomes SYSTEM_ERROR UNKNOWN naming it; the server never dies.
  A ``ServerError`` (e.g. ``InvalidRequestError("...")``) becomes SYSTEM_ERROR with its code.

A handler's ``routes`` is its role's one dispatch table: for each opcode it serves, the request
table, the method serving it and where that runs (``Runs``). ``opcodes``, ``long_opcodes`` and
``ordered_opcodes`` are derived from it (a handler without routes sets them itself).

The core itself answers PING (echo with RESPONSE|END), treats a peer's GOAWAY as "no more
requests" (finish, then close), answers a known opcode this role does not serve with
SYSTEM_ERROR INVALID_REQUEST naming the role and the opcodes it serves (a peer that asks the
wrong server hears so at once instead of waiting out its timeout), discards unknown opcodes and
response frames, answers frames that are intact but invalid (docs/wire.md, Bad frames) with
SYSTEM_ERROR, and closes the connection when framing is lost. ``stop()`` is graceful: GOAWAY to
every peer, no new connections, in-flight requests get a bounded time to finish. Idle
connections are closed with a GOAWAY.

Authentication (ours, docs/wire.md "Who may do what"): a server given an ``Authenticator``
starts every connection unauthenticated. Under mutual TLS a verified client certificate
authenticates it at the handshake; otherwise the core itself serves AUTHENTICATE (a signed
token), answers every other request but PING with UNAUTHENTICATED until one succeeds, and
closes a connection that has not authenticated within the authenticator's timeout. The
principal is ``Connection.principal`` (``RequestContext.principal``); what it may do is the
handler's authorizer's to say (``RequestHandler.authorize``). A server without an
authenticator is open: its connections start authenticated as nobody (principal None).

Each connection's state (authenticating, open, draining after a GOAWAY either way, closed), its
requests in flight and the PING and GOAWAY rules are a ``protocol.session.Session``, the table
the client's connections drive as well; ``Connection`` feeds it events and carries out the
actions it returns.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import errno
import functools
import itertools
import logging
import os
import select
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any, ClassVar, NamedTuple

from ..protocol import messages
from ..protocol.buffers import ReceiveBuffers
from ..protocol.constants import (
    KNOWN_OPCODES,
    MAX_FRAME_LENGTH,
    MAX_INFLIGHT_PER_CONNECTION,
    Flags,
    Opcode,
    opcode_name,
)
from ..protocol.errors import (
    ChecksumError,
    ErrorCode,
    FrameError,
    HeaderError,
    ServerError,
    TransportError,
)
from ..protocol.frame import (
    Frame,
    FrameDecoder,
    InvalidFrame,
    checksum_trailer,
    encode_frame,
    frame_prefix,
)
from ..protocol.session import Action, ConnectionState, Session, goaway_frame, pong_frame
from ..transport.sockets import send_buffers
from ..transport.tls import DEFAULT_HANDSHAKE_TIMEOUT_S, ServingContext, TlsConfig, TlsSocket
from .advertise import format_address
from .auth.authenticator import Authenticator
from .auth.authorizer import Authorizer
from .auth.principals import Principal
from .auth.rules import Need
from .conditions import WaitedCondition

log = logging.getLogger(__name__)

_U32 = struct.Struct(">I")
_END = int(Flags.END)

Buffer = bytes | bytearray | memoryview

# Reads go into the decoder's buffer in pieces of at most this size. A frame's body is read
# straight into its own buffer, so a larger piece only means fewer calls for large frames:
# 1 MiB APPENDs went 4-6% faster with 1 MiB pieces than with 256 KiB ones (alternating runs).
RECV_PIECE = 1024 * 1024
# The largest answer ``Connection.try_send`` sends without a thread that may wait.
_TRY_SEND_BYTES = 16 * 1024
# Each connection costs a reader thread and its buffers; beyond this we refuse new peers rather
# than let one noisy client starve the process of threads and memory.
DEFAULT_MAX_CONNECTIONS = 1024
# Large frames' bodies each reader keeps for reuse (bytes): a fresh buffer per frame costs a
# memset and page faults. Enough for a few 16 MiB APPEND frames, or many smaller ones.
DEFAULT_RECYCLE_BYTES = 48 * 1024 * 1024
# Request bytes a connection's reader may hand to its ordered handler thread ahead of what that
# thread has served; past it the reader waits and the rest stays in the socket's buffer. Large
# frames are received into recycled buffers, and a reader far ahead cycles through many of
# them: a 1 MiB APPEND stream kept 30+ buffers busy and received into memory last touched 30 MiB
# before, about 300 us a MiB slower than into a few buffers reused at once.
DEFAULT_MAX_ORDERED_AHEAD_BYTES = 8 * 1024 * 1024
# Requests a single connection may have in flight before its reader stops reading. Bounds the
# work (and payload memory: up to this many 16 MiB frames) one client can queue on the server.
DEFAULT_MAX_INFLIGHT = MAX_INFLIGHT_PER_CONNECTION
# Bytes that threads may hold waiting to send on one connection. A slow reader then blocks the
# senders instead of making the server buffer unbounded responses for it.
DEFAULT_MAX_OUTGOING_BYTES = 64 * 1024 * 1024
# Request bytes the whole server holds at once: frames received but not yet answered, and
# frames being received. A reader at a frame boundary waits while the total is above this, so
# memory stays bounded by this plus one frame per connection, however many clients write.
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024 * 1024
# Longest wait for that budget before a reader reads anyway (a slow long-running request must
# not starve every other client forever).
_BUDGET_WAIT_S = 5.0
# Threads for long requests (long-poll fetches, calls to other servers). Long polls hold a thread
# while they wait, so this must exceed the number of concurrent long polls we want to serve.
DEFAULT_WORKER_THREADS = 128
# Connections with nothing in flight and no traffic for this long get a GOAWAY and are closed.
DEFAULT_IDLE_TIMEOUT_S = 300.0
# A peer that accepts no bytes for this long while we send to it is considered dead.
DEFAULT_SEND_TIMEOUT_S = 30.0
# stop() waits this long for in-flight requests to finish before closing connections.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


@dataclass
class NetConfig:
    """Listening address and limits of one :class:`FrameServer`."""

    host: str = "127.0.0.1"
    port: int = 0
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_inflight_per_connection: int = DEFAULT_MAX_INFLIGHT
    max_outgoing_bytes_per_connection: int = DEFAULT_MAX_OUTGOING_BYTES
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    max_ordered_ahead_bytes: int = DEFAULT_MAX_ORDERED_AHEAD_BYTES
    worker_threads: int = DEFAULT_WORKER_THREADS
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    max_frame_length: int = MAX_FRAME_LENGTH
    name: str = "sbp"
    # Bytes of received frame bodies each connection keeps to receive later frames into.
    recycle_bytes_per_connection: int = DEFAULT_RECYCLE_BYTES
    # TLS on this port (certificate and key; with a CA file, peers must present a certificate
    # signed by it: mutual TLS). None: plain TCP.
    tls: TlsConfig | None = None
    # Longest a new peer's TLS handshake may take, all of it (a peer that sends nothing, or a
    # byte now and then, holds a reader thread and a connection slot until then).
    tls_handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S

    def __post_init__(self) -> None:
        positive = {
            "max_connections": self.max_connections,
            "max_inflight_per_connection": self.max_inflight_per_connection,
            "max_outgoing_bytes_per_connection": self.max_outgoing_bytes_per_connection,
            "max_inflight_bytes": self.max_inflight_bytes,
            "max_ordered_ahead_bytes": self.max_ordered_ahead_bytes,
            "worker_threads": self.worker_threads,
            "send_timeout_s": self.send_timeout_s,
            "tls_handshake_timeout_s": self.tls_handshake_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"NetConfig.{name}={value!r} must be > 0")
        if self.idle_timeout_s is not None and self.idle_timeout_s <= 0:
            raise ValueError(
                f"NetConfig.idle_timeout_s={self.idle_timeout_s!r} must be > 0 or None (never)")
        if self.recycle_bytes_per_connection < 0:
            raise ValueError(f"NetConfig.recycle_bytes_per_connection="
                             f"{self.recycle_bytes_per_connection!r} must be >= 0")
        if self.shutdown_timeout_s < 0:
            raise ValueError(
                f"NetConfig.shutdown_timeout_s={self.shutdown_timeout_s!r} must be >= 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"NetConfig.port={self.port!r} must be in [0, 65535]")


class FileRegion(NamedTuple):
    """``length`` bytes of the open file ``fd`` at ``offset``, sent with ``os.sendfile``."""

    fd: int
    offset: int
    length: int


class ConnectionClosed(TransportError):
    """The connection closed before a response could be sent."""


@dataclass
class NetStats:
    """Counters of one server (approximate under concurrency; for metrics only)."""

    connections_accepted: int = 0
    connections_refused: int = 0
    requests: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    invalid_frames: int = 0
    handler_errors: int = 0
    tls_failures: int = 0  # handshakes that failed (no or bad certificate, not TLS...)
    per_opcode: dict[int, int] = field(default_factory=dict)


class Runs(enum.Enum):
    """Where a request's handler runs."""

    READER = "reader"  # inline on the connection's reader thread: quick requests
    POOL = "pool"  # the bounded worker pool: long polls, calls to other servers, fsyncs
    ORDERED = "ordered"  # the connection's own handler thread, one request after the other


class Route(NamedTuple):
    """How a role serves one opcode: the request table, the name of the handler method that
    serves it, and where that runs. ``inline_bytes`` (``Runs.ORDERED`` only): frames up to
    this size run on the reader itself when the handler thread has nothing left to serve (for
    requests that are quick and never wait long: no hand-off between threads)."""

    request: type[messages.Message]
    method: str
    runs: Runs = Runs.READER
    inline_bytes: int = 0


# Opcodes a role answers whether or not it serves them: GOAWAY is a notice, never answered.
_ANSWERED_OPCODES = KNOWN_OPCODES - {Opcode.GOAWAY}


_LISTEN_HINTS = {errno.EADDRINUSE: "another process listens there",
                 errno.EADDRNOTAVAIL: "not an address of this machine",
                 errno.EACCES: "a port below 1024 needs privileges"}


def _listen_error(exc: OSError, host: str, port: int) -> OSError:
    """``exc`` of a failed bind or listen, naming the address (the same errno, so callers
    can still tell a port in use)."""
    hint = _LISTEN_HINTS.get(exc.errno or 0, "")
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return type(exc)(exc.errno, f"cannot listen on {where}: {exc.strerror}"
                     f"{f' ({hint})' if hint else ''}")


class RequestHandler(abc.ABC):
    """What a server does with requests. Subclass and declare ``routes`` (or set ``opcodes``,
    ``long_opcodes`` and ``ordered_opcodes`` directly)."""

    #: Who answers, as refusals name it ("placement driver", "range server").
    role: ClassVar[str] = "server"
    #: The role's dispatch table: opcode -> Route. Declaring it sets the three sets below.
    routes: ClassVar[dict[int, Route]] = {}
    #: Opcodes this handler serves. Another known opcode is refused with a status naming this
    #: role and what it serves; unknown opcodes are discarded (the seed says so).
    opcodes: frozenset[int] = frozenset()
    #: Subset of ``opcodes`` that run on the worker pool instead of the reader thread.
    long_opcodes: frozenset[int] = frozenset()
    #: Subset of ``opcodes`` that run, in arrival order, on one handler thread per connection
    #: (so the reader keeps receiving while a request is served).
    ordered_opcodes: frozenset[int] = frozenset()
    #: Ordered opcodes whose frames up to this many bytes the reader may serve itself.
    inline_bytes: ClassVar[dict[int, int]] = {}
    #: Who may have what served (set by the owner when its server authenticates); None: every
    #: request is served, as on a server without principals.
    authorizer: Authorizer | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        routes = cls.__dict__.get("routes")
        if routes is not None:
            cls.opcodes = frozenset(routes)
            cls.long_opcodes = frozenset(op for op, r in routes.items() if r.runs is Runs.POOL)
            cls.ordered_opcodes = frozenset(
                op for op, r in routes.items() if r.runs is Runs.ORDERED)
            cls.inline_bytes = {op: r.inline_bytes for op, r in routes.items()
                                if r.runs is Runs.ORDERED and r.inline_bytes}

    def route(self, ctx: RequestContext) -> tuple[type[messages.Message], Any]:
        """The request table of ``ctx``'s opcode and the bound method serving it."""
        return self._dispatch[ctx.opcode]

    @functools.cached_property
    def _dispatch(self) -> dict[int, tuple[type[messages.Message], Any]]:
        # Bound once per handler; tests replace an entry to hold a request.
        return {op: (r.request, getattr(self, r.method)) for op, r in self.routes.items()}

    def authorize(self, ctx: RequestContext, request: messages.Message) -> None:
        """Ask the authorizer, once per request, whether ``ctx``'s principal may have
        ``request`` served; ``PermissionDeniedError`` when not (answered by the core)."""
        authorizer = self.authorizer
        if authorizer is not None:
            ctx._access = (authorizer, authorizer.authorize(ctx.conn.principal, ctx.opcode,
                                                            request))

    def not_served(self, opcode: int) -> str:
        """Why this role refuses a known ``opcode``: its name, and what the role serves."""
        served = ", ".join(opcode_name(op) for op in sorted(
            self.opcodes | {Opcode.PING, Opcode.AUTHENTICATE}))
        return (f"this {self.role} does not serve {opcode_name(opcode)} ({opcode:#06x}); it "
                f"serves {served}")

    @abc.abstractmethod
    def handle(self, ctx: RequestContext) -> None:
        """Serve ``ctx.frame``; answer through ``ctx``."""

    def server_stopping(self) -> None:  # noqa: B027 - an optional hook
        """Called once when ``stop()`` begins: wake long polls so they finish early."""

    def connection_closed(self, conn: Connection) -> None:  # noqa: B027 - an optional hook
        """Called once per connection after it closed."""

    def peer_goaway(self, conn: Connection) -> None:  # noqa: B027 - an optional hook
        """Called on the reader thread when the peer sent GOAWAY on ``conn``: after every
        request it sent before (the reader serves them first, or has handed them on)."""


class Connection:
    """One accepted peer: a socket, its send lock and its in-flight accounting."""

    _ids = itertools.count(1)

    def __init__(self, server: FrameServer, sock: socket.socket, peer: tuple) -> None:
        self.server = server
        self.sock: socket.socket | TlsSocket = sock
        self.peer = peer
        self.id = next(self._ids)
        self.config = server.config
        # Who the peer speaks for, once authenticated; None on a server that does not
        # authenticate (every peer may do everything) and until the peer authenticated.
        self.principal: Principal | None = None
        self.accepted_at = time.monotonic()
        self._send_lock = threading.Lock()
        self._state = WaitedCondition()  # guards the fields below
        # The connection's state and the peer's requests in flight, not yet answered (only
        # these keep their frames, and so their memory, alive): protocol/session.py. This
        # class carries out what the session's transitions ask for (``_carry_out``).
        self._session: Session = Session(authenticating=server.authenticator is not None)
        self._session.last_active = time.monotonic()
        self._outgoing = 0
        self._send_started: float | None = None  # for the stuck-send watchdog
        # A GOAWAY the session asked for and not written yet, and the close that waits for it
        # (its reason): the last answer in flight may end the connection before the thread
        # that sent the GOAWAY got to write it, and the peer saw the connection end unsaid.
        self._goaway_pending = False
        self._close_deferred: str | None = None
        self.reader: threading.Thread | None = None
        # Requests for the ordered handler thread (started on first use); None ends it.
        self._ordered: SimpleQueue[tuple[RequestContext, Callable] | None] = SimpleQueue()
        self._ordered_thread: threading.Thread | None = None
        # Requests given to that thread (counted by the reader) and served by it (counted by
        # it): equal when it has nothing left, and the reader may serve the next one itself.
        self._ordered_given = 0
        self._ordered_served = 0
        # Bytes of the requests given to it and not yet served (guarded by ``_state``).
        self._ordered_bytes = 0

    def __repr__(self) -> str:
        return f"<Connection {self.id} {self.peer_str}>"

    @property
    def peer_str(self) -> str:
        return f"{self.peer[0]}:{self.peer[1]}" if len(self.peer) >= 2 else str(self.peer)

    @property
    def closed(self) -> bool:
        return self._session.closed

    @property
    def draining(self) -> bool:
        """No new requests are read (the peer's GOAWAY, or this server's); those in flight
        are still answered."""
        return self._session.state is ConnectionState.DRAINING

    @property
    def inflight(self) -> int:
        return len(self._session.received)

    @property
    def last_activity(self) -> float:
        """When anything last went either way (a ``time.monotonic()`` value)."""
        return self._session.last_active

    # -- sending ---------------------------------------------------------------------------

    def send(self, parts: Sequence[Buffer | FileRegion]) -> None:
        """Send one or more whole frames' bytes atomically (no interleaving with other senders).

        ``parts`` may mix buffers and :class:`FileRegion` items. Raises ``ConnectionClosed``.
        """
        size = sum(p.length if isinstance(p, FileRegion) else memoryview(p).nbytes
                   for p in parts)
        limit = self.config.max_outgoing_bytes_per_connection
        with self._state:
            while self._outgoing and self._outgoing + size > limit and not self.closed:
                self._state.wait(0.5)
            if self.closed:
                raise ConnectionClosed(f"connection to {self.peer_str} is closed")
            self._outgoing += size
        try:
            with self._send_lock:
                self._send_started = time.monotonic()
                try:
                    self._write(parts, size)
                finally:
                    self._send_started = None
        finally:
            with self._state:
                self._outgoing -= size
                self._state.notify_all()

    def try_send(self, parts: Sequence[Buffer]) -> bool:
        """Send one small frame now if that cannot block: no other sender holds or waits for
        the socket, and the socket has room. False, having sent nothing, when it could block
        (then ``send`` it from a thread that may wait). Raises ``ConnectionClosed``."""
        size = sum(memoryview(p).nbytes for p in parts)
        if self.closed:
            raise ConnectionClosed(f"connection to {self.peer_str} is closed")
        if size > _TRY_SEND_BYTES or self._outgoing or not self._send_lock.acquire(False):
            return False
        try:
            if self.closed:
                raise ConnectionClosed(f"connection to {self.peer_str} is closed")
            if isinstance(self.sock, TlsSocket):  # it encrypts and sends whole: ask first
                if not _writable(self.sock):
                    return False
                self._write(parts, size)
            elif not self._write_now(parts, size):
                return False
        finally:
            self._send_lock.release()
        return True

    def _write_now(self, parts: Sequence[Buffer], size: int) -> bool:
        """Send a small frame with one non-blocking ``sendmsg`` holding the send lock: False,
        having sent nothing, when the socket has no room (one system call, where asking
        ``poll`` first took two). The rest of a frame the socket took only part of is sent
        blocking: a frame is never left half sent."""
        sock = self.sock
        assert isinstance(sock, socket.socket)
        try:
            sent = sock.sendmsg(parts, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            self._abort(f"send failed: {exc}")
            raise ConnectionClosed(f"send to {self.peer_str} failed: {exc}") from exc
        self._session.last_active = time.monotonic()
        self.server.stats.bytes_out += sent
        if sent < size:
            self._send_started = time.monotonic()
            try:
                self._write([memoryview(b"".join(parts))[sent:]], size - sent)
            finally:
                self._send_started = None
        return True

    def _write(self, parts: Sequence[Buffer | FileRegion], size: int) -> None:
        """Send ``parts`` (``size`` bytes) holding the send lock; a failure closes the
        connection (``ConnectionClosed``)."""
        if self.closed:
            raise ConnectionClosed(f"connection to {self.peer_str} is closed")
        try:
            self._send_parts(parts)
        except OSError as exc:
            self._abort(f"send failed: {exc}")
            raise ConnectionClosed(f"send to {self.peer_str} failed: {exc}") from exc
        self._session.last_active = time.monotonic()
        self.server.stats.bytes_out += size

    def _send_parts(self, parts: Sequence[Buffer | FileRegion]) -> None:
        iov: list[Buffer] = []
        for part in parts:
            if isinstance(part, FileRegion):
                if iov:
                    send_buffers(self.sock, iov)
                    iov = []
                self._sendfile_all(part)
            else:
                iov.append(part)
        if iov:
            send_buffers(self.sock, iov)

    def _sendfile_all(self, region: FileRegion) -> None:
        if isinstance(self.sock, TlsSocket):  # the kernel cannot encrypt: read, encrypt here
            self.sock.sendfile_region(region.fd, region.offset, region.length)
            return
        out = self.sock.fileno()
        offset, remaining = region.offset, region.length
        while remaining:
            sent = os.sendfile(out, region.fd, offset, remaining)
            if sent == 0:
                raise OSError(f"file ended {remaining} bytes before the region's end")
            offset += sent
            remaining -= sent

    def send_goaway(self, reason: str = "") -> None:
        """Tell the peer to send no new requests here (once per connection): the connection
        reads no more requests, and closes once those in flight are answered."""
        with self._state:
            actions = self._session.send_goaway()
            if Action.SEND_GOAWAY in actions:
                self._goaway_pending = True
            self._state.notify_all()
        self._carry_out(actions, reason)

    def _write_goaway(self, reason: str) -> None:
        """Send a GOAWAY, best effort: skipped when another sender holds the socket for long
        (a peer that does not read); a GOAWAY that only partly fits the socket buffer is
        finished with a blocking send (guarded by the send timeout), since half a frame would
        break the framing."""
        data = b"".join(goaway_frame(reason))
        if not self._send_lock.acquire(timeout=0.5):
            return
        try:
            # The session may say closed already (CLOSE comes next), so ask the socket: the
            # reader closes it, holding the send lock, once it stopped.
            if self.sock.fileno() < 0:
                return
            sent = self.sock.send(data, socket.MSG_DONTWAIT)
            if sent < len(data):
                self._send_started = time.monotonic()
                self.sock.sendall(data[sent:])
        except BlockingIOError:
            log.debug("GOAWAY to %s not sent: its socket buffer is full", self.peer_str)
        except OSError as exc:
            log.debug("GOAWAY to %s not sent: %s", self.peer_str, exc)
        finally:
            self._send_started = None
            self._send_lock.release()

    def _carry_out(self, actions: Sequence[Action], reason: str = "") -> None:
        """Do what the session's transitions asked for, in order (outside the lock). FAIL_ALL
        is the reader's, when it stops (``FrameServer._reader_finished``): a handler thread
        may still be serving those requests until then."""
        for action in actions:
            if action is Action.SEND_GOAWAY:
                self._write_goaway(reason)
                with self._state:
                    self._goaway_pending = False
                    deferred, self._close_deferred = self._close_deferred, None
                if deferred is not None:
                    self._shut_down(deferred)
            elif action is Action.CLOSE:
                why = reason or str(self._session.error or "") or "nothing left in flight"
                with self._state:
                    if self._goaway_pending:  # the GOAWAY goes out first, then this
                        self._close_deferred = why
                        continue
                self._shut_down(why)

    def _shut_down(self, why: str) -> None:
        log.debug("closing %r: %s", self, why)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    # -- authentication --------------------------------------------------------------------

    @property
    def authenticating(self) -> bool:
        """Only PING and AUTHENTICATE are served until the peer authenticates."""
        return self._session.authenticating

    def _authenticated(self, principal: Principal) -> None:
        with self._state:
            self.principal = principal
            self._session.authenticated()

    def _auth_timed_out(self) -> None:
        """The peer did not authenticate in time: GOAWAY and close (if it still has not)."""
        with self._state:
            actions = self._session.auth_timed_out()
            self._state.notify_all()
        self._carry_out(actions, "not authenticated in time")

    # -- in-flight accounting --------------------------------------------------------------

    def _begin_request(self, ctx: RequestContext, exempt: bool = False) -> Action | None:
        """Count ``ctx`` in flight: None when it is to be served; REFUSE when the connection
        is closed (not taken); DENY when it is taken, to be answered UNAUTHENTICATED.
        ``exempt``: PING and AUTHENTICATE, served before authentication too."""
        with self._state:
            return self._session.admit(ctx, exempt)

    def _end_request(self, ctx: RequestContext) -> None:
        with self._state:
            actions = self._session.finished(ctx)
            self._state.notify_all()
        if actions:
            self._carry_out(actions)

    def _abandon_unfinished(self) -> None:
        """FAIL_ALL: the requests still in flight on a closed connection are given up."""
        with self._state:
            _, unfinished = self._session.drop_all()
        for ctx in unfinished:
            assert isinstance(ctx, RequestContext)
            ctx._abandon()

    def _wait_below_inflight_limit(self) -> None:
        limit = self.config.max_inflight_per_connection
        received = self._session.received
        if len(received) < limit:  # the common case, without the lock: only this reader
            return                 # adds requests, so the count can only have gone down
        with self._state:
            while len(received) >= limit and not self.closed:
                self._state.wait(0.5)

    def wait_idle(self, deadline: float) -> bool:
        """Wait until nothing is in flight (True) or ``deadline`` (monotonic) passes (False)."""
        with self._state:
            while self._session.received and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._state.wait(min(left, 0.5))
            return True

    # -- the ordered handler thread --------------------------------------------------------

    def _run_ordered(self, ctx: RequestContext, fn: Callable[[RequestContext], None],
                     inline_bytes: int = 0) -> None:
        """Run ``fn(ctx)`` after every ordered request before it: right here on the reader when
        the handler thread has served all it was given and the frame is at most
        ``inline_bytes`` (no hand-off between threads: what a writer waiting for each answer
        needs), else on the connection's handler thread (started on first use), so the
        reader receives the next frame meanwhile."""
        if ctx._nbytes <= inline_bytes and self._ordered_given == self._ordered_served:
            self.server._run(ctx, fn)
            return
        if self._ordered_thread is None:
            t = threading.Thread(target=self._ordered_loop,
                                 name=f"{self.config.name}-conn{self.id}-handler", daemon=True)
            self._ordered_thread = t
            t.start()
        self._hand_to_ordered_thread(ctx._nbytes)
        self._ordered.put((ctx, fn))

    def _hand_to_ordered_thread(self, nbytes: int) -> None:
        """Count a request of ``nbytes`` given to the handler thread, once it has less than
        ``max_ordered_ahead_bytes`` waiting (the reader waits until then: backpressure)."""
        limit = self.config.max_ordered_ahead_bytes
        with self._state:
            while self._ordered_bytes >= limit and not self.closed:
                self._state.wait(0.5)
            self._ordered_bytes += nbytes
        self._ordered_given += 1

    def _ordered_loop(self) -> None:
        server = self.server
        while (item := self._ordered.get()) is not None:
            ctx, fn = item
            if self.closed:
                ctx._abandon()
            else:
                server._run(ctx, fn)
            with self._state:
                self._ordered_bytes -= ctx._nbytes
                self._state.notify_all()  # a reader held at the limit (free when none waits)
            self._ordered_served += 1

    def _stop_ordered(self, timeout: float) -> None:
        """End the handler thread once it served (or dropped) what was queued."""
        t = self._ordered_thread
        if t is None:
            return
        self._ordered.put(None)
        if t is not threading.current_thread():
            t.join(timeout)

    # -- closing ---------------------------------------------------------------------------

    def _abort(self, reason: str) -> None:
        """Fail the connection: closed, and the socket shut down (wakes the reader and every
        blocked sender)."""
        with self._state:
            actions = self._session.fail(ConnectionClosed(reason))
            self._state.notify_all()
        self._carry_out(actions, reason)

    def close(self, reason: str = "closed by server", goaway: bool = True) -> None:
        """Close the connection (GOAWAY first unless told not to)."""
        if goaway:
            self.send_goaway(reason)
        self._abort(reason)


class RequestContext:
    """One request being served: its frame, and the ways to answer it."""

    __slots__ = ("frame", "conn", "_done", "_deferred", "_lock", "_nbytes", "_access")

    def __init__(self, frame: Frame, conn: Connection) -> None:
        self.frame = frame
        self.conn = conn
        self._nbytes = len(frame.header) + len(frame.payload)
        self._done = False
        self._deferred = False
        self._lock = threading.Lock()
        # The authorizer and what the request needed when it let it through
        # (``RequestHandler.authorize``), for ``check_access`` during long waits (needs, not
        # the request: it may hold the frame's buffer); None when nothing was checked.
        self._access: tuple[Authorizer, list[Need]] | None = None

    def check_access(self) -> None:
        """Ask again whether the principal may still have this request served (a long poll
        calls it as it waits): ``PermissionDeniedError`` once a permission it needed was
        revoked meanwhile."""
        access = self._access
        if access is not None:
            authorizer, needs = access
            authorizer.recheck(self.conn.principal, self.opcode, needs)

    def release_frame(self) -> None:
        """Let go of the frame's header and payload once the request no longer reads them (its
        answer needs only the frame's ids): the buffer they were received into can then take
        the connection's next large frame while this request waits, e.g. for an fsync."""
        f = self.frame
        self.frame = Frame(f.opcode, f.flags, f.stream_id, b"", b"", f.header_format,
                           f.payload_crc)

    @property
    def opcode(self) -> int:
        return self.frame.opcode

    @property
    def principal(self) -> Principal | None:
        """Who the request comes from (None on a server that does not authenticate)."""
        return self.conn.principal

    @property
    def stream_id(self) -> int:
        return self.frame.stream_id

    @property
    def header(self) -> Buffer:
        return self.frame.header

    @property
    def payload(self) -> Buffer:
        return self.frame.payload

    @property
    def done(self) -> bool:
        """True once the END frame was sent (or the connection closed)."""
        return self._done or self.conn.closed

    @property
    def server(self) -> FrameServer:
        return self.conn.server

    @property
    def stopping(self) -> bool:
        """True once the connection closed or the server began to stop (end long waits)."""
        return self.conn.closed or self.conn.server.stopping

    def defer(self) -> None:
        """Keep the request in flight after ``handle`` returns; some thread ends it later."""
        self._deferred = True

    def send(self, parts: Sequence[Buffer | FileRegion]) -> None:
        """Send one encoded response frame (e.g. ``messages.response_frame(...)``).

        The frame's own flags tell whether it ends the request.
        """
        end = _frame_flags(parts) & _END
        if self.conn.closed:
            raise ConnectionClosed(f"connection to {self.conn.peer_str} is closed")
        if self._done:
            raise RuntimeError(f"request {self.stream_id} was already answered with END")
        # A small answer with the socket free leaves in one non-blocking call (most answers);
        # anything else queues for the socket with the per-connection byte bound.
        buffers = [p for p in parts if not isinstance(p, FileRegion)]
        if len(buffers) < len(parts) or not self.conn.try_send(buffers):
            self.conn.send(parts)
        if end:
            self._finish()

    def try_reply(self, msg: messages.Message) -> bool:
        """Answer with ``msg`` (a one-frame response with no payload) if that cannot block;
        False, having sent nothing, otherwise (see ``Connection.try_send``)."""
        if self.conn.closed:  # first: a closed connection's requests were abandoned (done)
            raise ConnectionClosed(f"connection to {self.conn.peer_str} is closed")
        if self._done:
            raise RuntimeError(f"request {self.stream_id} was already answered with END")
        if not self.conn.try_send(messages.response_frame(self.stream_id, msg)):
            return False
        self._finish()
        return True

    def reply(self, msg: messages.Message, payload: Buffer | Sequence[Buffer] = b"",
              end: bool = True) -> None:
        """Answer with a typed response header (a ``messages`` response class)."""
        self.send(messages.response_frame(self.stream_id, msg, payload, end=end))

    def reply_raw(self, header: Buffer, payload: Buffer | Sequence[Buffer] = b"",
                  end: bool = True) -> None:
        """Answer with an already serialized header."""
        flags = Flags.RESPONSE | (Flags.END if end else 0)
        self.send(encode_frame(self.opcode, flags, self.stream_id, header, payload))

    def send_with_regions(self, header: Buffer, parts: Sequence[Buffer | FileRegion],
                          payload_crc: int, end: bool = True) -> None:
        """Answer with a frame whose payload mixes buffers and file regions (sent by sendfile).

        The caller gives the payload's CRC-32 (the core never reads file regions itself).
        """
        length = sum(p.length if isinstance(p, FileRegion) else memoryview(p).nbytes
                     for p in parts)
        flags = Flags.RESPONSE | (Flags.END if end else 0)
        prefix = frame_prefix(self.opcode, flags, self.stream_id,
                              memoryview(header).nbytes, length)
        out: list[Buffer | FileRegion] = [prefix, header, *parts,
                                          checksum_trailer(payload_crc if length else 0)]
        self.send(out)

    def system_error(self, code: int, message: str = "", detail: bytes = b"") -> None:
        """End the request with a SYSTEM_ERROR frame carrying ``code`` and ``message``."""
        status = messages.Status(code=int(code), message=message, detail=detail)
        self.send(messages.system_error_frame(self.stream_id, self.opcode, status))

    def _finish(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self.conn._end_request(self)
        self.conn.server._release_bytes(self._nbytes)

    def _abandon(self) -> None:
        """The connection died: stop counting this request as in flight."""
        self._finish()


def _writable(sock: socket.socket | TlsSocket) -> bool:
    """Whether ``sock`` has room to send: at least a third of its send buffer (a small frame
    fits). poll, not select: a server holds more than select's 1,024 descriptors."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    return bool(poller.poll(0))


def _frame_flags(parts: Sequence[Buffer | FileRegion]) -> int:
    first = parts[0] if parts else b""
    if isinstance(first, FileRegion) or memoryview(first).nbytes < 8:
        raise ValueError("a response must start with the frame's 16-byte prefix")
    return memoryview(first).cast("B")[7]


class FrameServer:
    """A TCP server speaking SBP frames to a :class:`RequestHandler`."""

    def __init__(self, handler: RequestHandler, config: NetConfig | None = None,
                 authenticator: Authenticator | None = None) -> None:
        self.handler = handler
        self.config = config or NetConfig()
        # Checks credentials; None: the server is open (nobody authenticates).
        self.authenticator = authenticator
        self.stats = NetStats()
        self._listener: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._connections: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.config.worker_threads,
                                        thread_name_prefix=f"{self.config.name}-worker")
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        # Set when config.tls is (made by start()): the context for each new connection,
        # following renewals of the certificate files.
        self._tls: ServingContext | None = None
        self._inflight_bytes = 0
        self._budget = WaitedCondition()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FrameServer:
        """Bind, listen and start the accept and housekeeping threads."""
        if self._listener is not None:
            raise RuntimeError("server already started")
        if self.config.tls is not None:  # bad certificate files fail here, not per peer
            self._tls = ServingContext(self.config.tls, self.config.name)
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.config.host, self.config.port))
            listener.listen(min(socket.SOMAXCONN, 1024))
        except OSError as exc:
            listener.close()
            raise _listen_error(exc, self.config.host, self.config.port) from exc
        # accept() wakes at least this often to notice stop().
        listener.settimeout(0.2)
        self._listener = listener
        self._address = listener.getsockname()[:2]
        for target, name in ((self._accept_loop, "accept"), (self._housekeeping, "housekeeping")):
            t = threading.Thread(target=target, name=f"{self.config.name}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("%s listening on %s", self.config.name, self.address_str)
        return self

    def __enter__(self) -> FrameServer:
        if self._listener is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the real port when started with port 0."""
        if self._address is None:
            raise RuntimeError("server not started")
        return self._address

    @property
    def address_str(self) -> str:
        return format_address(*self.address)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def connection_count(self) -> int:
        with self._lock:
            return len(self._connections)

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._connections.values())

    def submit(self, fn, *args) -> bool:
        """Run ``fn(*args)`` on the worker pool (e.g. to answer a deferred request).

        Returns False when the server has stopped and the task was dropped."""
        try:
            self._pool.submit(self._guarded, fn, args)
        except RuntimeError:  # the pool shut down: the connections are gone too
            log.debug("server stopped; dropped task %r", fn)
            return False
        return True

    @staticmethod
    def _guarded(fn, args) -> None:
        try:
            fn(*args)
        except ConnectionClosed as exc:
            log.debug("worker task ended: %s", exc)
        except Exception:
            log.exception("worker task %r failed", fn)

    def stop(self, timeout: float | None = None) -> None:
        """Graceful shutdown: GOAWAY everyone, refuse new work, let in-flight work finish."""
        if self._stopping.is_set():
            self._stopped.wait(timeout if timeout is not None else None)
            return
        self._stopping.set()
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        try:
            self.handler.server_stopping()
        except Exception:
            log.exception("handler.server_stopping failed")
        listener = self._listener
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        conns = self.connections()
        for conn in conns:
            conn.send_goaway("server shutting down")
        deadline = time.monotonic() + timeout
        for conn in conns:
            if not conn.wait_idle(deadline):
                log.warning("%r still had %d requests in flight at shutdown", conn, conn.inflight)
        for conn in conns:
            conn.close("server stopped", goaway=False)
        for conn in conns:
            reader = conn.reader
            # A connection accepted while stopping may not have started its reader yet.
            if (reader is not None and reader.ident is not None
                    and reader is not threading.current_thread()):
                reader.join(max(0.0, deadline - time.monotonic()) + 1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(1.0)
        self._stopped.set()
        if self._address is not None:
            log.info("%s on %s stopped", self.config.name, self.address_str)

    # -- threads ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stopping.is_set():
                    log.error("accept failed on %s: %s", self.address_str, exc)
                    time.sleep(0.05)  # e.g. EMFILE: back off instead of spinning
                continue
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(self, sock, peer)
            with self._lock:
                too_many = len(self._connections) >= self.config.max_connections
                if not too_many and not self._stopping.is_set():
                    self._connections[conn.id] = conn
            if too_many or self._stopping.is_set():
                self.stats.connections_refused += 1
                log.warning("refusing %s: %d connections open (max_connections)",
                            conn.peer_str, self.config.max_connections)
                conn.close("connection limit reached")
                sock.close()
                continue
            self.stats.connections_accepted += 1
            t = threading.Thread(target=self._read_loop, args=(conn,),
                                 name=f"{self.config.name}-conn{conn.id}", daemon=True)
            conn.reader = t
            t.start()

    def _housekeeping(self) -> None:
        idle = self.config.idle_timeout_s
        interval = min(1.0, idle / 4) if idle else 1.0
        if self.authenticator is not None:
            interval = min(interval, self.authenticator.timeout_s / 4)
        while not self._stopping.wait(interval):
            now = time.monotonic()
            for conn in self.connections():
                started = conn._send_started
                if started is not None and now - started > self.config.send_timeout_s:
                    log.warning("%r accepted no bytes for %.0f s: closing", conn,
                                now - started)
                    conn.close("send timeout", goaway=False)
                elif idle and conn.inflight == 0 and now - conn.last_activity > idle:
                    log.debug("%r idle for %.0f s: closing", conn, now - conn.last_activity)
                    conn.close("idle timeout")
                elif (self.authenticator is not None and conn.authenticating
                      and now - conn.accepted_at > self.authenticator.timeout_s):
                    log.info("%s: %s did not authenticate within %g s: closing",
                             self.config.name, conn.peer_str, self.authenticator.timeout_s)
                    conn._auth_timed_out()

    def _start_tls(self, conn: Connection, context: ssl.SSLContext) -> bool:
        """TLS handshake with a new peer (on its reader thread, so a slow one holds up no one
        else); False when it failed and the connection is to be dropped."""
        assert isinstance(conn.sock, socket.socket), "TLS starts once, over the TCP socket"
        tls = TlsSocket(conn.sock, context, server_side=True)
        try:
            tls.handshake(self.config.tls_handshake_timeout_s)
        except OSError as exc:  # TlsError, ssl.SSLError, timeout, reset
            self.stats.tls_failures += 1
            log.info("%s: TLS handshake with %s failed: %s", self.config.name, conn.peer_str,
                     exc)
            return False
        with conn._send_lock:
            conn.sock = tls
        if self.authenticator is not None:
            principal = self.authenticator.of_certificate(tls.getpeercert())
            if principal is not None:  # the certificate says who it is: no AUTHENTICATE
                conn._authenticated(principal)
        return True

    def _read_loop(self, conn: Connection) -> None:
        decoder = FrameDecoder(self.config.max_frame_length,
                               allocate=ReceiveBuffers(self.config.recycle_bytes_per_connection))
        receiving = 0  # bytes of a partly received frame, charged to the server's budget
        expected = 0  # its whole size, when its length prefix came at the start of a read
        try:
            if self._tls is not None and not self._start_tls(conn, self._tls.current()):
                return
            sock = conn.sock
            while True:
                conn._wait_below_inflight_limit()
                if receiving == 0:
                    self._wait_for_budget(conn)
                if not conn._session.reading:
                    break
                buf = decoder.get_buffer()
                try:
                    n = sock.recv_into(buf, min(buf.nbytes, RECV_PIECE))
                except OSError as exc:
                    if not conn.closed:
                        log.debug("%r receive failed: %s", conn, exc)
                    break
                if n == 0:
                    break
                if receiving == 0 and n >= 4:
                    # A frame starts here: charge all of it now, since the decoder allocates
                    # its whole body as soon as it sees the length.
                    expected = 4 + _U32.unpack_from(buf, 0)[0]
                conn._session.heard(time.monotonic())
                self.stats.bytes_in += n
                try:
                    decoder.buffer_updated(n)
                except FrameError as exc:
                    log.warning("%r sent an unreadable frame, closing: %s", conn, exc)
                    break
                # Decoded frames are charged by their contexts; what is still partial here.
                partial = decoder.buffered
                self._dispatch_decoded(conn, decoder)
                if partial == 0:
                    expected = 0
                charge = max(partial, expected) if partial else 0
                self._charge_bytes(charge - receiving)
                receiving = charge
            if conn.draining:
                conn.wait_idle(time.monotonic() + self.config.shutdown_timeout_s)
        except Exception:
            log.exception("%r reader failed", conn)
        finally:
            self._charge_bytes(-receiving)
            self._reader_finished(conn)

    def _dispatch_decoded(self, conn: Connection, decoder: FrameDecoder) -> None:
        """Dispatch every frame the decoder holds (one read may bring many), each once the
        connection is below its in-flight limit; stop early when it closes or drains."""
        while (event := decoder.next_event()) is not None:
            conn._wait_below_inflight_limit()
            if conn.closed:
                return
            self._dispatch(conn, event)
            if not conn._session.reading:
                return

    def _reader_finished(self, conn: Connection) -> None:
        """The connection's reader stopped: close it, drop what is still queued for its
        handler thread, abandon unanswered requests and tell the handler."""
        conn._abort("reader finished")
        with conn._send_lock:
            with contextlib.suppress(OSError):
                conn.sock.close()
        conn._stop_ordered(self.config.shutdown_timeout_s)
        conn._abandon_unfinished()
        with self._lock:
            self._connections.pop(conn.id, None)
        try:
            self.handler.connection_closed(conn)
        except Exception:
            log.exception("handler.connection_closed failed")

    # -- dispatch --------------------------------------------------------------------------

    def _dispatch(self, conn: Connection, event: Frame | InvalidFrame) -> None:
        if isinstance(event, InvalidFrame):
            self.stats.invalid_frames += 1
            if event.flags & Flags.RESPONSE or event.opcode not in _ANSWERED_OPCODES:
                log.debug("%r: dropped invalid frame %s", conn, event)
                return
            code = (ErrorCode.CHECKSUM_MISMATCH if isinstance(event.error, ChecksumError)
                    else ErrorCode.INVALID_REQUEST)
            ctx = self._new_context(conn, Frame(event.opcode, event.flags, event.stream_id))
            self._answer_error(ctx, code, str(event.error))
            return
        frame = event
        if frame.is_response:  # an int test (``int & Flags.X`` runs enum's Python code)
            log.debug("%r: ignored response frame opcode=%#06x stream_id=%d", conn,
                      frame.opcode, frame.stream_id)
            return
        opcode = frame.opcode
        if opcode == Opcode.PING or opcode == Opcode.AUTHENTICATE:
            self._serve_exempt(conn, frame)
            return
        if opcode == Opcode.GOAWAY:
            log.debug("%r: peer sent GOAWAY", conn)
            with conn._state:
                actions = conn._session.goaway_received()
                conn._state.notify_all()
            conn._carry_out(actions, "the peer sent GOAWAY")
            try:
                self.handler.peer_goaway(conn)
            except Exception:
                log.exception("handler.peer_goaway failed")
            return
        if opcode not in self.handler.opcodes:
            if opcode in KNOWN_OPCODES:
                self._answer_error(self._new_context(conn, frame), ErrorCode.INVALID_REQUEST,
                                   self.handler.not_served(opcode))
            else:
                log.debug("%r: discarded frame with unknown opcode %#06x", conn, opcode)
            return
        self.stats.requests += 1
        self.stats.per_opcode[opcode] = self.stats.per_opcode.get(opcode, 0) + 1
        ctx = self._new_context(conn, frame)
        if ctx._done:  # denied (not authenticated) or the connection closed
            return
        if self._stopping.is_set():
            self._answer_error(ctx, ErrorCode.SHUTTING_DOWN, "server is shutting down")
        elif opcode in self.handler.long_opcodes:
            try:
                self._pool.submit(self._run, ctx, self.handler.handle)
            except RuntimeError:  # pool shut down under us
                self._answer_error(ctx, ErrorCode.SHUTTING_DOWN, "server is shutting down")
        elif opcode in self.handler.ordered_opcodes:
            conn._run_ordered(ctx, self.handler.handle,
                              self.handler.inline_bytes.get(opcode, 0))
        else:
            self._run(ctx, self.handler.handle)

    def _serve_exempt(self, conn: Connection, frame: Frame) -> None:
        """PING and AUTHENTICATE, which the core serves before authentication too."""
        if frame.opcode == Opcode.PING:
            with conn._state:
                actions = conn._session.ping_received()
            if Action.SEND_PONG in actions:
                self._run(self._new_context(conn, frame, exempt=True), self._pong)
            return
        ctx = self._new_context(conn, frame, exempt=True)
        if not ctx._done:
            self._run(ctx, self._authenticate)

    def _new_context(self, conn: Connection, frame: Frame,
                     exempt: bool = False) -> RequestContext:
        """The context of a new request, counted in flight. It is done already when the
        connection closed under the reader (nothing counted), or when it was answered
        UNAUTHENTICATED here (the peer has not authenticated; ``exempt``: PING and
        AUTHENTICATE, which are served all the same)."""
        ctx = RequestContext(frame, conn)
        admitted = conn._begin_request(ctx, exempt)
        if admitted is Action.REFUSE:
            ctx._done = True
            return ctx
        self._charge_bytes(ctx._nbytes)
        if admitted is Action.DENY:
            self._answer_error(ctx, ErrorCode.UNAUTHENTICATED,
                               f"this connection has not authenticated: send AUTHENTICATE "
                               f"(a token) first; only PING is served before it (asked: "
                               f"{opcode_name(frame.opcode)})")
        return ctx

    def _authenticate(self, ctx: RequestContext) -> None:
        """AUTHENTICATE: check the credential, and the connection speaks for its principal.
        An open server takes any credential and says so with an empty principal."""
        try:
            request = messages.AuthenticateRequest.from_flatbuffers(ctx.header)
        except HeaderError as exc:
            ctx.system_error(ErrorCode.INVALID_REQUEST, str(exc))
            return
        conn = ctx.conn
        if self.authenticator is None:
            ctx.reply(messages.AuthenticateResponse(principal=""))
            return
        if conn.principal is not None:
            ctx.system_error(ErrorCode.INVALID_REQUEST,
                             f"this connection is authenticated already, as "
                             f"{conn.principal.name!r} (by its TLS client certificate, or an "
                             f"earlier AUTHENTICATE); open a new connection to change it")
            return
        try:
            principal = self.authenticator.authenticate(request.method, request.data)
        except ServerError as exc:
            # The reason, never the credential: it is a secret.
            log.info("%s: %s failed to authenticate: %s", self.config.name, conn.peer_str,
                     exc.message)
            raise
        conn._authenticated(principal)
        log.debug("%r authenticated as %s", conn, principal.name)
        ctx.reply(messages.AuthenticateResponse(principal=principal.name))

    # -- the server-wide byte budget -------------------------------------------------------

    @property
    def inflight_bytes(self) -> int:
        """Request bytes held now (answered requests excluded)."""
        return self._inflight_bytes

    def _charge_bytes(self, n: int) -> None:
        if n:
            with self._budget:
                self._inflight_bytes += n
                if n < 0:
                    self._budget.notify_all()

    def _release_bytes(self, n: int) -> None:
        self._charge_bytes(-n)

    def _wait_for_budget(self, conn: Connection) -> None:
        limit = self.config.max_inflight_bytes
        if self._inflight_bytes < limit:
            return
        deadline = time.monotonic() + _BUDGET_WAIT_S
        with self._budget:
            while self._inflight_bytes >= limit and not conn.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.debug("%r read past the byte budget after %.0f s", conn, _BUDGET_WAIT_S)
                    return
                self._budget.wait(min(left, 0.5))

    @staticmethod
    def _pong(ctx: RequestContext) -> None:
        ctx.send(pong_frame(ctx.frame))

    def _run(self, ctx: RequestContext, fn) -> None:
        try:
            fn(ctx)
        except ConnectionClosed as exc:
            log.debug("request %d on %r abandoned: %s", ctx.stream_id, ctx.conn, exc)
            ctx._abandon()
            return
        except ServerError as exc:
            # The detail goes along: PD_NOT_LEADER's names the cluster and its leader.
            self._answer_error(ctx, exc.code, exc.message, bytes(exc.detail))
        except Exception as exc:
            self.stats.handler_errors += 1
            log.exception("handler failed on opcode %#06x stream_id %d from %s",
                          ctx.opcode, ctx.stream_id, ctx.conn.peer_str)
            self._answer_error(ctx, ErrorCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
            return
        if not ctx._done and not ctx._deferred:
            log.error("handler returned without answering opcode %#06x stream_id %d",
                      ctx.opcode, ctx.stream_id)
            self._answer_error(ctx, ErrorCode.UNKNOWN, "the server produced no response")

    @staticmethod
    def _answer_error(ctx: RequestContext, code: int, message: str,
                      detail: bytes = b"") -> None:
        if ctx._done:
            return
        try:
            ctx.system_error(code, message, detail)
        except ConnectionClosed:
            ctx._abandon()
        except Exception:
            log.exception("could not send SYSTEM_ERROR for stream_id %d", ctx.stream_id)
            ctx._abandon()


def serve_forever(server: FrameServer, stop_event: threading.Event | None = None,
                  signals: Iterable[int] = ()) -> None:
    """Block until ``stop_event`` is set (or a signal in ``signals`` arrives), then stop."""
    event = stop_event or threading.Event()
    for sig in signals:
        signal.signal(sig, lambda *_: event.set())
    try:
        while not event.wait(0.5):
            pass
    finally:
        server.stop()
