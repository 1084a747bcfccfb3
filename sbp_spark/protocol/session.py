"""The life of one SBP connection as data, the same at both ends (sans-IO: no sockets, no
threads, no clocks of its own).

A ``Session`` keeps what docs/wire.md says a connection must keep track of:

* **Requests in flight.** A request this side sends gets a ``stream_id`` from 1 upward that no
  request still in flight has (ids stay within 1..2^31-1 and wrap around); it stays in flight
  until its answer ends (the END frame, a SYSTEM_ERROR) or the caller stops waiting. A request
  the peer sends stays in flight until this side's answer ends it.
* **GOAWAY.** After a GOAWAY, either way, the connection takes no new requests; those in flight
  are still answered, and once none is left the connection closes. This side may also stop
  taking new requests without telling the peer (``retire``: a client that set a connection
  aside). GOAWAY is sent at most once per connection.
* **PING.** A PING from the peer is answered (echoed with RESPONSE|END) while the connection
  is up; ``pong_frame`` builds the echo.
* **Authentication** (ours, docs/wire.md "Who may do what"). A server that authenticates starts
  each connection in AUTHENTICATING: only PING and AUTHENTICATE are served; any other request
  is answered UNAUTHENTICATED (DENY) and the connection stays as it was. A credential accepted
  (AUTHENTICATED) opens it; a connection still unauthenticated when its time is up
  (AUTH_TIMED_OUT) is told GOAWAY and closed.

The connection's state is one of AUTHENTICATING, OPEN, DRAINING and CLOSED, and every
(state, event) pair has an entry in ``TRANSITIONS``: the next state and what the owner must do
(``Action``). The session raises ``DRAINED`` itself when a draining connection has nothing
left in flight.
Whoever owns the session (the client's ``Connection``, the server's connection in
``server/net.py``) feeds it events under its own lock and carries out the actions it returns.

Alongside, the session notes what the peer did lately: ``PEER_TRANSITIONS`` says whether the
peer is answering or let a request go unanswered (nothing arrived since), which tells a client
to stop sending on a connection that may be dead without knowing it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Generic, TypeVar

from .constants import MAX_STREAM_ID, Flags, Opcode
from .errors import ProtocolError, SbpError
from .frame import Frame, encode_frame
from .messages import GoAwayRequest, request_frame

T = TypeVar("T")

Buffer = bytes | bytearray | memoryview


# The tables are looked up on every request: members are singletons, so identity hashing (a C
# slot) keys them as well as Enum's own __hash__, a Python function hashing the name that
# cost several times the lookup.
_identity_hash = object.__hash__


class ConnectionState(enum.Enum):
    __hash__ = _identity_hash

    AUTHENTICATING = "authenticating"  # serves PING and AUTHENTICATE alone, until one succeeds
    OPEN = "open"  # takes new requests
    DRAINING = "draining"  # takes no new requests; those in flight are still answered
    CLOSED = "closed"  # done: the transport is (being) closed


class SessionEvent(enum.Enum):
    __hash__ = _identity_hash

    REQUEST_SENT = "request sent"  # this side sends a new request
    REQUEST_RECEIVED = "request received"  # a new request from the peer arrived
    ENDED = "ended"  # a request in flight ended (its answer's END, or given up)
    DRAINED = "drained"  # nothing is in flight any more (raised by the session)
    GOAWAY_RECEIVED = "goaway received"  # the peer takes no new requests from here on
    GOAWAY_SENT = "goaway sent"  # this side tells the peer it takes no new requests
    RETIRED = "retired"  # this side sends no new requests here, without telling the peer
    PING_RECEIVED = "ping received"  # the peer asks for a PONG
    FAILED = "failed"  # the transport failed or was closed under the requests in flight
    EXEMPT_RECEIVED = "exempt received"  # a PING or AUTHENTICATE arrived: served unauthenticated
    AUTHENTICATED = "authenticated"  # a credential was accepted: the peer is a principal
    AUTH_TIMED_OUT = "auth timed out"  # no credential was accepted in the time allowed


class Action(enum.Enum):
    REFUSE = "refuse"  # the new request is not taken: not sent, or not served
    SEND_PONG = "send pong"  # echo the PING (``pong_frame``)
    SEND_GOAWAY = "send goaway"  # tell the peer (``goaway_frame``)
    CLOSE = "close"  # close the transport: the connection is done
    FAIL_ALL = "fail all"  # every request still in flight fails (``drop_all``)
    DENY = "deny"  # the new request is taken, and answered UNAUTHENTICATED


_O, _D, _C = ConnectionState.OPEN, ConnectionState.DRAINING, ConnectionState.CLOSED
_U = ConnectionState.AUTHENTICATING
_E = SessionEvent
_A = Action

TRANSITIONS: dict[tuple[ConnectionState, SessionEvent], tuple[ConnectionState,
                                                              tuple[Action, ...]]] = {
    (_O, _E.REQUEST_SENT): (_O, ()),
    (_O, _E.REQUEST_RECEIVED): (_O, ()),
    (_O, _E.ENDED): (_O, ()),
    (_O, _E.DRAINED): (_O, ()),  # an open connection with nothing in flight stays open
    (_O, _E.GOAWAY_RECEIVED): (_D, ()),
    (_O, _E.GOAWAY_SENT): (_D, (_A.SEND_GOAWAY,)),
    (_O, _E.RETIRED): (_D, ()),
    (_O, _E.PING_RECEIVED): (_O, (_A.SEND_PONG,)),
    (_O, _E.FAILED): (_C, (_A.FAIL_ALL, _A.CLOSE)),
    # An open connection's AUTHENTICATE is served like any request: on a server that does
    # not authenticate it is answered with success, on one that does it is refused (the
    # connection keeps the principal it has).
    (_O, _E.EXEMPT_RECEIVED): (_O, ()),
    (_O, _E.AUTHENTICATED): (_O, ()),
    (_O, _E.AUTH_TIMED_OUT): (_O, ()),
    # Authenticating (a server's side only): PING and AUTHENTICATE are served, every other
    # request is answered UNAUTHENTICATED. This side sends nothing of its own yet.
    (_U, _E.REQUEST_SENT): (_U, (_A.REFUSE,)),
    (_U, _E.REQUEST_RECEIVED): (_U, (_A.DENY,)),
    (_U, _E.ENDED): (_U, ()),
    (_U, _E.DRAINED): (_U, ()),
    # A connection that never authenticated has nothing worth draining for: it closes.
    (_U, _E.GOAWAY_RECEIVED): (_C, (_A.CLOSE,)),
    (_U, _E.GOAWAY_SENT): (_C, (_A.SEND_GOAWAY, _A.CLOSE)),
    (_U, _E.RETIRED): (_C, (_A.CLOSE,)),
    (_U, _E.PING_RECEIVED): (_U, (_A.SEND_PONG,)),
    (_U, _E.FAILED): (_C, (_A.FAIL_ALL, _A.CLOSE)),
    (_U, _E.EXEMPT_RECEIVED): (_U, ()),
    (_U, _E.AUTHENTICATED): (_O, ()),
    (_U, _E.AUTH_TIMED_OUT): (_C, (_A.SEND_GOAWAY, _A.CLOSE)),
    # Draining: the peer's request that arrives now was sent before it heard this side's
    # GOAWAY, and is answered (a stopping server refuses it with SHUTTING_DOWN); this side
    # sends none.
    (_D, _E.REQUEST_SENT): (_D, (_A.REFUSE,)),
    (_D, _E.REQUEST_RECEIVED): (_D, ()),
    (_D, _E.ENDED): (_D, ()),
    (_D, _E.DRAINED): (_C, (_A.CLOSE,)),
    (_D, _E.GOAWAY_RECEIVED): (_D, ()),
    (_D, _E.GOAWAY_SENT): (_D, (_A.SEND_GOAWAY,)),
    (_D, _E.RETIRED): (_D, ()),
    (_D, _E.PING_RECEIVED): (_D, (_A.SEND_PONG,)),
    (_D, _E.FAILED): (_C, (_A.FAIL_ALL, _A.CLOSE)),
    # Draining (only ever after OPEN): a late PING or AUTHENTICATE is answered like the other late
    # requests.
    (_D, _E.EXEMPT_RECEIVED): (_D, ()),
    (_D, _E.AUTHENTICATED): (_D, ()),
    (_D, _E.AUTH_TIMED_OUT): (_D, ()),
    # Closed: nothing goes out or comes in any more; late events change nothing.
    (_C, _E.REQUEST_SENT): (_C, (_A.REFUSE,)),
    (_C, _E.REQUEST_RECEIVED): (_C, (_A.REFUSE,)),
    (_C, _E.ENDED): (_C, ()),
    (_C, _E.DRAINED): (_C, ()),
    (_C, _E.GOAWAY_RECEIVED): (_C, ()),
    (_C, _E.GOAWAY_SENT): (_C, ()),
    (_C, _E.RETIRED): (_C, ()),
    (_C, _E.PING_RECEIVED): (_C, ()),
    (_C, _E.FAILED): (_C, ()),
    (_C, _E.EXEMPT_RECEIVED): (_C, (_A.REFUSE,)),
    (_C, _E.AUTHENTICATED): (_C, ()),
    (_C, _E.AUTH_TIMED_OUT): (_C, ()),
}


class PeerState(enum.Enum):
    __hash__ = _identity_hash

    ANSWERING = "answering"  # nothing of ours went unanswered since the peer last sent
    UNANSWERED = "unanswered"  # a request got no answer in time and nothing arrived since


class PeerEvent(enum.Enum):
    __hash__ = _identity_hash

    RECEIVED = "received"  # bytes arrived from the peer
    NO_ANSWER = "no answer"  # a request's answer did not come in time


PEER_TRANSITIONS: dict[tuple[PeerState, PeerEvent], PeerState] = {
    (PeerState.ANSWERING, PeerEvent.RECEIVED): PeerState.ANSWERING,
    (PeerState.ANSWERING, PeerEvent.NO_ANSWER): PeerState.UNANSWERED,
    (PeerState.UNANSWERED, PeerEvent.RECEIVED): PeerState.ANSWERING,
    (PeerState.UNANSWERED, PeerEvent.NO_ANSWER): PeerState.UNANSWERED,
}

_DRAINED = (_D, _E.DRAINED)
_NOTHING: tuple[Action, ...] = ()
_RECEIVED = PeerEvent.RECEIVED


class Session(Generic[T]):
    """One connection's state, its requests in flight (``sent``: this side's, by stream_id;
    ``received``: the peer's, as their owner's items) and what the peer did lately.

    Not thread-safe: the owner feeds it under its lock. Every method that moves the state
    returns the actions to carry out, in order.
    """

    __slots__ = ("state", "error", "drained_by", "goaway_sent", "sent", "received",
                 "peer", "last_heard", "last_active", "throttled_until", "_next_id",
                 "_max_id")

    def __init__(self, max_stream_id: int = MAX_STREAM_ID, authenticating: bool = False) -> None:
        # A server that authenticates starts its connections in AUTHENTICATING.
        self.state = _U if authenticating else _O
        # Why the connection failed (``fail``); None while it did not.
        self.error: SbpError | None = None
        # The event that ended OPEN (GOAWAY_RECEIVED, GOAWAY_SENT, RETIRED or FAILED).
        self.drained_by: SessionEvent | None = None
        self.goaway_sent = False  # at most one GOAWAY leaves a connection
        self.sent: dict[int, T] = {}
        self.received: set[object] = set()
        self.peer = PeerState.ANSWERING
        # Clock readings the owner passes in (0.0: never): when the peer last sent anything,
        # when anything last went either way, and until when new requests wait (THROTTLED).
        self.last_heard = 0.0
        self.last_active = 0.0
        self.throttled_until = 0.0
        self._next_id = 1
        self._max_id = max_stream_id

    def __repr__(self) -> str:
        return (f"<Session {self.state.value} sent={len(self.sent)} "
                f"received={len(self.received)}>")

    # -- the state table ---------------------------------------------------------------------

    def apply(self, event: SessionEvent) -> tuple[Action, ...]:
        """Move by ``TRANSITIONS``; a draining connection left with nothing in flight moves on
        by DRAINED as well. Returns the actions of both moves."""
        state, actions = TRANSITIONS[self.state, event]
        if state is not self.state:
            if self.state is _O:
                self.drained_by = event
            self.state = state
        if state is _D and not self.sent and not self.received:
            self.state, more = TRANSITIONS[_DRAINED]
            actions += more
        if actions and _A.SEND_GOAWAY in actions:
            if self.goaway_sent:
                actions = tuple(a for a in actions if a is not _A.SEND_GOAWAY)
            self.goaway_sent = True
        return actions

    @property
    def open(self) -> bool:
        """Whether new requests are taken."""
        return self.state is _O

    @property
    def closed(self) -> bool:
        return self.state is _C

    @property
    def reading(self) -> bool:
        """Whether the peer's new requests are still read: open, or authenticating."""
        return self.state is _O or self.state is _U

    # -- requests this side sends ------------------------------------------------------------

    def send_request(self, item: T) -> int | None:
        """A new request of this side, waited for through ``item``: its stream_id, or None
        when the connection takes no new requests (REFUSE)."""
        # (OPEN, REQUEST_SENT) and (OPEN, ENDED) change nothing: the steady state skips
        # the table on the path every request takes (test_the_shortcuts_match_the_table).
        if self.state is not _O and self.apply(_E.REQUEST_SENT):
            return None
        sent = self.sent
        sid = self._next_id
        top = self._max_id
        if len(sent) >= top:
            raise ProtocolError(f"all {top} stream ids are in flight on this connection")
        while sid in sent:  # never an id still in flight
            sid = sid + 1 if sid < top else 1
        self._next_id = sid + 1 if sid < top else 1
        sent[sid] = item
        return sid

    def waiting(self, stream_id: int) -> T | None:
        """Who waits for the answer of request ``stream_id`` (None: nobody, any more)."""
        return self.sent.get(stream_id)

    def answered(self, stream_id: int) -> tuple[T | None, tuple[Action, ...]]:
        """The last frame of request ``stream_id``'s answer arrived: who waited for it (None:
        nobody, any more), and the actions."""
        item = self.sent.pop(stream_id, None)
        if item is None or self.state is _O:
            return item, _NOTHING
        return item, self.apply(_E.ENDED)

    def release(self, stream_id: int, item: T) -> tuple[Action, ...]:
        """``item`` stops waiting for request ``stream_id`` (done, closed early or failed): the
        id may be used again. Nothing happens when another request has the id by now."""
        if self.sent.get(stream_id) is not item:
            return _NOTHING
        del self.sent[stream_id]
        return _NOTHING if self.state is _O else self.apply(_E.ENDED)

    # -- requests the peer sends -------------------------------------------------------------

    def receive_request(self, item: object) -> bool:
        """A request from the peer arrived (``item``: how the owner knows it): False when it
        is not taken (REFUSE: the connection is closed). A taken request is served, or
        answered UNAUTHENTICATED (DENY): ``admit`` tells which."""
        return self.admit(item) is not _A.REFUSE

    def admit(self, item: object, exempt: bool = False) -> Action | None:
        """A request from the peer arrived: None when it is to be served; REFUSE when it is
        not taken (closed); DENY when it is taken, to be answered UNAUTHENTICATED (the
        connection has not authenticated). ``exempt``: a PING or an AUTHENTICATE, served
        before authentication too."""
        if self.state is _O:  # the steady state skips the table (it changes nothing)
            self.received.add(item)
            return None
        actions = self.apply(_E.EXEMPT_RECEIVED if exempt else _E.REQUEST_RECEIVED)
        if _A.REFUSE in actions:
            return _A.REFUSE
        self.received.add(item)
        return _A.DENY if _A.DENY in actions else None

    def authenticated(self) -> tuple[Action, ...]:
        """A credential was accepted: an authenticating connection opens."""
        return self.apply(_E.AUTHENTICATED)

    def auth_timed_out(self) -> tuple[Action, ...]:
        """No credential was accepted in the time allowed: an authenticating connection is
        told GOAWAY and closed."""
        return self.apply(_E.AUTH_TIMED_OUT)

    @property
    def authenticating(self) -> bool:
        """Only PING and AUTHENTICATE are served until a credential is accepted."""
        return self.state is _U

    def finished(self, item: object) -> tuple[Action, ...]:
        """This side's answer ended the peer's request ``item`` (or gave it up)."""
        if item not in self.received:
            return _NOTHING
        self.received.discard(item)
        return _NOTHING if self.state is _O else self.apply(_E.ENDED)

    # -- notices and failures ----------------------------------------------------------------

    def goaway_received(self) -> tuple[Action, ...]:
        return self.apply(_E.GOAWAY_RECEIVED)

    def send_goaway(self) -> tuple[Action, ...]:
        """This side stops taking requests and says so; SEND_GOAWAY the first time only."""
        return self.apply(_E.GOAWAY_SENT)

    def retire(self) -> tuple[Action, ...]:
        return self.apply(_E.RETIRED)

    def ping_received(self) -> tuple[Action, ...]:
        return self.apply(_E.PING_RECEIVED)

    def fail(self, error: SbpError) -> tuple[Action, ...]:
        """The transport failed (or was closed) with ``error``: kept as the reason if it is
        the first."""
        if self.state is not _C and self.error is None:
            self.error = error
        return self.apply(_E.FAILED)

    def drop_all(self) -> tuple[list[T], list[object]]:
        """FAIL_ALL: forget every request in flight; returns this side's waiters and the
        peer's requests, to be failed or abandoned by the owner."""
        sent, received = list(self.sent.values()), list(self.received)
        self.sent.clear()
        self.received.clear()
        return sent, received

    # -- the peer ----------------------------------------------------------------------------

    def heard(self, now: float) -> None:
        """Bytes arrived from the peer at ``now``."""
        self.last_heard = self.last_active = now
        self.peer = PEER_TRANSITIONS[self.peer, _RECEIVED]

    def no_answer(self) -> None:
        """A request of this side got no answer in time."""
        self.peer = PEER_TRANSITIONS[self.peer, PeerEvent.NO_ANSWER]

    @property
    def unanswered(self) -> bool:
        """A request went unanswered and nothing arrived since: the connection may be dead
        without the transport knowing (a peer that vanished, a firewall that forgot it)."""
        return self.peer is PeerState.UNANSWERED

    def throttle(self, until: float) -> None:
        """Hold new requests back until ``until`` (the peer asked: ``throttle_time_ms``)."""
        if until > self.throttled_until:
            self.throttled_until = until

    def idle(self, now: float, timeout: float) -> bool:
        """Nothing in flight and no traffic for ``timeout`` up to ``now``."""
        return not self.sent and not self.received and now - self.last_active >= timeout


_PONG_FLAGS = int(Flags.RESPONSE | Flags.END)


def pong_frame(ping: Frame) -> list[Buffer]:
    """The answer to a PING: its header and payload echoed with RESPONSE|END."""
    return encode_frame(Opcode.PING, _PONG_FLAGS, ping.stream_id, ping.header, ping.payload)


def goaway_frame(reason: str = "") -> Sequence[Buffer]:
    """A GOAWAY saying why (on stream 0: requests are numbered from 1)."""
    return request_frame(0, GoAwayRequest(message=reason))


__all__ = ["PEER_TRANSITIONS", "TRANSITIONS", "Action", "ConnectionState", "PeerEvent",
           "PeerState", "Session", "SessionEvent", "goaway_frame", "pong_frame"]
