"""The connection session (sbp_spark/protocol/session.py) by itself: its tables, every
(state, event) pair, the stream ids it hands out, and random event sequences checked against the
rules of docs/wire.md (GOAWAY, PING, ids not reused while in flight)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbp_spark.protocol.constants import Flags, Opcode
from sbp_spark.protocol.errors import ProtocolError, TransportError
from sbp_spark.protocol.frame import decode_frame
from sbp_spark.protocol.messages import GoAwayRequest, decode_request
from sbp_spark.protocol.session import (
    PEER_TRANSITIONS,
    TRANSITIONS,
    Action,
    ConnectionState,
    PeerEvent,
    PeerState,
    Session,
    SessionEvent,
    goaway_frame,
    pong_frame,
)

OPEN, DRAINING, CLOSED = ConnectionState.OPEN, ConnectionState.DRAINING, ConnectionState.CLOSED
AUTHENTICATING = ConnectionState.AUTHENTICATING
_AUTH_EVENTS = (SessionEvent.EXEMPT_RECEIVED, SessionEvent.AUTHENTICATED,
                SessionEvent.AUTH_TIMED_OUT)


def test_the_tables_name_every_state_and_event():
    assert set(TRANSITIONS) == set(itertools.product(ConnectionState, SessionEvent))
    assert set(PEER_TRANSITIONS) == set(itertools.product(PeerState, PeerEvent))


# What each (state, event) pair must do, written out a second time as the rules say it (the
# table is data; this is the reading of docs/wire.md it must match).
def _expected(state: ConnectionState, event: SessionEvent
              ) -> tuple[ConnectionState, tuple[Action, ...]]:
    if state is AUTHENTICATING:
        return _expected_authenticating(event)
    if state is CLOSED:
        refused = event in (SessionEvent.REQUEST_SENT, SessionEvent.REQUEST_RECEIVED,
                            SessionEvent.EXEMPT_RECEIVED)
        return CLOSED, (Action.REFUSE,) if refused else ()
    if event in _AUTH_EVENTS:  # an open or draining connection's AUTHENTICATE is served
        return state, ()
    if event is SessionEvent.FAILED:
        return CLOSED, (Action.FAIL_ALL, Action.CLOSE)
    if event is SessionEvent.PING_RECEIVED:
        return state, (Action.SEND_PONG,)
    if event is SessionEvent.GOAWAY_SENT:
        return DRAINING, (Action.SEND_GOAWAY,)
    if event in (SessionEvent.GOAWAY_RECEIVED, SessionEvent.RETIRED):
        return DRAINING, ()
    if event is SessionEvent.DRAINED:
        return (CLOSED, (Action.CLOSE,)) if state is DRAINING else (OPEN, ())
    if event is SessionEvent.REQUEST_SENT and state is DRAINING:
        return DRAINING, (Action.REFUSE,)
    return state, ()  # requests received (a draining side still answers them) and ENDED


def _expected_authenticating(event: SessionEvent
                             ) -> tuple[ConnectionState, tuple[Action, ...]]:
    """Before a credential is accepted: PING and AUTHENTICATE are served, other requests are
    denied, a GOAWAY either way or the time running out closes the connection."""
    match event:
        case SessionEvent.REQUEST_SENT:
            return AUTHENTICATING, (Action.REFUSE,)
        case SessionEvent.REQUEST_RECEIVED:
            return AUTHENTICATING, (Action.DENY,)
        case SessionEvent.PING_RECEIVED:
            return AUTHENTICATING, (Action.SEND_PONG,)
        case SessionEvent.AUTHENTICATED:
            return OPEN, ()
        case SessionEvent.AUTH_TIMED_OUT | SessionEvent.GOAWAY_SENT:
            return CLOSED, (Action.SEND_GOAWAY, Action.CLOSE)
        case SessionEvent.GOAWAY_RECEIVED | SessionEvent.RETIRED:
            return CLOSED, (Action.CLOSE,)
        case SessionEvent.FAILED:
            return CLOSED, (Action.FAIL_ALL, Action.CLOSE)
    return AUTHENTICATING, ()  # ENDED, DRAINED, EXEMPT_RECEIVED


@pytest.mark.parametrize("state,event", list(itertools.product(ConnectionState, SessionEvent)))
def test_every_pair_follows_the_rules(state, event):
    assert TRANSITIONS[state, event] == _expected(state, event)


@pytest.mark.parametrize("state,event", list(itertools.product(ConnectionState, SessionEvent)))
def test_every_pair_applied_to_a_session_with_a_request_in_flight(state, event):
    session: Session[str] = Session(authenticating=state is AUTHENTICATING)
    if state is AUTHENTICATING:
        assert session.admit("peer's") is Action.DENY  # in flight until it is answered
    else:
        session.send_request("waiting")
    _bring_to(session, state)
    actions = session.apply(event)
    expected_state, expected_actions = _expected(state, event)
    if event is SessionEvent.GOAWAY_SENT and state is DRAINING:
        expected_actions = ()  # _bring_to said GOAWAY already: it goes out once
    assert (session.state, actions) == (expected_state, expected_actions)


def _bring_to(session: Session, state: ConnectionState) -> None:
    if state is DRAINING:
        assert session.send_goaway() == (Action.SEND_GOAWAY,)
    elif state is CLOSED:
        session.fail(TransportError("reset"))
        session.drop_all()
    assert session.state is state


def test_an_authenticating_session_serves_ping_and_authenticate_alone():
    session: Session[str] = Session(authenticating=True)
    assert session.authenticating and not session.open
    assert session.send_request("mine") is None  # a server sends nothing of its own yet
    assert session.admit("append") is Action.DENY and "append" in session.received
    assert session.ping_received() == (Action.SEND_PONG,)
    assert session.admit("ping", exempt=True) is None
    assert session.admit("auth", exempt=True) is None
    assert session.authenticated() == ()
    assert session.open and session.admit("fetch") is None
    assert session.auth_timed_out() == () and session.open  # too late to matter


def test_an_unauthenticated_connection_is_closed_when_its_time_is_up():
    session: Session[str] = Session(authenticating=True)
    assert session.auth_timed_out() == (Action.SEND_GOAWAY, Action.CLOSE)
    assert session.closed and session.admit("late", exempt=True) is Action.REFUSE
    assert session.admit("late") is Action.REFUSE


def test_the_shortcuts_match_the_table():
    # The session skips the table for these on every request (the steady state).
    for event in (SessionEvent.REQUEST_SENT, SessionEvent.REQUEST_RECEIVED, SessionEvent.ENDED):
        assert TRANSITIONS[OPEN, event] == (OPEN, ())


def test_peer_table():
    for state in PeerState:
        assert PEER_TRANSITIONS[state, PeerEvent.RECEIVED] is PeerState.ANSWERING
        assert PEER_TRANSITIONS[state, PeerEvent.NO_ANSWER] is PeerState.UNANSWERED
    session: Session[str] = Session()
    assert not session.unanswered and session.last_heard == 0.0
    session.no_answer()
    assert session.unanswered
    session.heard(12.5)
    assert not session.unanswered and session.last_heard == session.last_active == 12.5


def test_stream_ids_count_from_one_and_skip_those_in_flight():
    session: Session[str] = Session(max_stream_id=5)
    items = [f"request {i}" for i in range(7)]
    assert [session.send_request(items[i]) for i in range(3)] == [1, 2, 3]
    assert session.release(2, items[1]) == ()
    assert session.send_request(items[3]) == 4
    assert session.send_request(items[4]) == 5
    # Past the top it wraps to 1, skipping 1 and 3 (still in flight) but taking 2 again.
    assert session.send_request(items[5]) == 2
    assert session.answered(1) == (items[0], ())
    assert session.send_request(items[6]) == 1
    assert sorted(session.sent) == [1, 2, 3, 4, 5]
    with pytest.raises(ProtocolError, match="all 5 stream ids are in flight"):
        session.send_request("one too many")


def test_a_stale_release_leaves_the_new_owner_of_an_id_alone():
    session: Session[object] = Session(max_stream_id=2)
    old, new = object(), object()
    sid = session.send_request(old)
    assert session.answered(sid) == (old, ())
    session.send_request(object())
    assert session.send_request(new) == sid  # the id is free again
    assert session.release(sid, old) == ()  # the old waiter's late release
    assert session.waiting(sid) is new


def test_goaway_received_drains_then_closes_after_the_last_answer():
    session: Session[str] = Session()
    first, second = session.send_request("a"), session.send_request("b")
    assert session.goaway_received() == ()
    assert session.state is DRAINING and session.drained_by is SessionEvent.GOAWAY_RECEIVED
    assert session.send_request("c") is None  # no new requests after GOAWAY
    assert session.answered(first) == ("a", ())
    assert session.answered(second) == ("b", (Action.CLOSE,))
    assert session.state is CLOSED and session.error is None


def test_goaway_with_nothing_in_flight_closes_at_once_and_is_sent_once():
    session: Session[str] = Session()
    assert session.send_goaway() == (Action.SEND_GOAWAY, Action.CLOSE)
    assert session.send_goaway() == ()
    server: Session[str] = Session()
    assert server.receive_request("r1")
    assert server.send_goaway() == (Action.SEND_GOAWAY,)
    # Sent before the peer heard the GOAWAY: still taken, and answered.
    assert server.receive_request("r2")
    assert server.send_goaway() == ()
    assert server.finished("r1") == ()
    assert server.finished("r2") == (Action.CLOSE,)
    assert not server.receive_request("r3")


def test_a_failure_fails_everything_in_flight_once():
    session: Session[str] = Session()
    session.send_request("a")
    session.receive_request("peer's")
    error = TransportError("reset by peer")
    assert session.fail(error) == (Action.FAIL_ALL, Action.CLOSE)
    assert session.drop_all() == (["a"], ["peer's"])
    assert session.fail(TransportError("later")) == ()
    assert session.error is error and session.drained_by is SessionEvent.FAILED
    assert session.finished("peer's") == () and session.answered(1) == (None, ())


def test_pings_are_answered_until_closed():
    session: Session[str] = Session()
    assert session.ping_received() == (Action.SEND_PONG,)
    session.send_request("a")
    session.retire()
    assert session.ping_received() == (Action.SEND_PONG,)
    session.release(1, "a")
    assert session.closed and session.ping_received() == ()


def test_pong_and_goaway_frames():
    ping = decode_frame(b"".join(bytes(b) for b in _frame(Opcode.PING, 0, 7, b"h", b"pay")))
    pong = decode_frame(b"".join(bytes(b) for b in pong_frame(ping)))
    assert (pong.opcode, pong.flags, pong.stream_id) == (Opcode.PING,
                                                         Flags.RESPONSE | Flags.END, 7)
    assert bytes(pong.header) == b"h" and bytes(pong.payload) == b"pay"
    goaway = decode_frame(b"".join(bytes(b) for b in goaway_frame("stopping")))
    assert (goaway.opcode, goaway.flags, goaway.stream_id) == (Opcode.GOAWAY, 0, 0)
    request = decode_request(goaway)
    assert isinstance(request, GoAwayRequest) and request.message == "stopping"


def _frame(opcode, flags, sid, header, payload):
    from sbp_spark.protocol.frame import encode_frame

    return encode_frame(opcode, flags, sid, header, payload)


def test_throttle_and_idleness():
    session: Session[str] = Session()
    session.throttle(5.0)
    session.throttle(3.0)  # an earlier end does not shorten the wait
    assert session.throttled_until == 5.0
    session.last_active = 10.0
    assert session.idle(20.0, 10.0) and not session.idle(19.0, 10.0)
    session.send_request("a")
    assert not session.idle(100.0, 10.0)


# -- random sequences ------------------------------------------------------------------------

class Model:
    """A session driven by random operations, next to what it should hold."""

    def __init__(self) -> None:
        self.session: Session[int] = Session(max_stream_id=8)
        self.sent: dict[int, int] = {}  # stream id -> item
        self.received: set[int] = set()
        self.counter = itertools.count()
        self.closes = self.goaways = 0

    def send(self, pick: int) -> tuple[Action, ...]:
        before, item = self.session.state, next(self.counter)
        sid = self.session.send_request(item)
        if before is OPEN:
            assert sid is not None and 1 <= sid <= 8 and sid not in self.sent
            self.sent[sid] = item
        else:
            assert sid is None
        return ()

    def receive(self, pick: int) -> tuple[Action, ...]:
        before, item = self.session.state, -next(self.counter) - 1
        taken = self.session.receive_request(item)
        assert taken == (before is not CLOSED)
        if taken:
            self.received.add(item)
        return ()

    def answer(self, pick: int) -> tuple[Action, ...]:
        if not self.sent:
            return ()
        sid = sorted(self.sent)[pick % len(self.sent)]
        item = self.sent.pop(sid)
        got, actions = self.session.answered(sid)
        assert got == item
        return actions

    def release(self, pick: int) -> tuple[Action, ...]:
        if not self.sent:
            return ()
        sid = sorted(self.sent)[pick % len(self.sent)]
        return self.session.release(sid, self.sent.pop(sid))

    def finish(self, pick: int) -> tuple[Action, ...]:
        if not self.received:
            return ()
        item = sorted(self.received)[pick % len(self.received)]
        self.received.discard(item)
        return self.session.finished(item)

    def goaway_in(self, pick: int) -> tuple[Action, ...]:
        return self.session.goaway_received()

    def goaway_out(self, pick: int) -> tuple[Action, ...]:
        return self.session.send_goaway()

    def retire(self, pick: int) -> tuple[Action, ...]:
        return self.session.retire()

    def ping(self, pick: int) -> tuple[Action, ...]:
        before = self.session.state
        actions = self.session.ping_received()
        assert (Action.SEND_PONG in actions) == (before is not CLOSED)
        return actions

    def fail(self, pick: int) -> tuple[Action, ...]:
        actions = self.session.fail(TransportError("reset"))
        if Action.FAIL_ALL in actions:
            dropped, dropped_in = self.session.drop_all()
            assert sorted(dropped) == sorted(self.sent.values())
            assert set(dropped_in) == self.received
            self.sent.clear()
            self.received.clear()
        return actions

    def check(self, before: ConnectionState, actions: tuple[Action, ...]) -> None:
        """The rules, after every step."""
        session = self.session
        self.closes += actions.count(Action.CLOSE)
        self.goaways += actions.count(Action.SEND_GOAWAY)
        assert before is not CLOSED or session.state is CLOSED  # closed stays closed
        assert self.closes == (1 if session.state is CLOSED else 0)  # closed exactly once
        assert self.goaways <= 1
        assert dict(session.sent) == self.sent and session.received == self.received
        if session.state is DRAINING:
            assert self.sent or self.received  # draining with nothing in flight has closed


_OPS = ("send", "receive", "answer", "release", "finish", "goaway_in", "goaway_out",
        "retire", "ping", "fail")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 7)), max_size=60))
def test_random_sequences_keep_the_rules(ops):
    model = Model()
    for op, pick in ops:
        if len(model.sent) == 8:
            break  # every id in flight: sending more is refused (another test)
        before = model.session.state
        model.check(before, getattr(model, op)(pick))
