"""One TCP connection to one SBP server, shared by many concurrent requests.

Requests are numbered by stream_id (docs/wire.md, Framing). Any thread may send. Incoming frames
are decoded and sorted into a queue per outstanding stream_id by whichever thread holds the
connection's read turn (read_turn.py): a thread waiting for an answer reads the socket itself
when nobody else does, and a background thread reads only once no caller has waited for a while
(answers nobody waits for yet, GOAWAY, PING, the end of the connection). A response is consumed
as a ``ResponseStream``: an iterator of frames that ends at the END frame, raises
``ServerError`` on a SYSTEM_ERROR frame, and frees its stream_id when it is exhausted, closed or
failed. The first socket failure fails every outstanding request with one ``TransportError``
naming the server's address.

The connection's state (open, draining, closed), the stream ids in flight and the GOAWAY and
PING rules are a ``protocol.session.Session``, the same table the server's connections drive;
this class feeds it events and carries out the actions it returns.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from queue import Empty, SimpleQueue
from typing import Any

from sbp_spark.protocol.buffers import ReceiveBuffers
from sbp_spark.protocol.constants import (
    MAX_FRAME_LENGTH,
    MAX_INFLIGHT_PER_CONNECTION,
    Flags,
    Opcode,
    opcode_name,
)
from sbp_spark.protocol.errors import (
    ChecksumError,
    ConnectError,
    ConnectTimeoutError,
    FrameError,
    ProtocolError,
    ReadTimeoutError,
    SbpError,
    ServerError,
    TlsHandshakeTimeoutError,
    TransportError,
    WriteTimeoutError,
)
from sbp_spark.protocol.frame import Frame, FrameDecoder, encode_frame
from sbp_spark.protocol.session import Action, Session, SessionEvent, goaway_frame, pong_frame
from sbp_spark.transport.sockets import send_buffers, set_kernel_timeouts, set_receive_timeout
from sbp_spark.transport.tls import TlsConfig, TlsSocket, wrap_client

from .config import ClientConfig
from .heartbeat import Heartbeat
from .read_turn import YOUR_TURN, ReadTurn
from .tls_hints import refused_certificate_hint, unverified_server_hint

log = logging.getLogger(__name__)

# A large frame's body is received in pieces of up to this size. With no poll before each
# recv, 1 MiB pieces halve the calls (and the sender's wake-ups) of 256 KiB ones and still fit
# the CPU cache for the running checksum: FETCH +10-15% in alternating runs, 4 MiB no better.
BODY_RECEIVE_PIECE = 1024 * 1024
# Callers leave the socket to the background reader once none has waited for an answer for
# this long: short next to a caller's pauses between requests, so a busy caller reads its own
# answers, and long next to nothing a peer waits for (see read_turn.py).
QUIET_S = 0.05

Buffer = bytes | bytearray | memoryview

_RESPONSE = int(Flags.RESPONSE)
_END = int(Flags.END)
_SYSTEM_ERROR = int(Flags.SYSTEM_ERROR)
_LAST_FRAME = _END | _SYSTEM_ERROR


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6-host]:port``) as a (host, port) pair."""
    if not isinstance(address, str):
        raise ValueError(f"server address {address!r} must be a 'host:port' string")
    text = address.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"server address {address!r} is not of the form host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"server address {address!r}: port {port_text!r} is not a number") \
            from None
    if not 0 < port < 65536:
        raise ValueError(f"server address {address!r}: port {port} is not in 1..65535")
    return host, port


def system_error_of(frame: Frame) -> ServerError:
    """The ServerError a SYSTEM_ERROR frame carries."""
    from sbp_spark.protocol.messages import SystemError as SystemErrorMsg

    try:
        status = SystemErrorMsg.from_flatbuffers(frame.header).status
    except ProtocolError as exc:
        return ServerError(f"SYSTEM_ERROR frame with an unreadable header: {exc}")
    return ServerError.for_status(status.code, status.message, bytes(status.detail))


def _first_item(queue: SimpleQueue) -> Any:
    """The oldest item of ``queue`` that is not an offer of the read turn left over from
    an earlier wait; raises ``Empty`` when there is none."""
    item = queue.get_nowait()
    while item is YOUR_TURN:
        item = queue.get_nowait()
    return item


def _final_if_refused(error: SbpError, tls_hint: str) -> SbpError:
    """``error``, not retriable when ``tls_hint`` says the TLS certificates do not fit (the
    server refused this client's, or this client cannot verify the server's): every retry
    would fail the same way, and the hint says what to change."""
    if tls_hint:
        error.retriable = False
    return error


class _Failure:
    """Queue item telling a waiter that its request failed with ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: SbpError) -> None:
        self.error = error


def _fresh(error: SbpError) -> SbpError:
    """A new exception like ``error`` for one waiter (one instance is never raised twice)."""
    try:
        fresh = copy.copy(error)  # the error's own pickling rules: its message, its fields
    except TypeError:
        return error
    fresh.__cause__ = error.__cause__
    return fresh


class ResponseStream:
    """The frames answering one request, in order; ends after the END frame.

    Iterating raises ``ReadTimeoutError`` when no frame arrives within ``timeout`` seconds,
    ``ServerError`` on a SYSTEM_ERROR answer and ``TransportError`` if the connection fails.
    Use it as a context manager (or call ``close()``) when not reading it to the end.
    """

    __slots__ = ("connection", "stream_id", "opcode", "timeout", "_queue", "_done")

    def __init__(self, connection: Connection, stream_id: int, opcode: int,
                 queue: SimpleQueue, timeout: float) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.opcode = opcode
        self.timeout = timeout
        self._queue = queue
        self._done = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> Frame:
        frame = self.poll(self.timeout)
        if frame is None:
            raise self.give_up(f"within {self.timeout:g}s")
        return frame

    def poll(self, seconds: float) -> Frame | None:
        """The next frame, or None when none arrived within ``seconds``: unlike iteration, the
        request stays outstanding, so the caller may look at the server meanwhile and wait
        again. Raises as iteration does otherwise."""
        if self._done:
            raise StopIteration
        try:
            item = self.connection._next_item(self._queue, seconds)
        except Empty:
            return None
        if type(item) is _Failure:
            self.close()
            raise _fresh(item.error)
        if item.flags & _LAST_FRAME:
            self._done = True
            if item.flags & _SYSTEM_ERROR:
                self.connection._release(self.stream_id, self._queue)
                raise system_error_of(item)
            self.connection._release(self.stream_id, self._queue)
        return item

    def give_up(self, how_long: str) -> ReadTimeoutError:
        """Stop waiting for the answer, which did not come ``how_long`` ("within 30s"): the
        error to raise. The connection counts as unanswered (see ``Connection.unanswered``)."""
        self.close()
        self.connection._no_answer()
        return ReadTimeoutError(
            f"no answer from {self.connection.address} to {opcode_name(self.opcode)} "
            f"(request {self.stream_id} on this connection) {how_long}")

    @property
    def done(self) -> bool:
        """True once the END frame was read or the stream was closed or failed."""
        return self._done

    def close(self) -> None:
        """Stop waiting for the answer; late frames for this request are dropped."""
        if not self._done:
            self._done = True
            self.connection._release(self.stream_id, self._queue)

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._done:
            self.close()



class Connection:
    """One TCP connection to one server, carrying many requests at once.

    ``request()`` may be called from any thread. The connection stops taking new requests after
    the server's GOAWAY (``usable`` turns False) and closes itself once the requests already in
    flight are answered. It also closes after ``idle_timeout_s`` with nothing outstanding.
    """

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config if config is not None else ClientConfig()
        host, port = parse_address(address)
        timeout = self.config.connect_timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            raise ConnectTimeoutError(
                f"connecting to {address} timed out after {timeout:g}s") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {address}: {exc}") from exc
        tls = self.config.tls_settings()
        # The socket object reads go through and how long one may wait: the reading socket's
        # kernel timeout (SO_RCVTIMEO), or with TLS its twin's Python timeout. Whoever holds
        # the read turn sets what it needs (``_wait_at_most``).
        self._receive_timeout = self.config.idle_timeout_s
        self._tls_twin: socket.socket | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Reads and writes each get a socket object over the same connection.
            if tls is None:
                set_kernel_timeouts(sock, receive_s=self.config.idle_timeout_s,
                                    send_s=self.config.request_timeout_s)
                self._rsock: socket.socket | TlsSocket = sock.dup()
            else:  # the handshake reads through the twin, with Python's timeouts
                sock.settimeout(self.config.request_timeout_s)
                twin = sock.dup()
                twin.settimeout(self.config.idle_timeout_s)
                self._rsock = self._tls_twin = twin
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot set up the connection to {address}: {exc}") from exc
        self._sock: socket.socket | TlsSocket = sock
        if tls is not None:
            self._sock = self._start_tls(sock, twin, tls, host)
            self._rsock = self._sock  # one TLS state: the reader decrypts through the same one
        self._decoder = FrameDecoder(MAX_FRAME_LENGTH, allocate=ReceiveBuffers())
        # Guards the session. Reentrant: a ResponseStream dropped (and finalized) while this
        # thread holds it releases its stream id through it.
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._control: deque[Sequence[Buffer]] = deque()  # frames the reader must send (PONG)
        # The connection's state, its requests in flight (each answer's queue, by stream_id)
        # and what the server did lately (protocol/session.py): this class carries out what
        # the session's transitions ask for (``_carry_out``).
        self._session: Session[SimpleQueue] = Session()
        self._session.last_active = time.monotonic()
        self._turn = ReadTurn(self._lock, QUIET_S)
        self._reader = threading.Thread(
            target=self._background_reads, name=f"sbp-reader-{address}", daemon=True)
        self._reader.start()
        #: Who the server knows this connection as ("" when it did not authenticate it).
        self.principal = ""
        if self.config.token is not None:
            self._authenticate(self.config.token)

    def _authenticate(self, token: str) -> None:
        """AUTHENTICATE with ``token`` before anything else is sent; a refusal closes the
        connection and raises ``UnauthenticatedError`` (not retriable: the same token is
        refused again), a lost answer the transport's error."""
        from sbp_spark.protocol.messages import AuthenticateRequest, AuthenticateResponse

        try:
            answer, _ = self.call(AuthenticateRequest(method="token", data=token.encode()))
        except BaseException:
            self.close()
            raise
        if not isinstance(answer, AuthenticateResponse):
            self.close()
            raise ProtocolError(f"{self.address} answered AUTHENTICATE with "
                                f"{type(answer).__name__}")
        self.principal = answer.principal

    def _start_tls(self, sock: socket.socket, twin: socket.socket, tls: TlsConfig,
                   host: str) -> TlsSocket:
        """Run the TLS handshake over the connected socket (and its reading twin)."""
        try:
            return wrap_client(sock, tls, host, self.config.connect_timeout_s, reader=twin)
        except TimeoutError:
            error: SbpError = TlsHandshakeTimeoutError(
                f"TLS handshake with {self.address} timed out after "
                f"{self.config.connect_timeout_s:g}s (connect_timeout_s): the server accepted "
                f"the connection but did not answer the handshake, so its process is stopped "
                f"or hung, or no SBP server with TLS listens there (one without TLS closes "
                f"the connection at once)")
        except OSError as exc:  # TlsError, ssl.SSLError, a reset...
            hint = (unverified_server_hint(exc, self.config)
                    or refused_certificate_hint(exc, self.config))
            error = _final_if_refused(
                TransportError(f"TLS handshake with {self.address} failed: {exc}{hint}"), hint)
        sock.close()
        self._rsock.close()
        raise error

    def __repr__(self) -> str:
        session = self._session
        why = f" ({session.drained_by.value})" if session.drained_by is not None else ""
        return (f"<Connection {self.address} {session.state.value}{why} "
                f"outstanding={len(session.sent)}>")

    # -- state -----------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """True while the connection takes new requests."""
        return self._session.open

    @property
    def closed(self) -> bool:
        return self._session.closed

    @property
    def goaway_received(self) -> bool:
        """True when the server's GOAWAY is what made the connection stop taking requests."""
        return self._session.drained_by is SessionEvent.GOAWAY_RECEIVED

    @property
    def unanswered(self) -> bool:
        """True when a request timed out and nothing has arrived since."""
        return self._session.unanswered

    def retire(self) -> None:
        """Take no new requests; close once the requests in flight are answered (as after
        GOAWAY). The pool retires a connection whose last request got no answer, so a retry
        goes out on a new connection instead of one that may be dead."""
        with self._lock:
            actions = self._session.retire()
        self._carry_out(actions)

    @property
    def last_heard(self) -> float:
        """When the server last sent anything on this connection (a ``time.monotonic()``
        value; 0.0 before it has)."""
        return self._session.last_heard

    @property
    def outstanding(self) -> int:
        """Requests sent and not yet fully answered."""
        return len(self._session.sent)

    @property
    def error(self) -> SbpError | None:
        """Why the connection failed, if it did."""
        return self._session.error

    def throttle(self, throttle_time_ms: int) -> None:
        """Hold back new requests for ``throttle_time_ms`` (the server asked for it)."""
        if throttle_time_ms > 0:
            with self._lock:
                self._session.throttle(time.monotonic() + throttle_time_ms / 1000.0)

    # -- requests --------------------------------------------------------------------------

    def request(
        self,
        opcode: int,
        header: Buffer = b"",
        payload: Buffer | Sequence[Buffer] = b"",
        timeout: float | None = None,
    ) -> ResponseStream:
        """Send one request frame and return the stream of its answer frames."""
        return self.start(
            opcode, lambda sid: encode_frame(opcode, 0, sid, header, payload), timeout)

    def start(
        self,
        opcode: int,
        build: Callable[[int], Sequence[Buffer]],
        timeout: float | None = None,
    ) -> ResponseStream:
        """Allocate a stream_id, send the buffers ``build(stream_id)`` returns, and return the
        answer's stream. ``timeout`` bounds the wait for each answer frame (default: the
        config's ``request_timeout_s``)."""
        delay = self._session.throttled_until - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        queue: SimpleQueue = SimpleQueue()
        with self._lock:
            sid = self._session.send_request(queue)
        if sid is None:
            raise self._refusal()
        stream = ResponseStream(
            self, sid, opcode, queue,
            self.config.request_timeout_s if timeout is None else timeout)
        try:
            buffers = build(sid)
        except BaseException:
            stream.close()
            raise
        self._send(buffers, stream)
        return stream

    def call(self, msg: Any, payload: Buffer | Sequence[Buffer] = b"",
             timeout: float | None = None,
             on_lost: Callable[[SbpError], SbpError] | None = None,
             probe_s: float | None = None) -> tuple[Any, Buffer]:
        """Send a typed request (a ``protocol.messages`` class) and return the decoded
        one-frame answer with its payload. ``on_lost`` turns a failure once the request was
        sent (the connection failed, no answer in time: the server may have carried it out)
        into the error raised instead (``exc`` itself raises it unchanged, for callers that
        only take note); failures before it was sent are raised as they are.

        ``probe_s``: each time the answer is ``probe_s`` seconds late, PING the server; when
        the PING gets no answer within ``probe_s`` either, the server is taken as stopped or
        hung and the call fails at once (``ReadTimeoutError``), instead of waiting out the
        request timeout. A server that answers PINGs is waited for as long as that allows.
        Only for requests the caller would send again after a timeout anyway."""
        from sbp_spark.protocol.messages import decode_response, request_frame

        stream = self.start(msg.OPCODE, lambda sid: request_frame(sid, msg, payload), timeout)
        with stream:
            try:
                frame = next(stream) if probe_s is None else self._probed_answer(stream,
                                                                                 probe_s)
            except SbpError as exc:
                if on_lost is None or isinstance(exc, ServerError):
                    raise
                error = on_lost(exc)
                if error is exc:
                    raise
                raise error from exc
            if not frame.is_end:
                raise ProtocolError(
                    f"{self.address} answered {opcode_name(msg.OPCODE)} with more than one frame")
            if frame.opcode != msg.OPCODE:
                raise ProtocolError(
                    f"{self.address} answered {opcode_name(msg.OPCODE)} with a "
                    f"{opcode_name(frame.opcode)} frame")
            return decode_response(frame), frame.payload

    def _probed_answer(self, stream: ResponseStream, probe_s: float) -> Frame:
        """The first frame of ``stream``, PINGing the server while it is late (see ``call``)."""
        give_up = time.monotonic() + stream.timeout
        first = min(probe_s, stream.timeout)
        frame = stream.poll(first)
        if frame is None:
            frame = self.late_answer(stream, probe_s, give_up, first)
        return frame

    def late_answer(self, stream: ResponseStream, probe_s: float, give_up: float,
                    waited: float, keep_waiting: Callable[[float], bool] | None = None
                    ) -> Frame:
        """The next frame of ``stream``, already ``waited`` seconds late (``probe_s`` or more,
        unless ``give_up`` was that near): PING the server, and while it answers, wait again,
        ``probe_s`` at a time, until ``give_up`` (a ``time.monotonic()`` value). Raises
        ``ReadTimeoutError`` at ``give_up``, or at once when a PING got no answer within
        ``probe_s`` either (``_answers_ping``): the server accepts connections and takes
        requests (its kernel does) but does not answer, as a stopped or hung process.

        ``keep_waiting``, when given, is asked each time a PING goes unanswered, with the
        time (``time.monotonic()``) since which the server has sent nothing for this wait:
        when the wait began, or the server's last word on this connection if later. True
        waits on (until ``give_up``). A server's reader that holds back from reading (its
        backpressure, while a slow disk holds the requests before the PING) cannot answer a
        PING, so a caller for whom giving up too early costs more than waiting (an APPEND sent
        again may be stored twice) asks someone else, the PD, whether the server is still
        there.

        Callers wait for the frame themselves first (``stream.poll``), so an answer that comes
        in time costs no more than waiting for it. Only for requests the caller would send
        again after a timeout anyway (the server may carry this one out later)."""
        began = time.monotonic() - waited
        while True:
            if time.monotonic() >= give_up:
                raise stream.give_up(f"within {time.monotonic() - began:.1f}s")
            if not self._answers_ping(probe_s) and (
                    keep_waiting is None
                    or not keep_waiting(max(began, self._session.last_heard))):
                raise stream.give_up(
                    f"within {time.monotonic() - began:.1f}s, nor to a PING within "
                    f"{probe_s:g}s: the server accepts connections but does not answer (its "
                    f"process is stopped or hung)")
            frame = stream.poll(max(0.0, min(probe_s, give_up - time.monotonic())))
            if frame is not None:
                return frame

    def answers_ping(self, timeout: float) -> bool:
        """Whether the server shows it is there within ``timeout`` seconds: the check
        ``late_answer`` makes, for a caller that waits for an answer its own way (a primary
        waiting for a secondary). See ``_answers_ping``."""
        return self._answers_ping(timeout)

    def _answers_ping(self, timeout: float) -> bool:
        """False when the server let a PING go unanswered for ``timeout`` seconds and sent
        nothing else meanwhile either, or another request on this connection went unanswered
        since the server last sent anything. A PING that could not be sent (the connection
        failed, or takes no new requests after the server's GOAWAY) counts as answered: the
        request's own answer tells what happened. An unanswered PING does not count as a
        request that got no answer (``unanswered``): the caller decides.

        With as many requests in flight as a server reads ahead on one connection, it may
        read nothing more (the PING included) until one of them is answered, which a slow
        disk can hold up: the PING goes over a connection of its own then
        (``_answers_ping_aside``)."""
        session = self._session
        if session.unanswered:
            return False
        if len(session.sent) >= MAX_INFLIGHT_PER_CONNECTION:
            return self._answers_ping_aside(timeout)
        heard = session.last_heard
        try:
            with self.request(Opcode.PING, b"", b"sbp-probe", timeout) as stream:
                # Anything else arriving meanwhile (answers to other requests) shows the
                # server at work, whose reader may be held back from reading the PING.
                return stream.poll(timeout) is not None or session.last_heard != heard
        except SbpError:
            return True

    def _answers_ping_aside(self, timeout: float) -> bool:
        """``_answers_ping`` for a connection the server may have stopped reading (as many
        requests in flight as it reads ahead): a PING over a new connection, which a busy
        server's network core answers at once, and a stopped process does not (its kernel
        completes the handshake all the same). False when no answer came within ``timeout``,
        or the connection or its TLS handshake did not complete within it either; anything
        arriving on this connection meanwhile counts as an answer. Only when an answer is
        already late: it costs a connection."""
        heard = self._session.last_heard
        config = dataclasses.replace(self.config, connect_timeout_s=timeout,
                                     request_timeout_s=timeout)
        try:
            with Connection(self.address, config) as aside:
                aside.ping(b"sbp-probe", timeout)
            return True
        except SbpError as exc:
            log.debug("%s: PING over a new connection got no answer within %gs: %s",
                       self.address, timeout, exc)
            return self._session.last_heard != heard

    def ping(self, payload: bytes = b"sbp-ping", timeout: float | None = None) -> float:
        """Round-trip a PING; returns the round-trip time in seconds."""
        began = time.monotonic()
        with self.request(Opcode.PING, b"", payload, timeout) as stream:
            frame = next(stream)
        if bytes(frame.payload) != payload:
            raise ProtocolError(f"{self.address} answered PING with a different payload")
        return time.monotonic() - began

    def start_heartbeat(
        self,
        make_request: Callable[[], Any],
        interval_s: float,
        on_response: Callable[[Any], None] | None = None,
    ) -> Heartbeat:
        """Send ``make_request()`` (a HeartbeatRequest) every ``interval_s`` seconds on this
        connection until the returned ``Heartbeat`` is stopped or the connection closes."""
        def beat() -> None:
            if self._session.closed:
                raise TransportError(f"connection to {self.address} is closed")
            response, _ = self.call(make_request())
            if on_response is not None:
                on_response(response)

        return Heartbeat(beat, interval_s, name=f"sbp-heartbeat-{self.address}",
                         stop_when=lambda: self._session.closed)

    def send_goaway(self, reason: str = "") -> None:
        """Tell the server this side sends no more requests on this connection (GOAWAY, best
        effort: a connection that failed is left as it is); it closes once the requests in
        flight are answered."""
        with self._lock:
            actions = self._session.send_goaway()
        self._carry_out(actions, reason=reason)

    def close(self) -> None:
        """Close the socket; anything still outstanding fails with ``TransportError``."""
        self._fail(TransportError(f"connection to {self.address} was closed by the client"))

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _refusal(self) -> SbpError:
        """Why the connection took no new request: the error to raise."""
        session = self._session
        if session.closed:
            if session.error is not None:
                return _fresh(session.error)
            return TransportError(f"connection to {self.address} is closed")
        if session.drained_by is SessionEvent.GOAWAY_RECEIVED:
            return TransportError(
                f"{self.address} sent GOAWAY: this connection takes no new requests")
        if session.drained_by is SessionEvent.GOAWAY_SENT:
            return TransportError(
                f"this client sent GOAWAY to {self.address}: the connection takes no new "
                f"requests")
        return TransportError(
            f"connection to {self.address} was set aside after a request got no answer: "
            f"it takes no new requests")

    def _release(self, sid: int, queue: SimpleQueue) -> None:
        with self._lock:
            actions = self._session.release(sid, queue)
        if actions:
            self._carry_out(actions)

    def _no_answer(self) -> None:
        # Lock-free: the peer table's next state never depends on the current one, so a
        # concurrent ``heard`` and this can lose nothing but their order.
        self._session.no_answer()

    def _carry_out(self, actions: Sequence[Action], ping: Frame | None = None,
                   reason: str = "") -> None:
        """Do what the session's transitions asked for, in order (outside the lock)."""
        for action in actions:
            if action is Action.CLOSE:
                self._shut_down()
            elif action is Action.FAIL_ALL:
                with self._lock:
                    waiting, _ = self._session.drop_all()
                    error = self._session.error or TransportError(
                        f"connection to {self.address} is closed")
                for queue in waiting:
                    queue.put(_Failure(error))
            elif action is Action.SEND_PONG:
                assert ping is not None
                self._control.append(pong_frame(ping))
                self._flush_control()
            elif action is Action.SEND_GOAWAY:
                # The session may say closed already (CLOSE comes next), so ask the socket:
                # it is closed holding the send lock.
                try:
                    with self._send_lock:
                        if self._sock.fileno() >= 0:
                            send_buffers(self._sock, goaway_frame(reason))
                except OSError as exc:
                    log.debug("GOAWAY to %s not sent: %s", self.address, exc)

    def _send(self, buffers: Sequence[Buffer], stream: ResponseStream | None = None) -> None:
        with self._send_lock:
            if self._session.closed:
                if stream is not None:
                    stream.close()
                raise self._refusal()
            try:
                send_buffers(self._sock, buffers)
            except (TimeoutError, BlockingIOError):
                error: SbpError = WriteTimeoutError(
                    f"sending to {self.address} made no progress for "
                    f"{self.config.request_timeout_s:g}s")
                self._fail(error)
                raise _fresh(error) from None
            except OSError as exc:
                hint = self._tls_hint(exc)
                error = TransportError(f"connection to {self.address} failed while sending: "
                                       f"{exc}{hint}")
                if self.config.tls:
                    error = _final_if_refused(error, hint)
                error.__cause__ = exc
                self._fail(error)
                raise _fresh(error) from exc
            self._session.last_active = time.monotonic()
        if self._control:
            self._flush_control()

    def _flush_control(self) -> None:
        # Called by the reader (which must never block behind a sender) and by every sender
        # after it lets go of the lock, so a queued PONG always goes out.
        while self._control and self._send_lock.acquire(blocking=False):
            try:
                while self._control and not self._session.closed:
                    send_buffers(self._sock, self._control.popleft())
            except OSError as exc:
                self._fail(TransportError(
                    f"connection to {self.address} failed while sending: {exc}"))
                return
            finally:
                self._send_lock.release()

    def _fail(self, error: SbpError) -> None:
        with self._lock:
            actions = self._session.fail(error)
        self._carry_out(actions)

    def _shut_down(self) -> None:
        """Wake whoever reads or waits to read; the background thread closes the sockets once
        nobody reads any more."""
        self._turn.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed, or the peer closed first: nothing left to shut down

    def _close_sockets(self) -> None:
        with self._send_lock:
            self._sock.close()
        self._rsock.close()

    def _close_fds_after_fork(self) -> None:
        # In a forked child: release this process's copies of the descriptors only (the
        # session's CLOSE would shut the parent's connection down).
        self._session.fail(TransportError(
            f"connection to {self.address} belongs to the parent process (fork)"))
        self._session.drop_all()
        self._send_lock = threading.Lock()
        self._sock.close()
        self._rsock.close()

    def _retire_if_idle(self) -> Sequence[Action]:
        """Nothing in flight and nothing sent or received for ``idle_timeout_s``: retire (the
        session then closes the connection); the actions to carry out."""
        with self._lock:
            if not self._session.idle(time.monotonic(), self.config.idle_timeout_s):
                return ()
            return self._session.retire()

    # -- reading (whoever holds the read turn, see read_turn.py) ---------------------------

    def _next_item(self, queue: SimpleQueue, timeout: float) -> Any:
        """The next item for the request whose queue is ``queue``: read it off the socket when
        nobody else is reading, else wait for it (or for the turn). Raises ``Empty`` when
        nothing came within ``timeout`` seconds."""
        try:
            return _first_item(queue)
        except Empty:
            pass
        deadline = time.monotonic() + timeout
        turn = self._turn
        turn.enter()
        try:
            while True:
                if turn.take_or_wait(queue):
                    try:
                        self._read_until(queue, timeout, deadline)
                    finally:
                        turn.put_down()
                    try:
                        return _first_item(queue)
                    except Empty:
                        if time.monotonic() >= deadline:
                            raise
                    continue
                if self._session.closed and queue.empty():
                    self._put_failure(queue)
                try:
                    item = queue.get(timeout=max(0.0, deadline - time.monotonic()))
                finally:
                    turn.stop_waiting(queue)
                if item is not YOUR_TURN:
                    return item
        finally:
            turn.leave()

    def _read_until(self, queue: SimpleQueue, timeout: float, deadline: float) -> None:
        """Holding the read turn: read and dispatch until ``queue`` has an item or
        ``deadline`` passes. A closed connection puts its failure there."""
        while queue.empty():  # (a stale offer of the turn in it costs one more round)
            if self._session.closed:
                self._put_failure(queue)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wait_at_most(min(timeout, left))
            try:
                self._receive()
            except (TimeoutError, BlockingIOError):
                continue

    def _put_failure(self, queue: SimpleQueue) -> None:
        queue.put(_Failure(self._session.error or TransportError(
            f"connection to {self.address} is closed")))

    def _wait_at_most(self, seconds: float) -> None:
        """Bound one read's wait by about ``seconds``: the bound set before is kept unless it
        is a tenth longer or half shorter (a setsockopt per request would cost more than the
        exact bound is worth)."""
        current = self._receive_timeout
        if 0.5 * seconds <= current <= 1.1 * seconds:
            return
        self._receive_timeout = seconds
        if self._tls_twin is not None:
            self._tls_twin.settimeout(seconds)
        else:
            set_receive_timeout(self._rsock, seconds)  # type: ignore[arg-type]

    def _receive(self) -> None:
        """Holding the read turn: one read, and dispatch of every frame it completed. Timeouts
        propagate; any other failure fails the connection (and the request, through its
        queue)."""
        decoder = self._decoder
        try:
            buf = decoder.get_buffer()
            if buf.nbytes > BODY_RECEIVE_PIECE:
                buf = buf[:BODY_RECEIVE_PIECE]
            n = self._rsock.recv_into(buf)
            if n == 0:
                self._fail(TransportError(
                    f"connection to {self.address} was closed by the server"
                    + (" after GOAWAY" if self.goaway_received else "") + self._tls_hint()))
                return
            self._session.heard(time.monotonic())  # lock-free, as ``_no_answer``
            decoder.buffer_updated(n)
            event = decoder.next_event()
            while event is not None:
                self._dispatch(event)
                event = decoder.next_event()
        except (TimeoutError, BlockingIOError):
            raise
        except FrameError as exc:
            self._fail(TransportError(f"lost framing on the connection to {self.address}: {exc}"))
        except OSError as exc:
            if not self._session.closed:
                hint = self._tls_hint(exc)
                error = TransportError(f"connection to {self.address} failed: {exc}{hint}")
                self._fail(_final_if_refused(error, hint) if self.config.tls else error)
        except BaseException as exc:
            self._fail(TransportError(
                f"reading the connection to {self.address} stopped: {exc!r}"))
            raise

    def _tls_hint(self, exc: OSError | None = None) -> str:
        """For a plain-TCP connection that the server ended (closed, reset: ``exc``) before
        sending anything: a hint that it may require TLS (a TLS server drops a peer whose
        first bytes are no TLS handshake, without a word). For a TLS connection that the
        server ended with an alert refusing this client's certificate: what to change (see
        ``refused_certificate_hint``). Empty otherwise."""
        if self.config.tls:
            return refused_certificate_hint(exc, self.config)
        if self._session.last_heard or (
                exc is not None and not isinstance(exc, (BrokenPipeError, ConnectionResetError))):
            return ""
        return (" (before any answer: the server may require TLS, which this client does not "
                "use; set tls=True in ClientConfig, the Spark option tls.enabled=true, "
                "$SBP_TLS_CA for the sbp commands, or --tls-cert, --tls-key and --tls-ca for "
                "the sbp servers)")

    def _background_reads(self) -> None:
        """The connection's own thread: reads while no caller waits for an answer (after a
        quiet spell), closes an idle connection, and closes the sockets at the end."""
        turn = self._turn
        try:
            while not self._session.closed and turn.take_when_quiet():
                try:
                    self._wait_at_most(self.config.idle_timeout_s)
                    while not self._session.closed and not turn.callers:
                        try:
                            self._receive()
                        except (TimeoutError, BlockingIOError):
                            if actions := self._retire_if_idle():
                                log.debug("closing idle connection to %s", self.address)
                                self._carry_out(actions)
                finally:
                    turn.put_down()
        finally:
            if not self._session.closed:
                self._fail(TransportError(f"connection to {self.address} stopped reading"))
            turn.close()
            turn.take_for_good()  # nobody reads any more: the descriptors can go
            self._close_sockets()

    def _dispatch(self, event: Any) -> None:
        if type(event) is not Frame:  # InvalidFrame: intact framing, unusable content
            if event.flags & _RESPONSE:
                with self._lock:
                    queue, actions = self._session.answered(event.stream_id)
                if queue is not None:
                    error = event.error
                    if isinstance(error, ChecksumError):
                        error = ChecksumError(f"answer from {self.address}: {error}")
                    queue.put(_Failure(error))
                    self._carry_out(actions)
            else:
                log.warning("ignoring an invalid request frame from %s: %s",
                            self.address, event.error)
            return
        flags = event.flags
        if flags & _RESPONSE:
            if flags & _LAST_FRAME:
                with self._lock:
                    queue, actions = self._session.answered(event.stream_id)
                if queue is not None:
                    queue.put(event)
                    if actions:
                        self._carry_out(actions)
                return
            queue = self._session.waiting(event.stream_id)
            if queue is not None:
                queue.put(event)
            return
        opcode = event.opcode
        if opcode == Opcode.PING:
            with self._lock:
                actions = self._session.ping_received()
            self._carry_out(actions, ping=event)
        elif opcode == Opcode.GOAWAY:
            log.debug("GOAWAY from %s", self.address)
            with self._lock:
                actions = self._session.goaway_received()
            self._carry_out(actions)
        else:
            log.debug("ignoring request %s from server %s", opcode_name(opcode), self.address)
