"""Primary-to-secondary replication of appended batches.

The primary of a range stores a client's batches, then forwards them, exactly as stored (base
offsets already assigned), to every secondary as an ordinary APPEND frame. Every forward names
its range (``AppendRequest.range_index``); a secondary accepts one only for a range it is a
secondary of, and only if the batches' offsets continue its log exactly. An APPEND that names
no range is a client's, and a secondary refuses it with NOT_PRIMARY whatever base offsets its
batches carry. A secondary takes a forward into no range but the one it names: a primary cut
off from the PD may go on forwarding batches of a range the PD has already ended, at offsets
where the next range begins.

Order: the local append and the forward are done under one lock per range, and each secondary
gets its frames over one connection, which it reads and applies in order, so a secondary's log
is always a prefix of the primary's.

An entry is acknowledged when it is durable locally and every secondary stored it. When a
secondary fails, the entries fail with REPLICATION_FAILED and the primary seals the range: the
writer then asks the PD, which seals the range where the replicas ended and opens a new one.
A primary's seal (its own, or the PD's SEAL_RANGES) ends the range before the first append
still waiting for the secondaries (``ReadCap.fence``): when the PD counts the primary alone
(its secondary died), the range must not keep an append its writer is told failed and sends
again. Such an append fails (RANGE_SEALED) even if a secondary's answer comes later, and a
late answer is not waited for once the range is sealed (a stopped secondary answers nothing
until the forward's timeout; the PD's failover seals the range within seconds).

Readers of an open range see only records every replica stored (the range's read cap, see
``RangeLog.read_cap``): a record that not every replica holds is not acknowledged yet and
would not survive a failover (the PD seals a range at the smallest end its live replicas
hold), so no reader may see it first. On the primary, ``ReadCap.hold``/``release`` move
the cap as the secondaries store appends. Every forward carries the primary's cap (no higher
than what is durable on the primary itself) as ``committed_offset``, and a secondary that
stored the forward raises its own cap to it.

Cap notices close the two gaps forwards leave. A notice is an APPEND whose ``cap_notice``
names the range, with no entries and no payload, and whose ``committed_offset`` is the
primary's cap, or -1 to only ask. A secondary raises its cap as for a forward and answers
with its stored end of the range as the one result's ``base_offset``.
* When the last pending append of a range settles (the range went quiet), the primary sends
  its new cap in a notice, so the secondaries' readers see the end of a burst without waiting
  for the next append. Under load the next forward carries the cap instead.
* After a restart every open replicated range starts capped at its start, on the primary as
  on the secondaries: a restarted primary cannot tell whether its tail reached the
  secondaries. The primary asks them (a notice with -1); when every one answered, everything
  below the smallest stored end (and below its own durable end) is on every replica, so its
  cap rises there, and a second notice passes the cap on. Without that probe, the first append
  after the restart does the same: it settles only if every secondary continued its log
  exactly where the primary's ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...client.config import ClientConfig
from ...client.connection import Connection, ResponseStream
from ...client.pool import ConnectionPool
from ...protocol.constants import Opcode
from ...protocol.errors import ReplicationFailedError, SbpError
from ...protocol.frame import Frame
from ...protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    ProducerSequence,
    RangeId,
    RangeReplica,
    decode_response,
    request_frame,
)
from ...transport.tls import TlsConfig
from ..storage.range_log import RangeLog

log = logging.getLogger(__name__)

# A secondary must store a forwarded frame within this time, or the entries fail.
DEFAULT_REPLICATION_TIMEOUT_S = 30.0
# A client's append that asks for less (its timeout_ms) waits at most that long for the
# secondaries, but never less than this: a forward that fails seals the range for every
# writer, so one impatient client must not seal ranges over a busy moment.
MIN_FORWARD_TIMEOUT_S = 1.0


# While a forward's answer is late, the primary looks this often whether the range was sealed
# meanwhile (by the PD's failover, say), which ends the wait.
SEALED_CHECK_S = 0.25

# How long a secondary may take to answer a cap notice.
NOTICE_TIMEOUT_S = 10.0

# A forward's answer this late, from a secondary that then lets a PING go unanswered too
# (one probe interval, 1 s), fails the forward (``_settled_answer_of``): about 2 s in all.
# The PING is what tells a broken link or a stopped server from a slow one (a secondary
# waiting for its disk answers it from its network core at once), so its wait need not be
# long. The writers then ask the PD to seal the range; that seal does not wait on a stopped
# secondary past one bounded try (the PD skips one it no longer hears, and asks the others
# all at once). It was 5 s when a seal waited twice the PD's timeout on each stopped
# secondary in turn (a primary cut off from its secondaries held its writers about 7 s), then
# 2 s (about 4 s); the nemesis still saw writers wait over 8 s when the PD leader died as the
# writers asked for the seal: the PD's election (up to its 3 s lease) comes on top of this.
SECONDARY_GIVE_UP_S = 1.0


# How many ranges' unreachable secondaries a primary remembers (``Replicator.unreachable``):
# the PD asks right after the range was sealed, so the latest few are all that matter.
UNREACHABLE_KEPT = 1024


@dataclass(frozen=True, slots=True)
class ReplicationProblem:
    """Why a forward did not settle on every secondary: what each failed one said, and which
    of them could not be reached from here at all (a broken link, a stopped server), as
    opposed to ones that answered with a refusal (the range sealed there, say)."""

    message: str
    unreachable: tuple[int, ...] = ()

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class Unanswered:
    """No answer from a secondary: the connection failed, or it let a forward and a PING go
    unanswered (``_settled_answer_of``). ``why`` says which."""

    why: str


@dataclass
class NoticeAnswer:
    """One secondary's answer to a cap notice: its stored end of the range, or the problem."""

    replica: RangeReplica
    stored_end: int | None
    problem: str | None = None


@dataclass
class Forward:
    """One forwarded frame to one secondary: its answer stream and the connection it went
    over, or why it was not sent."""

    replica: RangeReplica
    stream: ResponseStream | None
    error: SbpError | None = None
    conn: Connection | None = None
    # When the append's forwards went out (time.monotonic()): how late an answer is counts
    # from there, not from when the primary began to wait for this one.
    sent_at: float = 0.0


class Replicator:
    """A primary's calls to the secondaries of its ranges: forwards of stored batches, and cap
    notices. Which replicas are the secondaries is the caller's to say (``roles.py``)."""

    def __init__(self, timeout_s: float = DEFAULT_REPLICATION_TIMEOUT_S,
                 tls: TlsConfig | None = None, token: str | None = None) -> None:
        # With TLS, secondaries are called with this server's own certificate; with tokens,
        # as this server's principal (only servers may forward).
        self.pool = ConnectionPool(ClientConfig(request_timeout_s=timeout_s, retries=0
                                                ).with_tls(tls).with_token(token))
        self._locks: dict[tuple[int, int], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # (stream, range) -> the secondaries its last failed forward could not reach, the
        # latest ``UNREACHABLE_KEPT`` ranges (insertion order: oldest first).
        self._unreachable: dict[tuple[int, int], tuple[int, ...]] = {}

    def close(self) -> None:
        self.pool.close()

    def order_lock(self, rlog: RangeLog) -> threading.Lock:
        """Held across a local append and its forwards, so secondaries see the same order."""
        key = (rlog.stream_id, rlog.range_index)
        with self._locks_guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
            return lock

    def notify(self, rlog: RangeLog, secondaries: Sequence[RangeReplica], committed: int,
               timeout_s: float = NOTICE_TIMEOUT_S) -> list[NoticeAnswer]:
        """Send a cap notice for ``rlog`` carrying ``committed`` (-1: only ask) to its
        ``secondaries`` and wait for their answers: each one's stored end of the range, or
        why there is none. Sent over the same connections as the forwards, after them."""
        request = AppendRequest(timeout_ms=int(timeout_s * 1000), committed_offset=committed,
                                cap_notice=RangeId(rlog.stream_id, rlog.range_index))
        if committed >= 0:
            rlog.cap.note_sent(committed)
        sent: list[tuple[RangeReplica, ResponseStream | None, str | None]] = []
        for replica in secondaries:
            if not replica.server.advertise_addr:
                sent.append((replica, None, "no known address"))
                continue
            try:
                conn = self.pool.get(replica.server.advertise_addr)
                stream = conn.start(Opcode.APPEND, lambda sid: request_frame(sid, request),
                                    timeout_s)
                sent.append((replica, stream, None))
            except SbpError as exc:
                sent.append((replica, None, repr(exc)))
        out = []
        for replica, answers, problem in sent:
            stored = None
            if answers is not None:
                answer = _answer_of(answers)
                if isinstance(answer, str):
                    problem = answer
                elif len(answer.append_responses) != 1:
                    problem = f"{len(answer.append_responses)} results for one notice"
                elif not answer.append_responses[0].status.ok:
                    problem = answer.append_responses[0].status.message
                else:
                    stored = answer.append_responses[0].base_offset
            out.append(NoticeAnswer(replica, stored, problem))
        return out

    def send(self, rlog: RangeLog, secondaries: Sequence[RangeReplica],
             stored: Sequence[Sequence], timeout_ms: int,
             producers: Sequence[ProducerSequence] = ()) -> list[Forward]:
        """Send the stored batches (``[envelope, body]`` each) to the ``secondaries`` of
        ``rlog``; call under ``order_lock(rlog)`` right after ``rlog.cap.hold`` and the local
        append. ``producers``: empty, or each batch's producer and sequence (idempotent
        appends), which every secondary keeps with the batch.

        Each forward carries the range's current read cap as ``committed_offset`` (at most
        where these batches start), bounded by what is durable here too: the secondaries may
        let their readers see that far. A secondary has the append's ``timeout_ms`` to answer
        (within ``MIN_FORWARD_TIMEOUT_S`` and the replication timeout): past it the writer
        has stopped waiting anyway, and a secondary that went silent (a link that drops
        everything) fails the append then, so the range is sealed and writers move on,
        instead of all of them waiting the whole replication timeout."""
        entries = []
        payload: list = []
        for i, pieces in enumerate(stored):
            entries.append(AppendEntry(rlog.stream_id, i,
                                       sum(memoryview(p).nbytes for p in pieces)))
            payload.extend(pieces)
        committed = rlog.cap.committed(rlog.next_offset)
        if committed >= 0:
            rlog.cap.note_sent(committed)
        request = AppendRequest(timeout_ms=timeout_ms, append_requests=entries,
                                committed_offset=committed, range_index=rlog.range_index,
                                producers=list(producers))
        wait_s = None  # the pool's: the replication timeout
        if timeout_ms > 0:
            wait_s = min(max(timeout_ms / 1000.0, MIN_FORWARD_TIMEOUT_S),
                         self.pool.config.request_timeout_s)
        out = []
        sent_at = time.monotonic()
        for replica in secondaries:
            if not replica.server.advertise_addr:
                out.append(Forward(replica, None, ReplicationFailedError(
                    f"secondary {replica.server.server_id} has no known address")))
                continue
            try:
                conn = self.pool.get(replica.server.advertise_addr)
                stream = conn.start(Opcode.APPEND,
                                    lambda sid: request_frame(sid, request, payload), wait_s)
                out.append(Forward(replica, stream, conn=conn, sent_at=sent_at))
            except SbpError as exc:
                out.append(Forward(replica, None, exc))
        return out

    def wait(self, rlog: RangeLog, forwards: Sequence[Forward]) -> ReplicationProblem | None:
        """Wait for every secondary's answer; None when all stored everything, else why not.

        A late answer stops being waited for once ``rlog`` is sealed here (see
        ``_settled_answer_of``). The secondaries are waited for one after the other, each
        answer's lateness counted from when the forwards went out, and once one secondary
        is found unreachable the others' answers are taken only if they are in already: two
        secondaries cut off from this primary fail the append as soon as one would (it used
        to take twice the give-up time, 12 s, as the second wait began when the first ended,
        and then a second more for the second one's PING).

        The secondaries that could not be reached (no connection, or no answer nor PING
        answer in time) are remembered for the range (``unreachable``): the primary seals it
        then, and the PD keeps the next range away from them (and away from the primary,
        which is what a link broken between it and any secondary needs)."""
        problems = []
        unreachable = []
        for fw in forwards:
            sid = fw.replica.server.server_id
            where = f"secondary {sid} ({fw.replica.server.advertise_addr})"
            if fw.stream is None:
                problems.append(f"{where}: {fw.error}")
                unreachable.append(sid)
                continue
            answer: AppendResponse | Unanswered | str
            if unreachable:
                # The append fails already, and the range will be sealed: an answer that
                # is not in yet is not waited for (nor PINGed for: a primary cut off from
                # both secondaries used to fail a second later than from one).
                answer = _answer_by_now(fw.stream)
            else:
                answer = _settled_answer_of(fw.stream, rlog, fw.conn,
                                            self.pool.config.probe_interval_s, fw.sent_at)
            if isinstance(answer, Unanswered):
                problems.append(f"{where}: {answer.why}")
                unreachable.append(sid)
                continue
            if isinstance(answer, str):
                problems.append(f"{where}: {answer}")
                continue
            failed = [r.status for r in answer.append_responses if not r.status.ok]
            if failed:
                problems.append(f"{where}: {failed[0].message}")
        if unreachable:
            self._note_unreachable(rlog, unreachable)
        return ReplicationProblem("; ".join(problems), tuple(unreachable)) if problems else None

    def unreachable(self, stream_id: int, range_index: int) -> tuple[int, ...]:
        """The secondaries of the range this primary could not reach at its last failed
        forward (``wait``), or none."""
        with self._locks_guard:
            return self._unreachable.get((stream_id, range_index), ())

    def _note_unreachable(self, rlog: RangeLog, server_ids: Sequence[int]) -> None:
        key = (rlog.stream_id, rlog.range_index)
        with self._locks_guard:
            self._unreachable.pop(key, None)
            self._unreachable[key] = tuple(dict.fromkeys(server_ids))
            while len(self._unreachable) > UNREACHABLE_KEPT:
                del self._unreachable[next(iter(self._unreachable))]


def _settled_answer_of(answers: ResponseStream, rlog: RangeLog,
                       conn: Connection | None = None, probe_s: float | None = None,
                       sent_at: float | None = None) -> AppendResponse | Unanswered | str:
    """A secondary's answer to a forward (as ``_answer_of``), waited for ``SEALED_CHECK_S``
    at a time: once the range is sealed here, an append still waiting for a secondary can
    no longer settle (the seal ended the range before it, ``ReadCap.fence``), so waiting on
    is pointless. That is how a primary whose secondary stopped (its process frozen: its
    kernel still takes the forwards, so no error comes) answers once the PD failed the
    range over, instead of after the whole replication timeout. An answer that comes in
    time costs what it did: one wait for the frame.

    From ``SECONDARY_GIVE_UP_S`` late on, each ``probe_s`` the secondary is PINGed over
    ``conn`` (``Connection.answers_ping``): one that shows nothing within ``probe_s`` either
    (no PING answer, no other answer) cannot be reached from here (a broken link, which the
    PD does not see: it hears both servers), and the forward fails then, not at its timeout
    (the writer's ``timeout_ms``, 30 s by default, during which every writer of the range
    stalled). The primary then seals the range and its writers move on. A secondary that is
    only slow (an fsync, a busy disk) answers the PING from its network core and is waited
    for. ``sent_at``: when the forward went out (default: when this wait began); the time
    limits count from there."""
    first = min(SEALED_CHECK_S, answers.timeout)
    try:
        with answers:
            frame = answers.poll(first)
            if frame is None:  # late: from here on, the slow path
                began = time.monotonic() - first if sent_at is None else sent_at
                give_up = began + answers.timeout
                next_probe = began + SECONDARY_GIVE_UP_S if probe_s is not None else None
            while frame is None:
                now = time.monotonic()
                left = give_up - now
                if left <= 0:
                    raise answers.give_up(f"within {answers.timeout:g}s")
                if rlog.sealed:
                    return (f"no answer yet, and range {rlog.stream_id}/{rlog.range_index} "
                            f"was sealed here at {rlog.end_offset} meanwhile")
                if conn is not None and next_probe is not None and now >= next_probe:
                    assert probe_s is not None
                    if not conn.answers_ping(probe_s):
                        return Unanswered(
                            f"no answer within {time.monotonic() - began:.1f}s, nor to a "
                            f"PING within {probe_s:g}s: the secondary cannot be reached "
                            f"from here, or is stopped")
                    next_probe = time.monotonic() + probe_s
                    frame = answers.poll(0.0)
                    continue
                frame = answers.poll(min(SEALED_CHECK_S, left))
    except (SbpError, StopIteration) as exc:
        return Unanswered(repr(exc))
    return _decoded(frame)


def _answer_by_now(answers: ResponseStream) -> AppendResponse | str:
    """A secondary's answer if it has come in (as ``_answer_of``), else why it is not
    waited for."""
    try:
        with answers:
            frame = answers.poll(0.0)
    except (SbpError, StopIteration) as exc:
        return repr(exc)
    if frame is None:
        return "no answer yet when another secondary was found unreachable"
    return _decoded(frame)


def _answer_of(answers: ResponseStream) -> AppendResponse | str:
    """A secondary's answer to one APPEND (forward or notice), or why there is none: no
    frame, an error frame, or a refusal of the whole request."""
    try:
        with answers as frames:
            frame = next(frames)
    except (SbpError, StopIteration) as exc:
        return repr(exc)
    return _decoded(frame)


def _decoded(frame: Frame) -> AppendResponse | str:
    """A secondary's answer frame, or why it refused the whole request."""
    try:
        msg = decode_response(frame)
    except SbpError as exc:
        return repr(exc)
    if not isinstance(msg, AppendResponse):
        return str(msg)  # a SYSTEM_ERROR says what went wrong
    if not msg.status.ok:
        return msg.status.message
    return msg
