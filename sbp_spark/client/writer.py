"""Appending to one stream: ``StreamWriter`` finds the stream's open range through the PD,
sends the batches to its primary and follows seals and failovers to the next range."""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence

from sbp_spark.protocol.errors import (
    AppendOutcomeUnknownError,
    BatchFormatError,
    RangeNotFoundError,
    RangeSealedError,
    ReplicationFailedError,
    SbpError,
)
from sbp_spark.protocol.messages import AppendResult, ProducerSequence, Range, RangeId
from sbp_spark.protocol.records import BATCH_MAGIC, ENVELOPE_SIZE, BatchHeader, BodyFormat

from ._calls import unwrap
from .config import ClientConfig
from .in_doubt import held_in_sealed_range
from .pd import PdClient
from .primary_reach import PrimaryReach, heard_since, is_unreached
from .producer import Producer
from .range_server import BatchLike, RangeServerClient, batch_buffers
from .retry import Retrier, is_retriable
from .types import Appended, ItemResult, Outcome

_log = logging.getLogger(__name__)


# Given the indexes of batches about to be sent again, those already stored, with where.
ResendCheck = Callable[[list[int]], dict[int, Appended]]


class StreamWriter:
    """Appends record batches to one stream, wherever its open range lives.

    Finds the open range's primary through the PD, sends the batches there (packed into frames
    within the frame limit, several frames in flight), follows seals to the next range and
    retries what may be retried. Thread-safe; not ordered across concurrent ``append`` calls.
    """

    def __init__(self, pd: PdClient, stream_id: int,
                 range_server: Callable[[str], RangeServerClient] | None = None,
                 config: ClientConfig | None = None, reached: dict[int, int] | None = None,
                 producer: Producer | None = None) -> None:
        self.pd = pd
        self.stream_id = int(stream_id)
        self.config = config if config is not None else pd.config
        # Whose batches these are (idempotent appends): the client's, shared by its writers;
        # one of its own for a writer made alone; None when the config turns it off.
        self.producer = producer if producer is not None or not self.config.idempotent \
            else Producer()
        # How to reach the range server at an address (``SbpClient.range_server``).
        self._range_server = range_server if range_server is not None else (
            lambda address: RangeServerClient(address, self.config, pd.pool))
        # stream id -> the last range that stored a batch of this writer (or of the writers
        # sharing the dict): the range has reached its primary (see ``_send``).
        self._reached: dict[int, int] = reached if reached is not None else {}
        self._lock = threading.Lock()
        self._range: Range | None = None
        # The range a range server last answered RANGE_SEALED for.
        self._sealed_index: int | None = None
        # The range a RANGE_SEALED was taken as a late push for once (``_not_pushed_yet``).
        self._rechecked_index: int | None = None
        # Since when each primary went unreached: when to seal its range and move on.
        self._reach = PrimaryReach(self.config.unreachable_primary_s)

    def __repr__(self) -> str:
        return f"StreamWriter(stream_id={self.stream_id})"

    @property
    def open_range(self) -> Range:
        """The range appends go to now (asked from the PD when unknown)."""
        return self._open_range(None)

    def _open_range(self, deadline: float | None) -> Range:
        """``open_range``, asking the PD until ``deadline`` (None: the config's)."""
        with self._lock:
            if self._range is None:
                self._range = self._find_open_range(deadline)
            return self._range

    def refresh(self) -> None:
        """Forget the cached open range; the next append asks the PD again."""
        with self._lock:
            self._range = None

    def _list_ranges(self, deadline: float | None = None) -> list[Range]:
        (result,) = self.pd.list_ranges([self.stream_id], deadline)
        return unwrap(result, f"stream {self.stream_id}")

    def _find_open_range(self, deadline: float | None) -> Range:
        ranges = self._list_ranges(deadline)
        if ranges and ranges[-1].is_open:
            last = ranges[-1]
            if last.range_index != self._sealed_index or self._not_pushed_yet(last):
                return last
            # Its primary sealed it on its own (a secondary failed to store a batch) and the PD
            # has not heard of it: ask the PD to seal it where the primary ended and to open
            # the next range (seal-and-new).
            (result,) = self.pd.seal_ranges([last], deadline,
                                            timeout_ms=self._seal_timeout_ms())
            return unwrap(result, f"sealing range {last.range_index} of stream "
                                   f"{self.stream_id} after its primary sealed it")
        # No open range (sealed without a successor): open the next.
        next_index = ranges[-1].range_index + 1 if ranges else 0
        (created,) = self.pd.create_range([RangeId(self.stream_id, next_index)], deadline)
        if created.ok and created.value is not None:
            return created.value
        # Someone else may have opened it meanwhile: look again once.
        ranges = self._list_ranges(deadline)
        if ranges and ranges[-1].is_open:
            return ranges[-1]
        raise RangeSealedError(
            f"stream {self.stream_id} has no open range and opening range {next_index} "
            f"failed: {created.exception()}")

    def append(self, batches: Sequence[BatchLike],
               before_resend: ResendCheck | None = None) -> list[Appended]:
        """Append record batches (bytes-like, or buffer lists as ``encode_batch`` makes);
        returns where each landed, in input order.

        Batches failing with a retriable status are sent again (after a PD look-up when the
        range was sealed or moved) until they land, through failovers, or the call's retry
        deadline passes (``ClientConfig.retry_deadline_s``). Delivery is at least once: a
        batch whose answer was lost may be stored twice, unless ``before_resend`` is given:
        it is called with the indexes of the batches about to be sent again and returns those
        it finds already stored (index -> where), which are then not sent again (the
        idempotent streaming sink looks for its write tags).

        A call that fails says what it knows: ``AppendOutcomeUnknownError`` when batches are
        in doubt (sent, with no answer saying whether they were stored); otherwise the
        failure itself, every batch not stored by then known not to be (a non-retriable
        failure names the batch it came with).
        """
        deadline = time.monotonic() + self.config.retry_deadline_s
        call = _AppendCall(self, batches, before_resend, deadline)
        if not call.pending:
            return []
        retrier = Retrier(self.config, deadline=deadline)
        retrier.on_error = lambda error: self._after_failure(error, call, retrier)
        call.on_new_range = retrier.progressed
        try:
            retrier.run(call.attempt)
        except SbpError as exc:
            # Chained to the failure itself: the error says how long the call tried.
            raise call.failure(exc, retrier) from (
                retrier.stopped[0] if retrier.stopped is not None else exc)
        return call.landed()

    def _send(self, target: Range, address: str, entries: list[tuple[int, list]],
              producers: list[ProducerSequence] | None = None) -> list[ItemResult]:
        """APPEND ``entries`` to ``target``'s primary; one outcome per entry, in order.
        ``producers``: each entry's producer and sequence (idempotent appends), or None.

        The frames of one call are in flight together, so their order holds only if the
        server refuses every frame after one it refused. Within a range it does (a seal
        refuses all that follow), but not before the range reached it: the PD records a range
        before it tells the range's servers, so a writer may learn of it first; the frames
        served before it arrived were refused, those served after stored, and the refused
        ones, sent again, landed after them. So the first batch to a range goes alone, and
        the rest once the range took it.
        """
        server = self._range_server(address)

        def still_primary(silent_since: float) -> bool:
            return self._still_primary(target, address, silent_since)

        if self._reached.get(self.stream_id) == target.range_index or len(entries) == 1:
            return server.append(entries, still_primary=still_primary, producers=producers)
        (first,) = server.append(entries[:1], still_primary=still_primary,
                                 producers=producers[:1] if producers else None)
        error = first.exception()
        if error is not None:  # the rest was not sent: it fails the same way, not stored
            unsent = ItemResult[AppendResult](None, error=error.with_context(
                f"not sent: the first batch sent to range {target.range_index} failed"))
            return [first] + [unsent] * (len(entries) - 1)
        self._reached[self.stream_id] = target.range_index
        return [first, *server.append(entries[1:], still_primary=still_primary,
                                      producers=producers[1:] if producers else None)]

    def _still_primary(self, target: Range, address: str, silent_since: float) -> bool:
        """Asked when ``address``, appended to as ``target``'s primary, lets a PING go
        unanswered (it has sent nothing since ``silent_since``, a ``time.monotonic()``
        value): True while the PD still lists ``target`` open with that primary.

        A stopped server and a busy one whose reader holds back (its backpressure, while a
        slow disk holds the requests queued before the PING) look alike from here, and the
        batches in flight, sent again, could be stored twice. Sending them elsewhere helps
        only once the PD has moved the range (after the server's heartbeats stopped), so until
        then the writer keeps waiting; a PD that cannot be asked counts as a yes. Except past
        ``unreachable_primary_s`` (``PrimaryReach``) while the PD has heard the server since
        (``_pd_heard_since_lost``): only the link between the two is broken, nothing will fail
        the range over, and the writer seals it and moves on (``_note_reach``). The PD's seal
        settles what the frames in flight became, so sending them again elsewhere is as safe
        as after a failover."""
        unreached_s = self._reach.unreached(address, since=silent_since)
        deadline = time.monotonic() + self.config.probe_interval_s
        try:
            ranges = self._list_ranges(deadline)
        except SbpError as exc:
            _log.debug("stream %d: asking the PD whether %s is still the primary failed: %s",
                      self.stream_id, address, exc)
            return True
        listed = next((rng for rng in ranges if rng.range_index == target.range_index), None)
        if listed is None or not listed.is_open or listed.primary is None or \
                listed.primary.advertise_addr != address:
            return False
        if unreached_s >= self._reach.after_s and \
                self._pd_heard_since_lost(address, deadline):
            _log.info("stream %d: %s, the primary of range %d, has not answered for %.1f s "
                      "while the PD hears it: giving up on it", self.stream_id, address,
                      target.range_index, unreached_s)
            return False
        return True

    def _pd_heard_since_lost(self, address: str, deadline: float) -> bool:
        """Whether the PD has heard the range server at ``address`` since this writer last
        did (``primary_reach.heard_since``): it counts the server live, and its last heartbeat
        came after the request this writer has had no answer to was sent. Then the server
        is up and only the link between the two is broken. A server stopped or killed since
        (the PD still counts it live for its liveness timeout) is not: its failover moves the
        range, and a seal would only wait on it meanwhile, holding the stream's lock the
        failover needs. The PD says how long ago it heard the server by its own clock, so no
        clocks are compared. False when the PD cannot say; a PD that reports liveness only
        (``silent_ms`` -1) is taken at its word."""
        try:
            states = self.pd.range_servers(deadline)
        except SbpError as exc:
            _log.info("stream %d: could not ask the PD whether it hears %s: %s",
                      self.stream_id, address, exc)
            return False
        unreached_s = self._reach.unreached_for(address)
        return any(state.server.advertise_addr == address
                   and heard_since(state.live, state.silent_ms, unreached_s)
                   for state in states)

    def _seal_timeout_ms(self) -> int:
        """The bound of the PD's calls to a range's replicas when this writer asks for a
        seal: short (two probe intervals, at least 1 s), so that a replica that is stopped
        holds the seal, and the stream's lock a failover also needs, for seconds, not the
        30 s of ``server_timeout_ms`` (twice: the PD tries each replica twice)."""
        config = self.config
        return min(config.server_timeout_ms, max(1000, int(2000 * config.probe_interval_s)))

    def _not_pushed_yet(self, rng: Range) -> bool:
        """Whether ``rng``'s primary does not hold ``rng`` yet, so that its RANGE_SEALED was
        about the range before (which it holds, sealed), not about ``rng``.

        The PD records a new range before it has told the range's servers (secondaries
        first, the primary last: about 0.1 s), so a writer that learns of the range from the
        PD meanwhile meets a primary that refuses its batch with RANGE_SEALED for the range
        before. Taking that for this range sealed by its primary would have the PD seal the
        new range at once, empty, and open yet another (where a writer seals a range it cannot
        reach, the next one may then land on that server again). The push may also arrive
        between the refusal and this question: the primary then shows ``rng`` open. So does
        a primary that sealed ``rng`` itself while the PD has not recorded the end (it shows
        such a range open, as its end is not final), so an open answer earns one more try
        only: the batch sent again lands if the push was late, and is refused again if the
        primary sealed the range. Anything else (the primary holds ``rng`` sealed, or cannot
        be asked) is taken as sealed, as it always was."""
        primary = rng.primary
        if primary is None or not primary.advertise_addr:
            return False
        try:
            (described,) = self._range_server(primary.advertise_addr).describe_ranges(
                [RangeId(self.stream_id, rng.range_index)])
            held = described.unwrap()
        except RangeNotFoundError:
            held = None
        except SbpError:
            return False
        if held is not None:  # the primary holds the range: open, once, or sealed
            if not held.is_open or self._rechecked_index == rng.range_index:
                return False
            self._rechecked_index = rng.range_index
        self._sealed_index = None
        return True

    def _note_reach(self, target: Range, address: str, outcomes: Sequence[ItemResult],
                    deadline: float, sent_at: float) -> None:
        """After an APPEND to ``target``'s primary at ``address``, sent at ``sent_at`` (a
        ``time.monotonic()`` value): any answer shows the server reachable; none at all (every
        outcome a connection failure or a timeout) counts towards giving up on it, from when
        it was sent, and once it went unreached for ``unreachable_primary_s`` the range is
        sealed (``_seal_unreached``)."""
        errors = [o.exception() for o in outcomes]
        if any(error is None or not is_unreached(error) for error in errors):
            self._reach.reached(address)
            return
        self._reach.unreached(address, since=sent_at)
        if self._reach.overdue(address):
            self._seal_unreached(target, address, deadline)

    def _seal_unreached(self, target: Range, address: str, deadline: float) -> None:
        """Ask the PD to seal ``target``, whose primary at ``address`` this writer has not
        reached for ``unreachable_primary_s``, and take the range it opens next.

        The PD's seal is its ordinary seal-and-new: it ends the range at the smallest end
        its replicas report, which holds every acknowledged record, and places the next range
        away from ``address`` (``placement.choose_servers``). A range the PD has already
        sealed (a failover, another writer) is not sealed again: the answer is the open range
        after it. The seal's calls to the replicas get a short timeout: a server that is
        really down is the PD's failover's to deal with, which a seal waiting on that server
        would hold up (both take the stream's lock). For the same reason a server the PD has
        not heard since this writer lost it (stopped, dead or cut off from the PD too) is left
        to the failover, and nothing is sealed here."""
        if not self._pd_heard_since_lost(address, deadline):
            _log.info("stream %d: the PD does not hear %s, the unreached primary of range %d, "
                      "either: its failover moves the range", self.stream_id, address,
                      target.range_index)
            return
        try:
            (result,) = self.pd.seal_ranges([RangeId(self.stream_id, target.range_index)],
                                            deadline, timeout_ms=self._seal_timeout_ms())
            opened = unwrap(result, f"sealing range {target.range_index} of stream "
                                    f"{self.stream_id}, whose primary {address} is unreached")
        except SbpError as exc:
            _log.info("stream %d: sealing range %d, whose primary %s is unreached, failed "
                      "(tried again on the next failure): %s", self.stream_id,
                      target.range_index, address, exc)
            return
        # A fresh count: the next range's primary has not failed this writer yet.
        self._reach.reached(address)
        if opened.range_index != target.range_index + 1:
            return  # someone moved the stream on before: nothing sealed on our account
        primary = opened.primary
        _log.warning("stream %d: no answer from %s, the primary of range %d, for %.1f s or "
                     "more while the PD still lists it there; sealed the range, writes go on "
                     "in range %d on %s", self.stream_id, address, target.range_index,
                     self._reach.after_s, opened.range_index,
                     primary.advertise_addr if primary is not None else "no primary yet")
        with self._lock:
            self._range = opened

    def _after_failure(self, error: SbpError, call: _AppendCall, retrier: Retrier) -> bool:
        """After an attempt of ``call`` failed (``Retrier.on_error``): True to try again at
        once. So it does when the stream went on past the range the attempt tried (this
        writer sealed it, its primary unreached): the next range's primary has failed
        nothing yet, and the backoff the failures before it grew (up to
        ``retry_backoff_max_ms``) would only hold the writer up. The nemesis saw writers wait
        up to 5 s more in the new range that way."""
        current = self._range  # before ``_on_error``, which may forget it
        immediate = self._on_error(error)
        if call.tried is not None and current is not None and \
                current.range_index > call.tried:
            retrier.progressed()
            return True
        return immediate

    def _on_error(self, error: SbpError) -> bool:
        # The flag, not a list of classes: a primary that went silent (a timeout) may have
        # been failed over, and only the PD knows where the open range is now.
        if error.invalid_metadata:
            self.refresh()
        # A seal is routine, not a fault: retry at once against the new open range.
        return isinstance(error, RangeSealedError)


class _AppendCall:
    """One ``StreamWriter.append`` call: its batches, what became of each (stored where,
    pending, or in doubt: sent with no answer saying whether it was stored) and its attempts.
    """

    def __init__(self, writer: StreamWriter, batches: Sequence[BatchLike],
                 before_resend: ResendCheck | None, deadline: float) -> None:
        self.writer = writer
        self.deadline = deadline  # the PD calls of its attempts end there too
        self.stream_id = writer.stream_id
        self.items = [_describe_batch(i, b) for i, b in enumerate(batches)]
        self.results: list[Appended | None] = [None] * len(self.items)
        self.pending = list(range(len(self.items)))  # not known stored, in index order
        # Batch index -> the ranges it was sent to with its answer lost: it may be stored
        # there. A batch stored later (or found by ``before_resend``) leaves it.
        self.in_doubt: dict[int, set[int]] = {}
        self.before_resend = before_resend
        self.attempts = 0
        # The range the last attempt went to, and what to call when an attempt goes to a
        # later one (the retry loop's ``progressed``: its backoff starts over).
        self.tried: int | None = None
        self.on_new_range: Callable[[], None] = lambda: None
        # Batch index -> (range_index, sequence, producer_id) it was last sent under
        # (idempotent appends): sent again to that range, it keeps its sequence, and the
        # range stores it once.
        self.sequences: dict[int, tuple[int, int, int]] = {}

    def attempt(self) -> None:
        """Send the pending batches to the stream's open range; raises the first retriable
        failure when some remain pending, the first other one at once."""
        self.attempts += 1
        writer = self.writer
        # The open range first: after a failed append the PD ends the range it went to
        # (seal-and-new), and only then is what that range holds final. Until then a replica
        # fenced by a failed replication hides a tail that may stay in the range, so a check
        # before the seal would miss batches that then land twice.
        target = writer._open_range(self.deadline)
        if self.tried is not None and target.range_index > self.tried:
            self.on_new_range()  # a failover or a seal moved the stream on meanwhile
        self.tried = target.range_index
        self._look_before_resending(target.range_index)
        if not self.pending:
            return
        primary = target.primary
        if primary is None or not primary.advertise_addr:
            writer.refresh()
            raise RangeSealedError(
                f"open range {self.stream_id}/{target.range_index} lists no primary")
        sent_at = time.monotonic()
        outcomes = writer._send(target, primary.advertise_addr,
                                [(self.stream_id, self.items[i][0]) for i in self.pending],
                                self._producers(target.range_index))
        writer._note_reach(target, primary.advertise_addr, outcomes, self.deadline, sent_at)
        # Every outcome is taken in before a failure is raised: what the others did counts.
        retry_error: SbpError | None = None
        final_error: SbpError | None = None
        sent, self.pending = self.pending, []
        for index, outcome in zip(sent, outcomes, strict=True):
            error = outcome.exception()
            if error is None:
                _, length, count = self.items[index]
                self._stored(index, Appended(self.stream_id, target.range_index,
                                             outcome.unwrap().base_offset, count, length))
                writer._reached[self.stream_id] = target.range_index
                continue
            self.pending.append(index)
            if outcome.outcome is Outcome.UNKNOWN:
                self.in_doubt.setdefault(index, set()).add(target.range_index)
            if isinstance(error, (RangeSealedError, ReplicationFailedError)):
                # The primary sealed the range (a replica failed to store a batch).
                writer._sealed_index = target.range_index
            if not is_retriable(error):
                if final_error is None:
                    final_error = error.with_context(
                        f"append of batch {index} to stream {self.stream_id} at "
                        f"{primary.advertise_addr}")
            elif retry_error is None:
                retry_error = error
        if final_error is not None:
            raise final_error
        if retry_error is not None:
            raise retry_error

    def _look_before_resending(self, range_index: int) -> None:
        """Take out of ``pending`` the batches found stored already: in doubt in a range
        sealed since (``_settle_in_doubt``), or by the caller's ``before_resend``."""
        if self.in_doubt and self.writer.producer is not None:
            self._settle_in_doubt(range_index)
        if self.attempts > 1 and self.before_resend is not None and self.pending:
            found = self.before_resend(list(self.pending))
            for index in self.pending:
                if index in found:
                    self._stored(index, found[index])
            self.pending = [i for i in self.pending if i not in found]

    def _settle_in_doubt(self, range_index: int) -> None:
        """Before batches in doubt in an earlier range are sent to range ``range_index``:
        ask that range (sealed by now) which of them it holds (``in_doubt.py``). Those are
        stored there; the others leave doubt and are sent as new batches."""
        writer = self.writer
        # (earlier range, producer id) -> batch indexes in doubt there
        moved: dict[tuple[int, int], list[int]] = {}
        for index in self.pending:
            sent = self.sequences.get(index)
            if index in self.in_doubt and sent is not None and sent[0] != range_index:
                moved.setdefault((sent[0], sent[2]), []).append(index)
        if not moved:
            return
        ranges = {rng.range_index: rng for rng in writer._list_ranges(self.deadline)}
        for (earlier, producer_id), indexes in moved.items():
            rng = ranges.get(earlier)
            if rng is None or rng.is_open:
                continue  # trimmed away, or not sealed yet: nothing to settle from it
            held = held_in_sealed_range(rng, producer_id,
                                        [self.sequences[i][1] for i in indexes],
                                        writer._range_server)
            if held is None:
                continue
            for index in indexes:
                base = held[self.sequences[index][1]]
                if base >= 0:
                    _, length, count = self.items[index]
                    self._stored(index, Appended(self.stream_id, earlier, base, count, length))
                else:
                    self.in_doubt.pop(index, None)  # known not stored there
        self.pending = [i for i in self.pending if self.results[i] is None]

    def _producers(self, range_index: int) -> list[ProducerSequence] | None:
        """The producer and sequence of each pending batch in range ``range_index`` (None:
        not idempotent). A batch first sent there takes the next sequences, in index order;
        one sent there before keeps its own."""
        producer = self.writer.producer
        if producer is None:
            return None
        sequences = self.sequences
        if len(self.pending) == 1:  # a lone batch: most calls
            index = self.pending[0]
            sent = sequences.get(index)
            if sent is None or sent[0] != range_index:
                pid, first = producer.take(self.stream_id, range_index, 1)
                sent = sequences[index] = (range_index, first, pid)
            return [ProducerSequence(sent[2], sent[1], range_index)]
        new = [i for i in self.pending if sequences.get(i, (-1, 0, 0))[0] != range_index]
        if new:
            pid, first = producer.take(self.stream_id, range_index, len(new))
            for n, index in enumerate(new):
                sequences[index] = (range_index, first + n, pid)
        return [ProducerSequence(sequences[i][2], sequences[i][1], range_index)
                for i in self.pending]

    def _stored(self, index: int, appended: Appended) -> None:
        self.results[index] = appended
        self.in_doubt.pop(index, None)

    def landed(self) -> list[Appended]:
        """Where every batch landed, in input order (the call succeeded)."""
        landed = [appended for appended in self.results if appended is not None]
        if len(landed) != len(self.results):
            # The retry loop returns only once no batch is pending: this would be a bug.
            raise RuntimeError(f"append to stream {self.stream_id}: batches {self.pending} "
                               f"got no answer")
        return landed

    def failure(self, exc: SbpError, retrier: Retrier) -> SbpError:
        """The error the call ends with, after ``exc`` ended its retries: what was stored,
        what was not, and what may have been (``AppendOutcomeUnknownError``)."""
        stored = tuple(i for i, r in enumerate(self.results) if r is not None)
        total = len(self.items)
        if retrier.stopped is not None:  # retried until it could not: say how long
            cause, why = retrier.stopped
            ended = f"append to stream {self.stream_id} {retrier.effort(why)}"
        else:
            cause, ended = exc, f"append to stream {self.stream_id} failed"
        if not self.in_doubt:
            if retrier.stopped is None:
                return exc  # named the batch already, or the PD's answer says what failed
            return cause.with_context(
                f"{ended}, with {len(stored)} of {total} batches of the call stored (is the "
                f"range server up? a stream with replicas > 1 moves to live servers once the "
                f"PD notices); the other {total - len(stored)} were not; the last failure")
        doubt = sorted(self.in_doubt)
        ranges = tuple(sorted(set().union(*self.in_doubt.values())))
        not_stored = total - len(stored) - len(doubt)
        return AppendOutcomeUnknownError.for_call(
            f"{ended}: {len(stored)} of {total} batches of the call stored, {len(doubt)} in "
            f"doubt (batch{'es' if len(doubt) > 1 else ''} {_listed(doubt)}, sent to range"
            f"{'s' if len(ranges) > 1 else ''} {_listed(ranges)} with no answer saying "
            f"whether {'they were' if len(doubt) > 1 else 'it was'} stored: "
            f"{'they' if len(doubt) > 1 else 'it'} may be in the stream, and sending "
            f"{'them' if len(doubt) > 1 else 'it'} again may store "
            f"{'them' if len(doubt) > 1 else 'it'} twice), {not_stored} not stored; the "
            f"last failure: {cause}",
            self.stream_id, tuple(doubt), ranges, stored, total)


def _listed(numbers: Sequence[int], shown: int = 10) -> str:
    """``3, 4, 9`` (the first ``shown``, then how many more)."""
    text = ", ".join(str(n) for n in numbers[:shown])
    return text + (f" and {len(numbers) - shown} more" if len(numbers) > shown else "")


_ENVELOPE = struct.Struct(">BBHqiqi")


def _describe_batch(index: int, batch: BatchLike) -> tuple[list, int, int]:
    """(buffers, batch_length, record_count) of one batch, after checking its envelope."""
    buffers = batch_buffers(batch)
    length = sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers)
    first = memoryview(buffers[0]).cast("B") if buffers else memoryview(b"")
    head = first if first.nbytes >= ENVELOPE_SIZE else b"".join(bytes(b) for b in buffers)
    if len(head) < ENVELOPE_SIZE:
        raise BatchFormatError(
            f"batch {index}: {length} bytes cannot hold the {ENVELOPE_SIZE}-byte envelope")
    header = BatchHeader(*_ENVELOPE.unpack_from(head, 0)[1:])
    if head[0] != BATCH_MAGIC:
        raise BatchFormatError(f"batch {index}: magic {head[0]:#04x} is not {BATCH_MAGIC:#04x}")
    if header.body_format not in (BodyFormat.OPAQUE, BodyFormat.ARROW):
        raise BatchFormatError(f"batch {index}: body_format {header.body_format} is unknown")
    if header.record_count < 1:
        raise BatchFormatError(f"batch {index}: record_count {header.record_count} is below 1")
    if header.batch_length != length:
        raise BatchFormatError(
            f"batch {index}: the envelope says {header.batch_length} bytes, the batch has "
            f"{length}")
    return buffers, length, header.record_count

